"""The synchronous client: one ``httpx.Client`` (a pool of kept-alive connections) per :class:`Client`, and the
send-and-decide step both clients share."""
from __future__ import annotations

import json
import time
from typing import Any, Self

import httpx

from msn_serve.client.api import BaseClient
from msn_serve.client.errors import status_error
from msn_serve.client.options import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    ClientOptions,
    NotGiven,
    Timeout,
    as_timeout,
)
from msn_serve.client.retry import connection_error, counted, wait_after_answer, wait_after_no_answer
from msn_serve.client.wire import Answer, Call


def request_args(options: ClientOptions, call: Call) -> dict[str, Any]:
    """The ``httpx`` request of ``call``: absolute URL, the client's headers under the call's, its timeout."""
    timeout = options.timeout if isinstance(call.timeout, NotGiven) else as_timeout(call.timeout)
    return {"method": call.method, "url": options.base_url + call.path, "content": call.content,
            "headers": {**options.headers, **call.headers}, "params": call.params, "timeout": timeout}


def next_wait(call: Call, options: ClientOptions, sends: int, response: httpx.Response | None,
              exc: httpx.RequestError | None) -> float | None:
    """``None`` when ``response`` is the call's answer; the seconds to wait before sending it again; raises the
    client's error (with ``attempts``) when the failure is not retried."""
    url = options.base_url + call.path
    if exc is not None:
        wait = wait_after_no_answer(call, exc, sends - 1, options.max_retries)
        if wait is None:
            raise counted(connection_error(exc, call, url), sends) from exc
        return wait
    assert response is not None
    answer = answer_of(response)
    if 200 <= answer.status < 300 or answer.status in call.accept_status:
        return None
    wait = wait_after_answer(call, answer, sends - 1, options.max_retries)
    if wait is None:
        raise counted(status_error(answer.status, answer.content, answer.headers, call.method, str(response.url)),
                      sends)
    return wait


def answer_of(r: httpx.Response) -> Answer:
    return Answer(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)


def parsed(call: Call, r: httpx.Response) -> Any:
    answer = answer_of(r)
    return call.parse(answer if call.raw else (json.loads(answer.content) if answer.content else None))


class Client(BaseClient):
    """``msn-serve``'s API over HTTP. Use as a context manager (or call :meth:`close`) to release the connections.

    ``base_url`` and ``api_key`` default to ``$MSN_BASE_URL`` (else ``http://127.0.0.1:8000``) and
    ``$MSN_API_KEY``; the key is sent as ``Authorization: Bearer``. ``timeout`` (seconds, an ``httpx.Timeout``,
    or ``None``) bounds each send, ``max_retries`` how often a failed call is sent again (docs/serving.md says
    which failures), ``model`` is the default ``model`` of the calls that take one; ``http_client`` is used
    instead of a new ``httpx.Client`` (and left open).
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: Timeout = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES, model: str | None = None,
                 default_headers: dict[str, str] | None = None, http_client: httpx.Client | None = None):
        self._bind(ClientOptions.build(base_url, api_key, timeout, max_retries, model, default_headers))
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def _do(self, call: Call) -> Any:
        sends = 0
        while True:
            sends += 1
            response, failure = None, None
            try:
                response = self._http.request(**request_args(self.options, call))
            except httpx.RequestError as e:
                failure = e
            wait = next_wait(call, self.options, sends, response, failure)
            if wait is None:
                return parsed(call, response)
            time.sleep(wait)
