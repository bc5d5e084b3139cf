"""The error vocabulary of the whole service: :class:`ApiError`, a client-visible failure with a status code.

Services (embedding, classifiers, indexes) raise it through these helpers, and :mod:`msn_serve.http.app` renders it
as ``{"error": ..., "detail"?: ...}`` with its headers. The status is kept on the error, rather than mapping domain
exception types to statuses at the edge, because the decision is made where the knowledge is: a full disk is a 507
only where the write that failed is known (:func:`storage_error`), a fit that cannot run is a 503 with a
``Retry-After`` only inside the fit pool, and a limit names its setting where it is checked. A status here is a class
of failure (bad input, missing, conflict, too large, busy), not wire format: nothing in it is JSON or HTTP-specific
beyond the number. One type also keeps the promise that every error is JSON with an ``error`` key (Open Inference
Protocol clients, e.g. ``tritonclient``, crash on anything else) in one place.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import math
import re
import reprlib
from collections.abc import Collection, Iterator
from typing import Any

# Used with fullmatch: a ``$`` anchor would also accept a trailing newline ("abc\n" became a directory).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlist, _BRIEF.maxdict = 2, 60, 60, 6, 4


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


Serving = str | Collection[str]  # the model id a server runs, or the ids of all the models it runs


def _ids(serving: Serving) -> list[str]:
    return [serving] if isinstance(serving, str) else list(serving)


class ModelMismatch(ApiError):
    """409: a stored index or classifier was made by a model this server does not run.

    Its vectors (or the features it was fitted on) live in that model's embedding space, so searching it with, adding
    to it from, or predicting with another model's embeddings would answer silently and wrongly. ``detail`` names the
    ids for programs (``server_model_id``: the default model's; ``served_model_ids``: every model's); the message says
    what to do.
    """

    def __init__(self, what: str, name: str, stored: str, serving: Serving):
        ids = _ids(serving)
        if what == "index":
            why = "its vectors are not comparable with this model's"
            remedy = (f"re-embed it with `msn-index migrate --data-dir DATA_DIR --name {name} --bundle BUNDLE` "
                      "(server stopped), load that model (PUT /admin/models/NAME), or delete it and rebuild it")
        else:
            why = "it was fitted on that model's embeddings"
            remedy = "refit it (POST /fewshot/fit with overwrite=true), load that model, or delete it"
        runs = f"model {ids[0]!r}" if len(ids) == 1 else "models " + ", ".join(map(repr, ids))
        super().__init__(409, f"{what} {name!r} was made with model {stored!r} but this server runs {runs}: "
                              f"{why}; {remedy}",
                         {"store_model_id": stored, "server_model_id": ids[0] if ids else None,
                          "served_model_ids": ids, "kind": what, "name": name})


def model_matches(stored: str | None, serving: Serving) -> bool:
    """Whether a store made with ``stored`` may be used by a server running ``serving`` (one id, or all the ids it
    runs). An empty or missing id (stores written before stores were bound to their model) is unknown, not a
    mismatch, and stays usable (with the default model)."""
    return not stored or stored in _ids(serving)


def check_model(what: str, name: str, stored: str | None, serving: Serving) -> None:
    """Raise :class:`ModelMismatch` unless :func:`model_matches` (the one check every reader of a store uses)."""
    if not model_matches(stored, serving):
        raise ModelMismatch(what, name, str(stored), serving)


def read_only_replica() -> ApiError:
    return ApiError(403, "this replica is read-only (--read-only / MSN_SERVE_ROLE=reader): send writes to the "
                         "writer, which publishes them with POST /admin/snapshot")


def too_large(message: str) -> ApiError:
    return ApiError(413, message)


def busy(message: str, retry_after: float) -> ApiError:
    """503 with ``Retry-After`` (whole seconds, at least 1): the client may simply try again later."""
    return ApiError(503, message, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def storage_error(exc: OSError, what: str) -> ApiError:
    """A write that failed on disk and was rolled back: 507 when the disk (or quota) is full, else 503."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(507, f"{what}: not stored, the data directory is full ({reason}); nothing was changed, "
                             "retry once space is freed", headers={"Retry-After": "30"})
    return busy(f"{what}: not stored, the data directory failed ({reason}); nothing was changed, retry later", 5)


def brief(value: Any) -> str:
    """A short repr of client input for error messages (bounded depth and length, safe on deep nesting)."""
    return _BRIEF.repr(value)


def check_name(name: str, what: str = "name") -> str:
    """Reject names that could escape the data directory or surprise a filesystem."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise unprocessable(f"invalid {what} {brief(name)}: must match {NAME_RE.pattern} (the whole name)")
    return name


@contextlib.contextmanager
def persisting(what: str) -> Iterator[None]:
    """Turn a failed disk operation (ENOSPC, EIO, ...) into a 507/503 for the client, logged once here.

    The code inside must leave memory and disk as they were when it raises (or in a state a restart reads as
    either the old or the new one), so the client can simply retry.
    """
    try:
        yield
    except OSError as e:
        logging.getLogger("msn_serve").error("%s: write failed (%s); rolled back", what, e)
        raise storage_error(e, what) from e
