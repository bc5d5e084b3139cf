"""``client.models`` (the served models: ``/v1/models`` and ``/admin/models``) and ``client.snapshots`` (publishing
a writer's stores to read-only replicas: ``/admin/snapshot``, ``/admin/reload``)."""
from __future__ import annotations

from typing import Any

from msn_serve.client.options import NOT_GIVEN, NotGiven, Timeout
from msn_serve.client.resource import Resource, as_is
from msn_serve.client.results import ModelCard
from msn_serve.client.wire import json_call, quoted

Cards = list[ModelCard]  # (an alias: a method named ``list`` hides the builtin in the class)


class ModelsAPI(Resource):
    def list(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> Cards:
        """``GET /v1/models``: the served models, the default first (``id`` is what ``model=`` takes)."""
        return self._do(json_call("GET", "/v1/models", lambda body: [ModelCard.from_json(m) for m in body["data"]],
                                  timeout=timeout))

    def retrieve(self, model: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> ModelCard:
        """``GET /v1/models/{model}``: one model's card, by served name (or by model id when one model has it)."""
        return self._do(json_call("GET", f"/v1/models/{quoted(model)}", ModelCard.from_json, timeout=timeout))

    def load(self, name: str, bundle: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``PUT /admin/models/{name}``: serve (or replace) the model ``name`` from a bundle directory on the
        server's disk; it takes traffic once loaded, gated and warmed."""
        return self._do(json_call("PUT", f"/admin/models/{quoted(name)}", as_is, {"bundle": str(bundle)},
                                  timeout=timeout))

    def delete(self, name: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``DELETE /admin/models/{name}``: stop serving the model ``name`` (requests in flight finish)."""
        return self._do(json_call("DELETE", f"/admin/models/{quoted(name)}", as_is, timeout=timeout))


class SnapshotsAPI(Resource):
    def publish(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``POST /admin/snapshot`` (writer): every index and classifier as a new version for readers. Not
        retried after a lost answer (each send publishes a version)."""
        return self._do(json_call("POST", "/admin/snapshot", as_is, idempotent=False, timeout=timeout))

    def retrieve(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``GET /admin/snapshot``: the published version this server has."""
        return self._do(json_call("GET", "/admin/snapshot", as_is, timeout=timeout))

    def reload(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``POST /admin/reload`` (reader): switch to the newest published version."""
        return self._do(json_call("POST", "/admin/reload", as_is, timeout=timeout))
