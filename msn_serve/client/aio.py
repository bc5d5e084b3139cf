"""The asynchronous client: the same methods as :class:`~msn_serve.client.Client`, awaited; one
``httpx.AsyncClient`` per :class:`AsyncClient`."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Self

import httpx

from msn_serve.client.api import Endpoints
from msn_serve.client.errors import TransportError
from msn_serve.client.retry import RetryPolicy, next_step
from msn_serve.client.sync import answer_of, http_options, parsed
from msn_serve.client.wire import Call


class AsyncClient(Endpoints):
    """``async with AsyncClient(url) as c: r = await c.embed("cat.png")``; every method of
    :class:`~msn_serve.client.Client` returns an awaitable of the same result here."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 60.0, retry: RetryPolicy | None = None,
                 model: str | None = None, headers: dict[str, str] | None = None, **httpx_options: Any):
        self.retry = retry or RetryPolicy()
        self.model = model
        self._http = httpx.AsyncClient(**http_options(base_url, api_key, timeout, headers), **httpx_options)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _do(self, call: Call) -> Any:  # type: ignore[override]
        start, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                r = await self._http.request(call.method, call.path, content=call.content, headers=call.headers,
                                             params=call.params)
            except httpx.HTTPError as e:
                raise TransportError(f"{call.method} {self._http.base_url}{call.path}: {type(e).__name__}: {e}") \
                    from e
            answer = answer_of(r)
            wait = next_step(self.retry, call, answer, attempt, time.monotonic() - start, str(r.url))
            if wait is None:
                return parsed(call, answer)
            await asyncio.sleep(wait)
