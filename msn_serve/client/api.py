"""The API's shape, shared by :class:`~msn_serve.client.Client` and :class:`~msn_serve.client.AsyncClient`: calls
grouped by what they act on, as ``openai`` groups them, and the few calls on the server itself.

    client.embeddings   create, create_v1
    client.indexes      create, list, retrieve, delete, add, search, delete_ids, select
    client.classifiers  fit, predict, list, retrieve, delete, suggest, predict_index
    client.models       list, retrieve, load, delete
    client.snapshots    publish, retrieve, reload
    client              health, ready, metrics, info, with_options

Images may be file paths, file bytes, PIL images or uint8 arrays (one, or a list); where a call takes images *or*
vectors, vectors are a float (n, dim) array. ``model`` picks one of several served models where something is
embedded or a store is made (``None``: the client's ``model``, else the server's default); a store's later calls go
to the model that made it. Every call takes ``timeout=`` (this call only).
"""
from __future__ import annotations

import copy
from typing import Any, Self

from msn_serve.client.classifiers import ClassifiersAPI
from msn_serve.client.embeddings import EmbeddingsAPI
from msn_serve.client.indexes import IndexesAPI
from msn_serve.client.models import ModelsAPI, SnapshotsAPI
from msn_serve.client.options import NOT_GIVEN, ClientOptions, NotGiven, Timeout
from msn_serve.client.results import ReadyStatus
from msn_serve.client.wire import Call, json_call


class BaseClient:
    """Options, resources and the server-level calls; subclasses send calls (:meth:`_do`) and own the pool."""

    options: ClientOptions
    embeddings: EmbeddingsAPI
    indexes: IndexesAPI
    classifiers: ClassifiersAPI
    models: ModelsAPI
    snapshots: SnapshotsAPI
    _owns_http: bool = True

    def _bind(self, options: ClientOptions) -> None:
        self.options = options
        self.embeddings, self.indexes = EmbeddingsAPI(self), IndexesAPI(self)
        self.classifiers, self.models, self.snapshots = ClassifiersAPI(self), ModelsAPI(self), SnapshotsAPI(self)

    def _do(self, call: Call) -> Any:  # pragma: no cover - implemented by Client / AsyncClient
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        return self.options.base_url

    @property
    def max_retries(self) -> int:
        return self.options.max_retries

    def with_options(self, *, timeout: Timeout | NotGiven = NOT_GIVEN, max_retries: int | NotGiven = NOT_GIVEN,
                     model: str | None | NotGiven = NOT_GIVEN) -> Self:
        """This client with other defaults, sharing its connection pool (closing it leaves the pool open):
        ``client.with_options(max_retries=0, timeout=5).indexes.search(...)``."""
        other = copy.copy(self)
        other._owns_http = False
        other._bind(self.options.replace(timeout=timeout, max_retries=max_retries, model=model))
        return other

    def _query(self, model: str | None) -> dict[str, str] | None:
        chosen = model if model is not None else self.options.model
        return None if chosen is None else {"model": chosen}

    def health(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``GET /healthz``: the process answers (a probe: never retried)."""
        return self._do(json_call("GET", "/healthz", lambda body: body, retry=False, timeout=timeout))

    def ready(self, model: str | None = None, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> ReadyStatus:
        """``GET /readyz``: warmed up and inference works, for every model or the one named; ``ready`` is false on
        the server's 503 (a probe: never retried)."""
        return self._do(json_call("GET", "/readyz", ReadyStatus.from_json, accept_status=(503,), retry=False,
                                  params=self._query(model), timeout=timeout))

    def metrics(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> str:
        """``GET /metrics``: the Prometheus text."""
        return self._do(json_call("GET", "/metrics", lambda a: a.content.decode(), raw=True, timeout=timeout))

    def info(self, model: str | None = None, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``GET /info``: model id, dim, patch grid (for masks), preprocessing, runtime (of the model named)."""
        return self._do(json_call("GET", "/info", lambda body: body, params=self._query(model), timeout=timeout))
