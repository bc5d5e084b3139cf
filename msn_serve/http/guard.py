"""The guard every request passes first: Bearer auth with scopes and a hard request-body cap, before any parsing.

Used by the app (:mod:`msn_serve.http.app`) and by the HTTP worker processes' own ``/embed`` stage
(:mod:`msn_serve.workers`), so both refuse the same requests with the same answers.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from msn_serve.errors import ApiError
from msn_serve.http.auth import OPEN, KeyRing, route_scope

OPEN_PATHS = {"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"}


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Message]:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return [{"type": "http.response.start", "status": status, "headers": hdrs},
            {"type": "http.response.body", "body": raw}]


class BodyTooLarge(ApiError):
    """Raised from ``receive`` while a body streams in: route code lets an ApiError through (a multipart parser
    included), so a chunked body over the limit is a 413 however it is read."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes (max_body_mb)")


class GuardMiddleware:
    """Bearer auth with scopes (all but health endpoints; :mod:`msn_serve.http.auth`) and a hard request-body cap,
    before any parsing happens.

    A path that matches no route of the scope table needs an admin key (then 404/405). The cap checks
    ``Content-Length`` up front and also counts streamed bytes, so chunked uploads cannot exceed it.
    """

    def __init__(self, app: ASGIApp, *, keys: KeyRing, max_body: int):
        self.app, self.keys, self.max_body = app, keys, max_body

    async def _refused(self, scope: Scope, send: Send) -> bool:
        """Answer 401/403 (and say so) unless the request's key has the scope its route needs."""
        if not self.keys.enabled or scope["path"] in OPEN_PATHS:
            return False
        need, template = route_scope(scope["method"], scope["path"])
        if need == OPEN:
            return False
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        key = self.keys.lookup(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if key is None:
            status, body = 401, {"error": "missing or invalid API key (send 'Authorization: Bearer <key>')"}
        elif need not in key.scopes:
            route = f"{scope['method']} {template or scope['path']}"
            status, body = 403, {"error": f"this API key lacks the '{need}' scope that {route} needs"
                                          + ("" if template else " (a path outside the scope table)"),
                                 "missing_scope": need}
        else:
            return False
        for m in _json(status, body, {"WWW-Authenticate": "Bearer"} if status == 401 else None):
            await send(m)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await self._refused(scope, send):
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            for m in _json(413, {"error": f"request body of {int(length)} bytes exceeds the limit of "
                                          f"{self.max_body} bytes (max_body_mb)"}):
                await send(m)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as e:  # read outside a route (no handler on the way)
            if not started:
                for m in _json(413, e.body()):
                    await send(m)
