"""The one exception type handlers raise for client mistakes; rendered as ``{"error": ..., "detail": ...}``.

Every error the service emits is JSON with an ``error`` key (the Open Inference Protocol clients, e.g.
``tritonclient``, crash on anything else), so a single type with a status code keeps that promise in one place.
"""
from __future__ import annotations

import re
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ApiError(Exception):
    """A client-visible failure: HTTP ``status``, short ``message`` and optional structured ``detail``."""

    def __init__(self, status: int, message: str, detail: Any = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.message}
        if self.detail is not None:
            out["detail"] = self.detail
        return out


def bad_request(message: str, detail: Any = None) -> ApiError:
    return ApiError(400, message, detail)


def unprocessable(message: str, detail: Any = None) -> ApiError:
    return ApiError(422, message, detail)


def not_found(message: str) -> ApiError:
    return ApiError(404, message)


def conflict(message: str) -> ApiError:
    return ApiError(409, message)


def read_only_replica() -> ApiError:
    return ApiError(403, "this replica is read-only (--read-only / MSN_SERVE_ROLE=reader): send writes to the "
                         "writer, which publishes them with POST /admin/snapshot")


def too_large(message: str) -> ApiError:
    return ApiError(413, message)


def check_name(name: str, what: str = "name") -> str:
    """Reject names that could escape the data directory or surprise a filesystem."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise unprocessable(f"invalid {what} {name!r}: must match {NAME_RE.pattern}")
    return name
