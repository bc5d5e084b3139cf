"""Every route but ``POST /embed``, passed from an HTTP process to the engine process's own app, byte for byte.

The engine process runs the single-process app (:func:`msn_serve.http.app.create_app`) on a Unix socket, so every
other route (``/v1``, OIP, ``/index``, ``/fewshot``, labelling, admin, ``/metrics``, ``/readyz``) answers exactly as
it does without workers: the same auth, limits, errors and state, which all live in that one process. Bodies stream
both ways (a large fit is not held whole here); hop-by-hop headers stay on their own hop.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.types import Receive, Scope, Send

HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailers",
              b"transfer-encoding", b"upgrade"}
_CLIENT_DEFAULTS = {b"accept", b"accept-encoding", b"user-agent"}


class CoreProxy:
    """An ASGI app forwarding each HTTP request to the engine process's Unix socket."""

    def __init__(self, uds: str):
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds), base_url="http://msn-engine",
                                        timeout=None, limits=httpx.Limits(max_connections=None,
                                                                          max_keepalive_connections=64))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        path = scope.get("raw_path") or scope["path"].encode()
        url = path.decode("latin-1") + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
        request = self.client.build_request(scope["method"], url, headers=headers,
                                            content=_body(receive) if has_body else None)
        sent = {k.lower() for k, _ in headers}
        for name in _CLIENT_DEFAULTS - sent:  # httpx adds its own defaults; the engine sees the client's headers
            request.headers.pop(name.decode(), None)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as e:
            body = json.dumps({"error": f"the engine process did not answer ({type(e).__name__}); retry"}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
