"""The base of a group of calls (``client.indexes``, ``client.classifiers``, ...): each method builds a
:class:`~msn_serve.client.wire.Call` and hands it to its client, which sends it. The sync client returns the result,
the async one an awaitable of it, so each call is described once for both."""
from __future__ import annotations

from typing import Any, Protocol

from msn_serve.client.options import ClientOptions
from msn_serve.client.wire import Call

Rows = list[dict[str, Any]]  # (an alias: a method named ``list`` hides the builtin in its class)


def as_is(body: Any) -> Any:
    """The reply body unchanged: for calls whose answer is the server's JSON object."""
    return body


class Sender(Protocol):
    options: ClientOptions

    def _do(self, call: Call) -> Any: ...


class Resource:
    """Calls on one kind of thing the server holds; ``model`` defaults to the client's."""

    def __init__(self, client: Sender):
        self._client = client

    def _do(self, call: Call) -> Any:
        return self._client._do(call)

    def _model(self, model: str | None) -> str | None:
        return model if model is not None else self._client.options.model
