"""``client.indexes``: FAISS indexes of embeddings (``/index/...``) and the label loop's first pick (``select``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from msn_serve.client.options import NOT_GIVEN, NotGiven, Timeout
from msn_serve.client.resource import Resource, Rows, as_is
from msn_serve.client.results import IdList, SearchResult
from msn_serve.client.wire import (
    Images,
    MaskInput,
    id_list,
    image_call,
    images_or_vectors,
    json_call,
    mask_spec,
    matrix,
    quoted,
)


class IndexesAPI(Resource):
    def create(self, name: str, *, metric: Literal["ip", "l2"] | None = None,
               type: Literal["flat", "ivf", "hnsw", "auto"] | None = None, dim: int | None = None,
               normalize: bool | None = None, model: str | None = None, timeout: Timeout | NotGiven = NOT_GIVEN,
               **options: Any) -> dict[str, Any]:
        """``POST /index/{name}``: a new index, its options fixed from then on (``options``: ``nlist``,
        ``nprobe``, ``m``, ``ef_construction``, ``ef_search``, ``target_recall``, ... as docs/serving.md lists).
        Not retried after a lost answer: a second send would be a 409 for an index the first one made."""
        fields = {"metric": metric, "type": type, "dim": dim, "normalize": normalize, "model": self._model(model),
                  **options}
        return self._do(json_call("POST", f"/index/{quoted(name)}", as_is, fields, idempotent=False,
                                  timeout=timeout))

    def list(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> Rows:
        """``GET /index``: every index's stats (``model_id``, ``model_matches``, ``ntotal``, ...)."""
        return self._do(json_call("GET", "/index", lambda body: body["indexes"], timeout=timeout))

    def retrieve(self, name: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``GET /index/{name}``: its stats."""
        return self._do(json_call("GET", f"/index/{quoted(name)}", as_is, timeout=timeout))

    def delete(self, name: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``DELETE /index/{name}``: the index and its files."""
        return self._do(json_call("DELETE", f"/index/{quoted(name)}", as_is, timeout=timeout))

    def add(self, name: str, ids: Any, *, images: Images | None = None, vectors: Any = None,
            metadata: Sequence[Any] | None = None, mask: MaskInput = None,
            timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``POST /index/{name}/add``: images (embedded by the server) or vectors under ``ids``, with optional JSON
        ``metadata`` per id; ``{"added", "replaced", "ntotal"}``. Re-adding an id replaces it, so a retried add
        leaves the index as one add would (its counts then say ``replaced``)."""
        imgs = images_or_vectors(images, vectors, "vectors")
        fields = {"ids": id_list(ids), "vectors": matrix(vectors), "metadata": metadata, "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/index/{quoted(name)}/add", as_is, imgs, fields, timeout=timeout))

    def search(self, name: str, *, images: Images | None = None, vectors: Any = None, k: int = 10,
               nprobe: int | None = None, ef_search: int | None = None, mask: MaskInput = None,
               timeout: Timeout | NotGiven = NOT_GIVEN) -> SearchResult:
        """``POST /index/{name}/search``: the ``k`` nearest stored items of each query image or vector."""
        imgs = images_or_vectors(images, vectors, "vectors")
        fields = {"vectors": matrix(vectors), "k": k, "nprobe": nprobe, "ef_search": ef_search,
                  "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/index/{quoted(name)}/search", SearchResult.from_json, imgs, fields,
                                   timeout=timeout))

    def delete_ids(self, name: str, ids: Any, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``POST /index/{name}/delete``: ``{"removed", "not_found", "ntotal"}``."""
        return self._do(json_call("POST", f"/index/{quoted(name)}/delete", as_is, {"ids": id_list(ids)},
                                  timeout=timeout))

    def select(self, name: str, *, n: int = 20, strategy: str = "typical", seed: int = 0, exclude_ids: Any = None,
               timeout: Timeout | NotGiven = NOT_GIVEN) -> IdList:
        """``POST /index/{name}/select``: what to label first (``n`` diverse, representative stored ids)."""
        fields = {"n": n, "strategy": strategy, "seed": seed, "exclude_ids": id_list(exclude_ids)}
        return self._do(json_call("POST", f"/index/{quoted(name)}/select", IdList.from_json, fields,
                                  timeout=timeout))
