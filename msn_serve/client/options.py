"""What a client is configured with, as ``openai.OpenAI`` is: ``base_url`` and ``api_key`` (else ``MSN_BASE_URL``
and ``MSN_API_KEY`` from the environment), ``timeout`` and ``max_retries`` (for every call, overridable per call),
``default_headers``, and an optional ``http_client`` (an ``httpx`` client of your own: proxies, limits, transports).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

import httpx

DEFAULT_BASE_URL: Final = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT: Final = 60.0
DEFAULT_MAX_RETRIES: Final = 3
BASE_URL_ENV: Final = "MSN_BASE_URL"
API_KEY_ENV: Final = "MSN_API_KEY"


class NotGiven:
    """The "not passed" default of an option (``None`` is a value: ``timeout=None`` means no timeout)."""

    def __bool__(self) -> Literal[False]:
        return False

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Final = NotGiven()
#: Seconds for the whole exchange, an ``httpx.Timeout`` (connect / read / write / pool), or ``None`` for no limit.
Timeout: TypeAlias = float | httpx.Timeout | None


def as_timeout(value: Timeout) -> httpx.Timeout:
    return value if isinstance(value, httpx.Timeout) else httpx.Timeout(value)


@dataclass(frozen=True)
class ClientOptions:
    """A client's settings; :meth:`replace` makes those of ``with_options``."""

    base_url: str
    api_key: str | None
    timeout: httpx.Timeout
    max_retries: int
    model: str | None
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, base_url: str | None, api_key: str | None, timeout: Timeout, max_retries: int,
              model: str | None, default_headers: dict[str, str] | None) -> ClientOptions:
        base_url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
        api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        headers = {"User-Agent": "msn-serve-client", **(default_headers or {})}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        return cls(base_url.rstrip("/"), api_key, as_timeout(timeout), max_retries, model, headers)

    def replace(self, *, timeout: Timeout | NotGiven = NOT_GIVEN, max_retries: int | NotGiven = NOT_GIVEN,
                model: str | None | NotGiven = NOT_GIVEN) -> ClientOptions:
        if isinstance(max_retries, int) and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        return ClientOptions(
            self.base_url, self.api_key,
            self.timeout if isinstance(timeout, NotGiven) else as_timeout(timeout),
            self.max_retries if isinstance(max_retries, NotGiven) else max_retries,
            self.model if isinstance(model, NotGiven) else model, dict(self.headers))
