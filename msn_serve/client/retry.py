"""When a request is sent again, and after how long. A retry must never do a thing twice, so what is retried
depends on what the failure says about the first send:

- **429 and 503** (busy, starting, a write rolled back): the server did nothing; every call is retried, after the
  answer's ``Retry-After`` when it has one (a wait over :data:`MAX_RETRY_AFTER_S` is raised at once instead).
- **No connection** (refused, connect or pool timeout): nothing was sent; every call is retried.
- **No answer** after sending (reset, read timeout) and **502/504** (a proxy lost the request or its answer):
  the server may have done it; only idempotent calls are retried (reads, searches, embeddings, upserts by id,
  deletes, PUTs, fits that overwrite; not creating a store or publishing a snapshot).
- Anything else is the answer.

Waits without ``Retry-After`` back off exponentially with jitter (as ``openai`` does); a server's ``Retry-After``
gets up to 20 % added so that clients sent away together do not all come back at once.
"""
from __future__ import annotations

import random

import httpx

from msn_serve.client.errors import APIConnectionError, APIError, APITimeoutError, retry_after_seconds
from msn_serve.client.wire import Answer, Call

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 60.0
NOTHING_DONE = (429, 503)
GATEWAY = (502, 504)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def backoff(retries_done: int) -> float:
    """The wait before retry ``retries_done + 1``: 0.5 s doubling up to 8 s, less up to 25 % at random."""
    return min(INITIAL_BACKOFF_S * 2.0 ** retries_done, MAX_BACKOFF_S) * (1 - 0.25 * random.random())


def connection_error(exc: httpx.HTTPError, call: Call, url: str) -> APIConnectionError:
    """The client's error for a request that got no answer."""
    kind = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return kind(f"{call.method} {url}: {type(exc).__name__}: {exc}")


def wait_after_no_answer(call: Call, exc: httpx.HTTPError, retries_done: int, max_retries: int) -> float | None:
    """Seconds to wait before sending ``call`` again after ``exc``; ``None``: raise."""
    if not call.retry or retries_done >= max_retries:
        return None
    if isinstance(exc, NOT_SENT) or call.idempotent:
        return backoff(retries_done)
    return None


def wait_after_answer(call: Call, answer: Answer, retries_done: int, max_retries: int) -> float | None:
    """Seconds to wait before sending ``call`` again after a non-success ``answer``; ``None``: raise."""
    if not call.retry or retries_done >= max_retries:
        return None
    if answer.status in NOTHING_DONE:
        asked = retry_after_seconds(answer.headers.get("retry-after"))
        if asked is None:
            return backoff(retries_done)
        return None if asked > MAX_RETRY_AFTER_S else asked * (1 + 0.2 * random.random())
    if answer.status in GATEWAY and call.idempotent:
        return backoff(retries_done)
    return None


def counted(err: APIError, sends: int) -> APIError:
    """``err`` with the number of times its request was sent."""
    err.attempts = sends
    return err
