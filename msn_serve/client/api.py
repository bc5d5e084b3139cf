"""Every endpoint once, as a :class:`~msn_serve.client.wire.Call`; :class:`~msn_serve.client.Client` sends calls
and returns results, :class:`~msn_serve.client.AsyncClient` sends the same calls and returns awaitables of them.

Images may be file paths, file bytes, PIL images or uint8 arrays (one, or a list); where an endpoint takes images
*or* vectors, vectors are a float (n, dim) array. ``model`` selects one of several models served by one server
(``None``: the client's default, else the server's default model) where something is embedded or a store is made
(``embed``, ``embeddings``, ``create_index``, ``fit``); it is sent only when set. A store's later calls (add,
search, predict, the label loop) go to the model that made it.
"""
from __future__ import annotations

import base64
from typing import Any, Literal
from urllib.parse import quote

import numpy as np

from msn_serve.client.results import (
    Embeddings,
    IdList,
    IndexPage,
    OpenAIEmbeddings,
    Predictions,
    ReadyStatus,
    SearchResult,
)
from msn_serve.client.wire import (
    Answer,
    Call,
    ImageInput,
    MaskInput,
    as_image_list,
    image_call,
    image_file,
    json_call,
    mask_spec,
)

RAW_F32 = "application/octet-stream"
Images = ImageInput | list[ImageInput]


def _name(name: str) -> str:
    return quote(name, safe="")


def _json(value: Any) -> Any:
    return value


def _vectors(value: Any) -> np.ndarray | None:
    """(n, dim) float32; one 1-D vector is one row."""
    return None if value is None else np.atleast_2d(np.asarray(value, dtype=np.float32))


def _images_or_vectors(images: Images | None, vectors: Any, what: str) -> list[ImageInput]:
    if (images is None) == (vectors is None):
        raise ValueError(f"send either images or {what}")
    return [] if images is None else as_image_list(images)


def _data_url(image: ImageInput, i: int) -> str:
    if isinstance(image, str) and image.startswith(("data:", "http://", "https://")):
        return image  # already a data URL, or a URL the server fetches (when its operator enabled that)
    _, data, ctype = image_file(image, f"input[{i}]")
    return f"data:{'image/png' if ctype == 'image/png' else 'application/octet-stream'};base64," \
           + base64.b64encode(data).decode("ascii")


