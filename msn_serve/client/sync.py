"""The synchronous client: one ``httpx.Client`` (a pool of kept-alive connections) per :class:`Client`."""
from __future__ import annotations

import json
import time
from typing import Any, Self

import httpx

from msn_serve.client.api import Endpoints
from msn_serve.client.errors import TransportError
from msn_serve.client.retry import RetryPolicy, next_step
from msn_serve.client.wire import Answer, Call


def http_options(base_url: str, api_key: str | None, timeout: float | httpx.Timeout | None,
                 headers: dict[str, str] | None) -> dict[str, Any]:
    """The ``httpx.Client`` / ``AsyncClient`` arguments both clients share."""
    hdrs = {"User-Agent": "msn-serve-client", **(headers or {})}
    if api_key:
        hdrs["Authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url.rstrip("/"), "headers": hdrs,
            "timeout": timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)}


def answer_of(r: httpx.Response) -> Answer:
    return Answer(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)


def parsed(call: Call, answer: Answer) -> Any:
    return call.parse(answer if call.raw else (json.loads(answer.content) if answer.content else None))


class Client(Endpoints):
    """``msn-serve``'s API over HTTP. Use as a context manager (or call :meth:`close`) to release the connections.

    ``api_key`` is sent as ``Authorization: Bearer``; ``timeout`` (seconds, or an ``httpx.Timeout``) bounds each
    send; ``retry`` says how 503s are retried; ``model`` is the default ``model`` of the calls that take one.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 60.0, retry: RetryPolicy | None = None,
                 model: str | None = None, headers: dict[str, str] | None = None, **httpx_options: Any):
        self.retry = retry or RetryPolicy()
        self.model = model
        self._http = httpx.Client(**http_options(base_url, api_key, timeout, headers), **httpx_options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _do(self, call: Call) -> Any:
        start, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                r = self._http.request(call.method, call.path, content=call.content, headers=call.headers,
                                       params=call.params)
            except httpx.HTTPError as e:
                raise TransportError(f"{call.method} {self._http.base_url}{call.path}: {type(e).__name__}: {e}") \
                    from e
            answer = answer_of(r)
            wait = next_step(self.retry, call, answer, attempt, time.monotonic() - start, str(r.url))
            if wait is None:
                return parsed(call, answer)
            time.sleep(wait)
