"""When a request is sent again: a 503 (the server is busy, or a write could not be stored and was rolled back;
either way nothing was done) is retried after the server's ``Retry-After``, within a bounded number of attempts and
a bounded total time. Nothing else is retried: any other answer may mean the request did something."""
from __future__ import annotations

from dataclasses import dataclass

from msn_serve.client.errors import ServiceUnavailable, retry_after_seconds, status_error
from msn_serve.client.wire import Answer, Call


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` sends at most (1 = never retry); no retry would end later than ``max_total_s`` after the
    first send; each wait is the server's ``Retry-After`` (``backoff_s * 2**(attempt-1)`` without one), capped at
    ``max_delay_s``."""

    max_attempts: int = 5
    max_total_s: float = 30.0
    max_delay_s: float = 10.0
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_total_s < 0 or self.max_delay_s < 0 or self.backoff_s < 0:
            raise ValueError(f"invalid retry policy {self}")

    def delay(self, attempt: int, retry_after: str | None) -> float:
        """Seconds to wait before the next send after ``attempt`` sends."""
        wait = retry_after_seconds(retry_after)
        if wait is None:
            wait = self.backoff_s * 2 ** (attempt - 1)
        return min(wait, self.max_delay_s)


NO_RETRY = RetryPolicy(max_attempts=1)


def next_step(policy: RetryPolicy, call: Call, answer: Answer, attempt: int, elapsed: float, url: str) -> float | None:
    """``None`` when ``answer`` is the call's answer; the seconds to wait when it should be sent again; raises the
    server's error otherwise (a 503 once the policy allows no more sends, with ``attempts`` set)."""
    if 200 <= answer.status < 300 or answer.status in call.accept_status:
        return None
    err = status_error(answer.status, answer.content, answer.headers, call.method, url)
    if answer.status == 503 and call.retry and attempt < policy.max_attempts:
        wait = policy.delay(attempt, answer.headers.get("retry-after"))
        if elapsed + wait <= policy.max_total_s:
            return wait
    if isinstance(err, ServiceUnavailable):
        err.attempts = attempt
    raise err