class Endpoints:
    """The API. Subclasses implement :meth:`_do` (send a call, parse its answer)."""

    model: str | None = None

    def _do(self, call: Call) -> Any:  # pragma: no cover - implemented by Client / AsyncClient
        raise NotImplementedError

    def _model(self, model: str | None) -> str | None:
        return model if model is not None else self.model

    def _query(self, model: str | None) -> dict[str, str] | None:
        chosen = self._model(model)
        return None if chosen is None else {"model": chosen}

    # ---- health, metrics, models ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /healthz``: the process answers."""
        return self._do(json_call("GET", "/healthz", _json, retry=False))

    def ready(self, model: str | None = None) -> ReadyStatus:
        """``GET /readyz``: warmed up and inference works (``ready`` false on the server's 503; not retried), for
        every model or the one named."""
        return self._do(json_call("GET", "/readyz", ReadyStatus.from_json, accept_status=(503,), retry=False,
                                  params=self._query(model)))

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text."""
        return self._do(json_call("GET", "/metrics", lambda a: a.content.decode(), raw=True))

    def info(self, model: str | None = None) -> dict[str, Any]:
        """``GET /info``: model id, dim, patch grid (for masks), preprocessing, runtime (of the model named)."""
        return self._do(json_call("GET", "/info", _json, params=self._query(model)))

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the served models' cards (``id`` is what ``model`` may say)."""
        return self._do(json_call("GET", "/v1/models", lambda body: body["data"]))

    # ---- embeddings -------------------------------------------------------------------------------------------
    def embed(self, images: Images, *, mask: MaskInput = None, normalize: bool = False,
              model: str | None = None) -> Embeddings:
        """``POST /embed``: one embedding per image; masked when ``mask`` is given (then ``keep_idx`` says which
        patches each image kept). Unmasked answers come as raw float32 (no JSON text to parse)."""
        spec = mask_spec(mask)
        fields = {"mask": spec, "normalize": True if normalize else None, "model": self._model(model)}
        if spec is None:
            return self._do(image_call("POST", "/embed", Embeddings.from_binary, as_image_list(images), fields,
                                       raw=True, headers={"Accept": RAW_F32}))
        return self._do(image_call("POST", "/embed", Embeddings.from_json, as_image_list(images), fields))

    def embeddings(self, images: Images, *, mask: MaskInput = None, model: str | None = None) -> OpenAIEmbeddings:
        """``POST /v1/embeddings`` (OpenAI's API): the same vectors as :meth:`embed`. A string starting with
        ``data:`` or ``http(s)://`` is sent as it is; other images are sent as base64 data URLs."""
        inputs = [_data_url(im, i) for i, im in enumerate(as_image_list(images))]
        fields = {"model": self._model(model) or "msn", "input": inputs, "encoding_format": "base64",
                  "mask": mask_spec(mask)}
        return self._do(json_call("POST", "/v1/embeddings", OpenAIEmbeddings.from_json, fields))

    # ---- FAISS indexes ----------------------------------------------------------------------------------------
    def create_index(self, name: str, *, metric: Literal["ip", "l2"] | None = None,
                     type: Literal["flat", "ivf", "hnsw", "auto"] | None = None, dim: int | None = None,
                     normalize: bool | None = None, model: str | None = None, **options: Any) -> dict[str, Any]:
        """``POST /index/{name}``: a new index (its options are fixed from then on; ``options``: ``nlist``,
        ``nprobe``, ``m``, ``ef_construction``, ``ef_search``, ``target_recall``, ... as docs/serving.md lists)."""
        fields = {"metric": metric, "type": type, "dim": dim, "normalize": normalize, "model": self._model(model),
                  **options}
        return self._do(json_call("POST", f"/index/{_name(name)}", _json, fields))

    def list_indexes(self) -> list[dict[str, Any]]:
        """``GET /index``: every index's stats (``model_id``, ``model_matches``, ``ntotal``, ...)."""
        return self._do(json_call("GET", "/index", lambda body: body["indexes"]))

    def index_stats(self, name: str) -> dict[str, Any]:
        """``GET /index/{name}``."""
        return self._do(json_call("GET", f"/index/{_name(name)}", _json))

    def delete_index(self, name: str) -> dict[str, Any]:
        """``DELETE /index/{name}``: the index and its files."""
        return self._do(json_call("DELETE", f"/index/{_name(name)}", _json))

    def add(self, name: str, ids: Any, *, images: Images | None = None, vectors: Any = None,
            metadata: list[Any] | None = None, mask: MaskInput = None) -> dict[str, Any]:
        """``POST /index/{name}/add``: images (embedded by the server) or vectors under ``ids`` (re-adding an id
        replaces it), with optional JSON ``metadata`` per id; ``{"added", "replaced", "ntotal"}``."""
        imgs = _images_or_vectors(images, vectors, "vectors")
        fields = {"ids": [int(i) for i in np.asarray(ids).reshape(-1)], "vectors": _vectors(vectors),
                  "metadata": metadata, "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/index/{_name(name)}/add", _json, imgs, fields))

    def search(self, name: str, *, images: Images | None = None, vectors: Any = None, k: int = 10,
               nprobe: int | None = None, ef_search: int | None = None, mask: MaskInput = None) -> SearchResult:
        """``POST /index/{name}/search``: the ``k`` nearest stored items of each query image or vector."""
        imgs = _images_or_vectors(images, vectors, "vectors")
        fields = {"vectors": _vectors(vectors), "k": k, "nprobe": nprobe, "ef_search": ef_search,
                  "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/index/{_name(name)}/search", SearchResult.from_json, imgs, fields))

    def delete_ids(self, name: str, ids: Any) -> dict[str, Any]:
        """``POST /index/{name}/delete``: ``{"removed", "not_found", "ntotal"}``."""
        fields = {"ids": [int(i) for i in np.asarray(ids).reshape(-1)]}
        return self._do(json_call("POST", f"/index/{_name(name)}/delete", _json, fields))

    # ---- label loop ---------------------------------------------------------------------------------------------
    def select(self, index: str, *, n: int = 20, strategy: str = "typical", seed: int = 0,
               exclude_ids: Any = None) -> IdList:
        """``POST /index/{name}/select``: what to label first (``n`` diverse, representative stored ids)."""
        fields = {"n": n, "strategy": strategy, "seed": seed, "exclude_ids": _ids_or_none(exclude_ids)}
        return self._do(json_call("POST", f"/index/{_name(index)}/select", IdList.from_json, fields))

    def suggest(self, classifier: str, index: str, *, n: int = 20, strategy: str = "margin", seed: int = 0,
                exclude_ids: Any = None) -> IdList:
        """``POST /fewshot/{name}/suggest``: what to label next (uncertain, diverse, never the fitted ids)."""
        fields = {"index": index, "n": n, "strategy": strategy, "seed": seed,
                  "exclude_ids": _ids_or_none(exclude_ids)}
        return self._do(json_call("POST", f"/fewshot/{_name(classifier)}/suggest", IdList.from_json, fields))

    def predict_index(self, classifier: str, index: str, *, offset: int = 0, limit: int | None = None, k: int = 3,
                      order: Literal["id", "uncertain"] = "id") -> IndexPage:
        """``POST /fewshot/{name}/predict_index``: one page of predictions over an index's items (ask again
        with ``offset=page.next_offset`` until it is ``None``)."""
        fields = {"index": index, "offset": offset, "limit": limit, "k": k, "order": order}
        return self._do(json_call("POST", f"/fewshot/{_name(classifier)}/predict_index", IndexPage.from_json,
                                  fields))

    # ---- few-shot classifiers -----------------------------------------------------------------------------------
    def fit(self, name: str, labels: list[Any], *, images: Images | None = None, embeddings: Any = None,
            index: str | None = None, ids: Any = None, lambd: float | None = None, overwrite: bool = False,
            mask: MaskInput = None, model: str | None = None) -> dict[str, Any]:
        """``POST /fewshot/fit``: a classifier from labelled images, embeddings, or ``index`` + ``ids`` of stored
        items (one label each); ``{"name", "classes", "n", "dim", ...}``."""
        if index is None and ids is None:
            imgs = _images_or_vectors(images, embeddings, "embeddings")
        elif images is not None or embeddings is not None:
            raise ValueError("send either index + ids or images/embeddings")
        else:
            imgs = []
        fields = {"name": name, "labels": list(labels), "embeddings": _vectors(embeddings), "index": index,
                  "ids": _ids_or_none(ids), "lambd": lambd, "overwrite": True if overwrite else None,
                  "mask": mask_spec(mask), "model": self._model(model)}
        return self._do(image_call("POST", "/fewshot/fit", _json, imgs, fields,
                                   text_fields=("name", "index", "model")))

    def predict(self, name: str, *, images: Images | None = None, embeddings: Any = None, k: int = 5,
                mask: MaskInput = None) -> Predictions:
        """``POST /fewshot/{name}/predict``: the top-``k`` labels of each image or embedding."""
        imgs = _images_or_vectors(images, embeddings, "embeddings")
        fields = {"embeddings": _vectors(embeddings), "k": k, "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/fewshot/{_name(name)}/predict", Predictions.from_json, imgs,
                                   fields))

    def list_classifiers(self) -> list[dict[str, Any]]:
        """``GET /fewshot``."""
        return self._do(json_call("GET", "/fewshot", lambda body: body["classifiers"]))

    def classifier(self, name: str) -> dict[str, Any]:
        """``GET /fewshot/{name}``: classes, sample count, lambda, model id."""
        return self._do(json_call("GET", f"/fewshot/{_name(name)}", _json))

    def delete_classifier(self, name: str) -> dict[str, Any]:
        """``DELETE /fewshot/{name}``."""
        return self._do(json_call("DELETE", f"/fewshot/{_name(name)}", _json))

    # ---- admin ----------------------------------------------------------------------------------------------------
    def publish(self) -> dict[str, Any]:
        """``POST /admin/snapshot`` (writer): publish every index and classifier as a new version for readers."""
        return self._do(json_call("POST", "/admin/snapshot", _json))

    def reload(self) -> dict[str, Any]:
        """``POST /admin/reload`` (reader): switch to the newest published version."""
        return self._do(json_call("POST", "/admin/reload", _json))

    def snapshot_status(self) -> dict[str, Any]:
        """``GET /admin/snapshot``: the published version this server has."""
        return self._do(json_call("GET", "/admin/snapshot", _json))

    def put_model(self, name: str, bundle: str) -> dict[str, Any]:
        """``PUT /admin/models/{name}``: load (or replace) the model ``name`` from a bundle directory on the
        server's disk; it takes traffic once loaded, gated and warmed."""
        return self._do(json_call("PUT", f"/admin/models/{_name(name)}", _json, {"bundle": str(bundle)}))

    def delete_model(self, name: str) -> dict[str, Any]:
        """``DELETE /admin/models/{name}``: stop serving the model ``name`` (requests in flight finish)."""
        return self._do(json_call("DELETE", f"/admin/models/{_name(name)}", _json))


def _ids_or_none(ids: Any) -> list[int] | None:
    return None if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]


__all__ = ["Answer", "Endpoints"]
