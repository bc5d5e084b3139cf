"""API keys with scopes: who may call which route.

Three scopes: ``read`` (embed, search, predict, list, inspect), ``write`` (index and classifier changes) and ``admin``
(publish, reload, model management). Every route of the app is given one in :data:`ROUTE_SCOPES`, the one table
(``tests/serve/test_scoped_keys.py`` checks that no route is missing from it); health probes need no key.

Keys come from the one-key setting (``api_key_file`` / ``MSN_SERVE_API_KEY``: a key with every scope) and from a keys
file (``api_keys_file``), one key a line::

    # scopes          key (sha256:<hex> of the key, or the key itself)           name (optional, for the log)
    read              sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  dashboard
    read,write        sha256:...                                                   ingest-job
    read,write,admin  sha256:...                                                   operator

Storing ``sha256:`` digests (``printf %s "$KEY" | sha256sum``) keeps secrets out of the file. The file is re-read
when it changes (checked at most once a second, on the next request) and on SIGHUP, without a restart; a file that
no longer parses keeps the previous keys and logs the line at fault. A presented key is hashed and compared with
every stored digest in constant time (:func:`hmac.compare_digest`). Keys are never logged: only names, or the first
8 hex digits of a digest.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("msn_serve")

SCOPES = ("read", "write", "admin")
OPEN = "open"  # no key needed (health probes)
POLL_S = 1.0  # how often, at most, the keys file's mtime is checked
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")

# "METHOD /path template" -> the scope a key needs. A route missing here needs admin (and fails the test).
ROUTE_SCOPES: dict[str, str] = {
    **{f"GET {p}": OPEN for p in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")},
    **{f"GET {p}": "read" for p in (
        "/metrics", "/info", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
        "/fewshot", "/fewshot/{name}", "/index", "/index/{name}", "/admin/snapshot",
        "/v2", "/v2/models/{model}/ready", "/v2/models/{model}/versions/{ver}/ready", "/v2/models/{model}",
        "/v2/models/{model}/versions/{ver}", "/v2/models/{model}/config", "/v2/models/{model}/versions/{ver}/config",
        "/v1/models", "/v1/models/{model}")},
    **{f"HEAD {p}": "read" for p in ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")},
    **{f"POST {p}": "read" for p in (
        "/embed", "/fewshot/{name}/predict", "/fewshot/{name}/suggest", "/fewshot/{name}/predict_index",
        "/index/{name}/search", "/index/{name}/select", "/v2/models/{model}/infer",
        "/v2/models/{model}/versions/{ver}/infer", "/v1/embeddings")},
    **{f"POST {p}": "write" for p in ("/fewshot/fit", "/index/{name}", "/index/{name}/add", "/index/{name}/delete")},
    **{f"DELETE {p}": "write" for p in ("/fewshot/{name}", "/index/{name}")},
    **{f"POST {p}": "admin" for p in ("/admin/snapshot", "/admin/reload")},
    "PUT /admin/models/{name}": "admin",
    "DELETE /admin/models/{name}": "admin",
}


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKey:
    digest: bytes
    scopes: frozenset[str]
    name: str


def parse_keys_file(text: str, source: str) -> list[ApiKey]:
    """The keys of a keys file (format in the module docstring); ``ValueError`` naming the line otherwise."""
    keys: list[ApiKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) not in (2, 3):
            raise ValueError(f"{source}:{number}: expected 'scopes key [name]', got {len(words)} words")
        scopes = frozenset(s.strip() for s in words[0].split(",") if s.strip())
        unknown = scopes - set(SCOPES)
        if not scopes or unknown:
            raise ValueError(f"{source}:{number}: unknown scope(s) {sorted(unknown)}; use {', '.join(SCOPES)}")
        m = _DIGEST.match(words[1])
        key_digest = bytes.fromhex(m.group(1)) if m else digest(words[1])
        name = words[2] if len(words) == 3 else f"sha256:{key_digest.hex()[:8]}"
        keys.append(ApiKey(key_digest, scopes, name))
    return keys


class KeyRing:
    """The keys the server accepts now: the one-key setting plus a keys file, re-read when the file changes."""

    def __init__(self, single_key: str | None, keys_file: Path | None):
        self.keys_file = keys_file
        self._single = [ApiKey(digest(single_key), frozenset(SCOPES), "api_key")] if single_key else []
        self._file_keys: list[ApiKey] = []
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if keys_file is not None:
            self._file_keys = self._read()  # at start-up a bad file is an error (the caller refuses to start)
            log.info("API keys file %s: %d key(s): %s", keys_file, len(self._file_keys), self._names())

    @property
    def enabled(self) -> bool:
        return bool(self._single) or self.keys_file is not None

    def _names(self) -> str:
        return ", ".join(f"{k.name} ({','.join(s for s in SCOPES if s in k.scopes)})" for k in self._file_keys)

    def _read(self) -> list[ApiKey]:
        assert self.keys_file is not None
        st = os.stat(self.keys_file)
        keys = parse_keys_file(self.keys_file.read_text(encoding="utf-8"), str(self.keys_file))
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        return keys

    def reload(self, *, force: bool = False) -> None:
        """Re-read the keys file if it changed (always with ``force``, as on SIGHUP); a bad file keeps the keys."""
        if self.keys_file is None:
            return
        with self._lock:
            self._checked = time.monotonic()
            try:
                st = os.stat(self.keys_file)
                if not force and (st.st_mtime_ns, st.st_size, st.st_ino) == self._stamp:
                    return
                self._file_keys = self._read()
            except (OSError, ValueError, UnicodeDecodeError) as e:
                log.error("API keys file not reloaded, the previous keys stay in force: %s", e)
                return
        log.info("API keys file %s reloaded: %d key(s): %s", self.keys_file, len(self._file_keys), self._names())

    def lookup(self, token: str) -> ApiKey | None:
        """The key ``token`` is, compared with every stored digest in constant time; None for an unknown one."""
        if self.keys_file is not None and time.monotonic() - self._checked >= POLL_S:
            self.reload()
        presented, found = digest(token), None
        for key in self._single + self._file_keys:
            if hmac.compare_digest(presented, key.digest) and found is None:
                found = key
        return found


def _pattern(template: str) -> re.Pattern[str]:
    """``/index/{name}/add`` -> a regex matching one path segment per parameter (as the router does)."""
    return re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$")


# Literal templates first, then by fewer parameters: /fewshot/fit is the fit, not a classifier named "fit".
_MATCHERS = sorted(((route.split(" ", 1)[0], route.split(" ", 1)[1], _pattern(route.split(" ", 1)[1]), scope)
                    for route, scope in ROUTE_SCOPES.items()), key=lambda m: m[1].count("{"))


def route_scope(method: str, path: str) -> tuple[str, str | None]:
    """The scope a request for ``method path`` needs and the route template it matched; ``("admin", None)`` when it
    matches no route of the table (fail closed: a route missing from the table is not open to every key)."""
    for m, template, pattern, scope in _MATCHERS:
        if m == method and pattern.match(path):
            return scope, template
    return "admin", None
