"""The asynchronous client: the same calls as :class:`~msn_serve.client.Client`, awaited; one
``httpx.AsyncClient`` per :class:`AsyncClient`."""
from __future__ import annotations

import asyncio
from typing import Any, Self

import httpx

from msn_serve.client.api import BaseClient
from msn_serve.client.options import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, ClientOptions, Timeout
from msn_serve.client.sync import next_wait, parsed, request_args
from msn_serve.client.wire import Call


class AsyncClient(BaseClient):
    """``async with AsyncClient() as c: r = await c.embeddings.create("cat.png")``: every call of
    :class:`~msn_serve.client.Client`, with the same arguments, returns an awaitable of the same result here."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: Timeout = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES, model: str | None = None,
                 default_headers: dict[str, str] | None = None, http_client: httpx.AsyncClient | None = None):
        self._bind(ClientOptions.build(base_url, api_key, timeout, max_retries, model, default_headers))
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def _do(self, call: Call) -> Any:  # type: ignore[override]
        sends = 0
        while True:
            sends += 1
            response, failure = None, None
            try:
                response = await self._http.request(**request_args(self.options, call))
            except httpx.RequestError as e:
                failure = e
            wait = next_wait(call, self.options, sends, response, failure)
            if wait is None:
                return parsed(call, response)
            await asyncio.sleep(wait)
