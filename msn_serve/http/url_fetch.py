"""Fetching an image given as an ``http(s)://`` URL, for the operator who enabled it (``--allow-url-inputs``).

A URL input makes the server open a connection a client chose, so every fetch is bounded and may only reach the
public internet: the host is resolved once, every address it resolves to must be global unicast (loopback, private,
link-local, shared, multicast, reserved and unspecified addresses are refused before any connection), and the
connection goes to the address that was checked (a second lookup could answer differently: DNS rebinding).
Redirects are not followed (the target of one would need the same checks; a client can send the final URL), the
body is read up to ``url_max_mb`` and the whole fetch must finish within ``url_timeout_s``. The fetch blocks, so
callers run it on a worker thread, never on the event loop.
"""
from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from msn_serve.errors import ApiError, bad_request, too_large

CHUNK = 1 << 16


def public_address(host: str, port: int) -> str:
    """The first address ``host`` resolves to, after checking that *every* one is global unicast (400 if not)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as e:  # gaierror; a NUL in the name is a ValueError
        raise bad_request(f"cannot resolve host {host!r}: {e}") from None
    addresses = []
    for info in infos:
        text = str(info[4][0]).split("%")[0]
        ip = ipaddress.ip_address(text)
        if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1 is 127.0.0.1
            ip = ip.ipv4_mapped
        if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
            raise bad_request(f"host {host!r} resolves to {ip}, a non-public address: URL inputs may only "
                              "reach public addresses")
        addresses.append(str(ip))
    if not addresses:
        raise bad_request(f"host {host!r} resolves to no address")
    return addresses[0]


class _Pinned(http.client.HTTPConnection):
    """HTTP to ``host`` (its Host header) over a connection to the already checked address ``ip``."""

    def __init__(self, host: str, port: int, ip: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.ip = ip
        self.held: socket.socket | None = None  # ``sock`` is cleared once a closing response owns the socket

    def connect(self) -> None:
        self.sock = self.held = socket.create_connection((self.ip, self.port), self.timeout)


class _PinnedTLS(_Pinned):
    """HTTPS to ``host`` (certificate and SNI checked against the name) over a connection to ``ip``."""

    def connect(self) -> None:
        super().connect()
        self.sock = self.held = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def check_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path?query)`` of an http(s) URL without credentials (400 otherwise)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for an invalid port
    except ValueError as e:
        raise bad_request(f"invalid URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_request("expected an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise bad_request("URLs with credentials are not fetched")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port, target


def fetch_image(url: str, *, max_bytes: int, timeout_s: float,
                resolve: Callable[[str, int], str] = public_address) -> bytes:
    """The body of ``GET url`` (200 only), checked as the module says; :class:`ApiError` (400/413) otherwise.
    ``resolve`` picks the address to connect to (the server always uses :func:`public_address`).

    The time limit covers the whole fetch: a timer shuts the socket down at the deadline, so a server that drips
    its headers or body a byte at a time cannot hold the worker thread longer."""
    scheme, host, port, target = check_url(url)
    ip = resolve(host, port)
    conn = (_PinnedTLS if scheme == "https" else _Pinned)(host, port, ip, timeout_s)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        if conn.held is not None:
            with contextlib.suppress(OSError):
                conn.held.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", target, headers={"User-Agent": "msn-serve", "Accept": "image/*"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise bad_request(f"the URL answered a redirect ({resp.status}); redirects are not followed, send the "
                              "final URL")
        if resp.status != 200:
            raise bad_request(f"fetching the URL answered HTTP {resp.status}")
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise too_large(f"the image at the URL has {declared} bytes, over the limit of {max_bytes} (url_max_mb)")
        body = bytearray()
        while chunk := resp.read1(CHUNK):
            body += chunk
            if len(body) > max_bytes:
                raise too_large(f"the image at the URL exceeds the limit of {max_bytes} bytes (url_max_mb)")
        if expired.is_set():  # the shut-down socket read as the end of the body
            raise TimeoutError
        return bytes(body)
    except ApiError:
        raise
    except (OSError, http.client.HTTPException) as e:  # TimeoutError is an OSError
        if expired.is_set() or isinstance(e, TimeoutError):
            raise bad_request(f"fetching the URL took longer than {timeout_s:g} s (url_timeout_s)") from None
        raise bad_request(f"fetching the URL failed: {type(e).__name__}: {e}") from None
    finally:
        timer.cancel()
        conn.close()
