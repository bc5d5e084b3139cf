"""The HTTP server under the app: uvicorn's h11 protocol with a header timeout and a connection limit.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never times out a request whose headers
arrive slowly, so a few hundred clients trickling header bytes held every socket forever (slowloris). Here a
connection must deliver complete request headers within ``timeout_headers_s`` of opening, or of finishing its
previous response; and beyond ``max_connections`` open connections a new one is answered 503 + ``Retry-After``
(JSON, like every error) and closed at once.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from msn_serve.config import Settings


def _busy_response() -> bytes:
    body = json.dumps({"error": "too many open connections (max_connections); retry later"}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """h11 protocol with ``header_timeout`` (seconds) and ``max_connections``, set by :func:`protocol_for`."""

    header_timeout = 10.0
    max_connections = 1024
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_busy_response())
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self._arm()  # the first bytes of a request (a keep-alive connection's next one): headers now due
        super().data_received(data)
        if self._in_request():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for the idle wait
        self._disarm()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()


def protocol_for(settings: Settings) -> type[GuardedH11Protocol]:
    """A protocol class carrying ``settings``' header timeout and connection limit (uvicorn instantiates it)."""
    return type("MsnH11Protocol", (GuardedH11Protocol,), {"header_timeout": settings.timeout_headers_s,
                                                         "max_connections": settings.max_connections})


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` for ``settings`` (also used by tests that start a server)."""
    return {"host": settings.host, "port": settings.port, "log_level": settings.log_level.lower(),
            "access_log": False, "timeout_graceful_shutdown": 10, "http": protocol_for(settings),
            "timeout_keep_alive": settings.timeout_keep_alive_s}
