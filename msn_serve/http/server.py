"""The HTTP server under the app: uvicorn's protocol with a header timeout, a header size cap and a connection limit.

The parser is httptools (the C parser behind Node's llhttp) when it is installed, h11 (pure Python) otherwise
(``--http``); the event loop is uvloop when installed. Per 224-px upload the HTTP layer is the largest part of
the front end's CPU time (docs/serving.md, "Front end"), and on one event loop it is the part no added core helps.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never times out a request whose headers
arrive slowly, so a few hundred clients trickling header bytes held every socket forever (slowloris). Here a
connection must deliver complete request headers within ``timeout_headers_s`` of opening, or of finishing its
previous response, and in at most :data:`MAX_HEADER_BYTES` (httptools has no limit of its own; h11 stops at
uvicorn's 16 KiB first); beyond ``max_connections`` open connections a new one is answered 503 + ``Retry-After``
(JSON, like every error) and closed at once.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from msn_core.optional import available, missing
from msn_serve.config import Settings

MAX_HEADER_BYTES = 64 * 1024
HTTP_IMPLEMENTATIONS = ("auto", "httptools", "h11")


def json_response(status: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer with a JSON error body that closes the connection (sent before any parsing)."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


BUSY = json_response("503 Service Unavailable", "too many open connections (max_connections); retry later",
                      "retry-after: 1\r\n")
HEADERS_TOO_LARGE = json_response("431 Request Header Fields Too Large",
                                   f"request headers over {MAX_HEADER_BYTES} bytes")


class ConnectionGuard:
    """Mixed into a uvicorn HTTP protocol: ``header_timeout`` (seconds), ``max_connections`` and the header size
    cap. Relies only on what both of uvicorn's protocols have: ``connections``, ``cycle``, ``loop``,
    ``transport`` and ``on_response_complete``."""

    header_timeout = 10.0
    max_connections = 1024
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:  # type: ignore[attr-defined]
            transport.write(BUSY)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self._arm()  # the first bytes of a request (a keep-alive connection's next one): headers now due
        super().data_received(data)  # type: ignore[misc]
        if self._in_request():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # arms uvicorn's keep-alive timer for the idle wait
        self._disarm()

    def _in_request(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is not None and not cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)  # type: ignore

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """h11 with the guard (h11 caps headers itself, at uvicorn's 16 KiB)."""


class HeaderCap:
    """For httptools, which has no header limit: the bytes received while a request's headers are being parsed
    (from ``on_message_begin`` to ``on_headers_complete``; a body still arriving after an early answer is never
    counted), capped at :data:`MAX_HEADER_BYTES`."""

    _in_headers = False
    _header_bytes = 0

    def on_message_begin(self) -> None:
        self._in_headers, self._header_bytes = True, 0
        super().on_message_begin()  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        transport = self.transport  # type: ignore[attr-defined]
        if self._in_headers and not transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                transport.write(HEADERS_TOO_LARGE)
                transport.close()


def http_implementation(requested: str) -> str:
    """``httptools`` or ``h11`` for ``requested`` (``auto``: httptools when installed)."""
    if requested not in HTTP_IMPLEMENTATIONS:
        raise ValueError(f"http {requested!r}: expected one of {', '.join(HTTP_IMPLEMENTATIONS)}")
    installed = available("httptools")
    if requested == "httptools" and not installed:
        raise RuntimeError(missing("httptools", "--http httptools"))
    if requested == "auto":
        return "httptools" if installed else "h11"
    return requested


def protocol_for(settings: Settings) -> type[ConnectionGuard]:
    """A protocol class carrying ``settings``' header timeout and connection limit (uvicorn instantiates it)."""
    if http_implementation(settings.http) == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base: type = type("GuardedHttpToolsProtocol", (ConnectionGuard, HeaderCap, HttpToolsProtocol), {})
    else:
        base = GuardedH11Protocol
    return type(f"Msn{base.__name__}", (base,), {"header_timeout": settings.timeout_headers_s,
                                                  "max_connections": settings.max_connections})


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` for ``settings`` (also used by tests that start a server)."""
    return {"host": settings.host, "port": settings.port, "log_level": settings.log_level.lower(),
            "access_log": False, "timeout_graceful_shutdown": 10, "http": protocol_for(settings),
            "loop": "auto", "timeout_keep_alive": settings.timeout_keep_alive_s}
