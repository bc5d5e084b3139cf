"""What the client raises: one :class:`ClientError` base, a subclass per kind of failure the server reports.

An error the server answered carries its status, its message (the ``error`` of the native API's
``{"error": ..., "detail"?: ...}``, or the ``message`` of OpenAI's error object on ``/v1``), the structured
``detail`` when there is one, and the response headers. Catch the subclass for the kind of failure
(:class:`NotFound`, :class:`Conflict`, :class:`PayloadTooLarge`, ...), or :class:`APIStatusError` for any answer
that was not a success, or :class:`ClientError` for everything including a server that cannot be reached.
"""
from __future__ import annotations

import datetime as dt
import json
from email.utils import parsedate_to_datetime
from typing import Any


class ClientError(Exception):
    """Base of every error the client raises."""


class TransportError(ClientError):
    """The request never got an answer: connection refused or reset, a timeout, a protocol error."""


class APIStatusError(ClientError):
    """The server answered with a non-success status: ``status``, ``message``, ``detail`` and ``headers``."""

    def __init__(self, status: int, message: str, *, detail: Any = None, body: Any = None,
                 headers: dict[str, str] | None = None, method: str = "", url: str = ""):
        super().__init__(f"{status} from {method} {url}: {message}" if method else f"{status}: {message}")
        self.status, self.message, self.detail, self.body = status, message, detail, body
        self.headers = headers or {}
        self.method, self.url = method, url


class BadRequest(APIStatusError):
    """400: a malformed request (``/v1`` answers this where the native API answers 422)."""


class AuthenticationError(APIStatusError):
    """401: no API key, or one the server does not know."""


class PermissionDenied(APIStatusError):
    """403: the key lacks the scope the route needs, or a write was sent to a read-only replica."""


class NotFound(APIStatusError):
    """404: no such index, classifier, model or route."""


class Conflict(APIStatusError):
    """409: the name exists, or the store was made by another model (``detail`` names both model ids)."""


class PayloadTooLarge(APIStatusError):
    """413: a limit of the server was exceeded; the message names the setting."""


class UnprocessableEntity(APIStatusError):
    """422: a field is wrong (the message names it; ``detail`` lists every wrong field)."""


class ServiceUnavailable(APIStatusError):
    """503: busy or not ready; raised once the retries allowed by the client's :class:`RetryPolicy` are spent.
    ``retry_after`` is the server's ``Retry-After`` in seconds (``None`` without one), ``attempts`` how many
    times the request was sent."""

    attempts: int = 1

    @property
    def retry_after(self) -> float | None:
        return retry_after_seconds(self.headers.get("retry-after"))


class InsufficientStorage(APIStatusError):
    """507: the data directory is full; nothing was changed."""


class ServerError(APIStatusError):
    """Any other 5xx."""


BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequest, 401: AuthenticationError, 403: PermissionDenied, 404: NotFound, 409: Conflict,
    413: PayloadTooLarge, 422: UnprocessableEntity, 503: ServiceUnavailable, 507: InsufficientStorage,
}


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds: the server sends whole seconds; an HTTP date is read too."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds())


def error_message(body: Any, text: str) -> tuple[str, Any]:
    """(message, detail) of an error body in either shape the server writes."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return err, body.get("detail")
        if isinstance(err, dict) and isinstance(err.get("message"), str):  # OpenAI's error object (/v1)
            return err["message"], {k: v for k, v in err.items() if k != "message"}
    return (text.strip()[:500] or "(empty body)"), None


def status_error(status: int, content: bytes, headers: dict[str, str], method: str, url: str) -> APIStatusError:
    """The exception for a non-success answer."""
    text = content.decode("utf-8", "replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message, detail = error_message(body, text)
    cls = BY_STATUS.get(status, ServerError if status >= 500 else APIStatusError)
    return cls(status, message, detail=detail, body=body, headers=headers, method=method, url=url)
