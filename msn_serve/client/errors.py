"""What the client raises, named and arranged as the ``openai`` package's errors, so code written against one reads
the same against the other.

    APIError                          every error of the client (``message``, ``attempts``)
    ├── APIConnectionError            no answer: refused, reset, a protocol error
    │   └── APITimeoutError           no answer in time (``timeout=``)
    └── APIStatusError                an answer that is not a success (``status_code``, ``message``, ``detail``,
        │                             ``body``, ``headers``, ``retry_after``)
        ├── BadRequestError 400, AuthenticationError 401, PermissionDeniedError 403, NotFoundError 404,
        │   ConflictError 409, PayloadTooLargeError 413, UnprocessableEntityError 422, RateLimitError 429
        └── InternalServerError >= 500
            ├── ServiceUnavailableError 503   busy or not ready; the server did nothing
            └── InsufficientStorageError 507  the data directory is full; nothing was changed

``message`` is the server's: the ``error`` of the native API's ``{"error": ..., "detail"?: ...}``, or the
``message`` of OpenAI's error object on ``/v1`` (whose other keys are then the ``detail``).
"""
from __future__ import annotations

import datetime as dt
import json
from email.utils import parsedate_to_datetime
from typing import Any


class APIError(Exception):
    """Base of every error the client raises; ``attempts``: how many times the request was sent."""

    attempts: int = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class APIConnectionError(APIError):
    """The request got no answer: connection refused or reset, a protocol error (retried for idempotent calls)."""


class APITimeoutError(APIConnectionError):
    """No answer within the call's ``timeout`` (retried for idempotent calls)."""


class APIStatusError(APIError):
    """The server answered with a non-success status: ``status_code``, the server's ``message``, the structured
    ``detail`` when there is one, the decoded ``body`` and the response ``headers``."""

    def __init__(self, status_code: int, message: str, *, detail: Any = None, body: Any = None,
                 headers: dict[str, str] | None = None, method: str = "", url: str = ""):
        super().__init__(message)
        self.args = (f"{status_code} from {method} {url}: {message}" if method else f"{status_code}: {message}",)
        self.status_code, self.detail, self.body = status_code, detail, body
        self.headers = headers or {}
        self.method, self.url = method, url

    @property
    def retry_after(self) -> float | None:
        """The server's ``Retry-After`` in seconds (``None`` without one)."""
        return retry_after_seconds(self.headers.get("retry-after"))


class BadRequestError(APIStatusError):
    """400: a malformed request (``/v1`` answers this where the native API answers 422)."""


class AuthenticationError(APIStatusError):
    """401: no API key, or one the server does not know."""


class PermissionDeniedError(APIStatusError):
    """403: the key lacks the scope the route needs, or a write was sent to a read-only replica."""


class NotFoundError(APIStatusError):
    """404: no such index, classifier, model or route."""


class ConflictError(APIStatusError):
    """409: the name exists, or the store was made by another model (``detail`` names both model ids)."""


class PayloadTooLargeError(APIStatusError):
    """413: a limit of the server was exceeded; the message names the setting."""


class UnprocessableEntityError(APIStatusError):
    """422: a field is wrong (the message names it; ``detail`` lists every wrong field)."""


class RateLimitError(APIStatusError):
    """429: a proxy in front of the server limits the rate; nothing was done (retried after ``Retry-After``)."""


class InternalServerError(APIStatusError):
    """A 5xx answer."""


class ServiceUnavailableError(InternalServerError):
    """503: busy or not ready, or a write that could not be stored was rolled back; nothing was done, so every call
    is retried after ``Retry-After``; raised once ``max_retries`` are spent."""


class InsufficientStorageError(InternalServerError):
    """507: the data directory is full; nothing was changed (not retried: space is freed by an operator)."""


BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    409: ConflictError, 413: PayloadTooLargeError, 422: UnprocessableEntityError, 429: RateLimitError,
    503: ServiceUnavailableError, 507: InsufficientStorageError,
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
    cls = BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return cls(status, message, detail=detail, body=body, headers=headers, method=method, url=url)
