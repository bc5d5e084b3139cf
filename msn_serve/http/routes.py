"""Native JSON/multipart endpoints: ``/embed``, ``/fewshot/...``, ``/index/...`` and ``/admin/...``.

A route checks the name in its path (404 for an unknown one before the body is read: :func:`_existing`), reads the
request into its model (:mod:`msn_serve.http.schemas`; the OpenAPI request bodies are generated from the same models),
calls one service method with plain arguments, and renders what it gives back (:mod:`msn_serve.http.responses`,
:mod:`msn_serve.http.embed_response`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from msn_core.bundle import BundleInfo
from msn_serve.errors import NAME_RE, check_name, unprocessable
from msn_serve.http.embed_response import NPY, RAW, embed_response, negotiate
from msn_serve.http.embedder import Decode, Embedder, Items
from msn_serve.http.inputs import M, read_request
from msn_serve.http.label_schemas import PredictIndexRequest, SelectRequest, SuggestRequest
from msn_serve.http.responses import StrictJSONResponse, index_page_body, predictions_body, search_body
from msn_serve.http.schemas import (
    EmbedRequest,
    FitRequest,
    IndexAddRequest,
    IndexCreateRequest,
    IndexDeleteRequest,
    PredictRequest,
    SearchRequest,
)
from msn_serve.jsontext import loads

if TYPE_CHECKING:  # the HTTP worker processes import this module (embed_with): not the runtime
    from msn_serve.runtime import Runtime

router = APIRouter(default_response_class=StrictJSONResponse)
# Stated in the OpenAPI document (and checked again by check_name, in Python, on every use).
Name = Annotated[str, Path(pattern=f"^{NAME_RE.pattern}$", description="classifier or index name")]
CLASSIFIER, INDEX = "classifier name", "index name"

BINARY_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {
    RAW: {"schema": {"type": "string", "format": "binary",
                     "description": "n x dim little-endian float32, row-major; shape in X-Embedding-Shape"}},
    NPY: {"schema": {"type": "string", "format": "binary", "description": "the (n, dim) float32 array as .npy"}},
}}}


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


def _existing(lookup: Callable[[str], Any], name: str, what: str) -> Any:
    """What ``lookup`` finds under ``name``, after the name check: 422 for a malformed name, 404 for an unknown one."""
    return lookup(check_name(name, what))


async def _read(request: Request, model: type[M], *, writes: bool = False) -> M:
    """The request's validated model; a write on a read-only replica is refused before its body is read. Its mask
    is resolved later, on the patch grid of the model that embeds its images (the one it names, or its store's)."""
    rt = _rt(request)
    if writes:
        rt.require_writer()
    return await read_request(request, model, rt.settings)


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json")


# ---- embeddings -------------------------------------------------------------------------------------------------
@router.post("/embed", tags=["embeddings"], openapi_extra=EmbedRequest.openapi_body(), responses=BINARY_DOC)
async def embed(request: Request) -> Response:
    """Embed one or many images (optionally masked); returns ``embeddings`` (n, dim) and, for a masked request,
    the ``keep_idx`` each image was embedded with. ``Accept: application/octet-stream`` (raw little-endian
    float32, shape in ``X-Embedding-Shape``) or ``application/x-npy`` returns the matrix alone, without JSON."""
    return await embed_with(request, request.app.state.embedder)


async def embed_with(request: Request, embedder: Embedder) -> Response:
    """``POST /embed`` through ``embedder``: in this process, or prepared by an HTTP worker process."""
    media = negotiate(request.headers.get("accept"))  # a 406 before any work
    req = await read_request(request, EmbedRequest, embedder.settings)
    name = embedder.models.get(req.model).name

    async def prepare(info: BundleInfo, decode: Decode) -> Items:
        req.resolve_masks(info.grid)
        if not req.images:
            raise unprocessable("no image: send files as 'image'/'images' (multipart) or base64 in JSON")
        pixels = await decode(req.images)
        return list(zip(pixels, req.keep_idx, strict=True))

    done = await embedder.embed(name, prepare, status=422)
    emb = done.embeddings
    if req.normalize:
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    return embed_response(media, emb, req, done)


# ---- few-shot classifiers ---------------------------------------------------------------------------------------
@router.post("/fewshot/fit", status_code=201, tags=["few-shot"], openapi_extra=FitRequest.openapi_body())
async def fewshot_fit(request: Request) -> StrictJSONResponse:
    """Fit a cyanure multinomial logistic regression on row-centred, L2-normalised embeddings (in a worker
    process, so the server keeps answering during long fits)."""
    req = await _read(request, FitRequest, writes=True)
    clf = await _rt(request).classifiers.fit(req.name, req.labels, req.inputs(), lambd=req.lambd,
                                             overwrite=req.overwrite, index=req.index, ids=req.ids, model=req.model)
    return StrictJSONResponse(status_code=201, content={"name": clf.name, "classes": clf.classes, **clf.info})


@router.post("/fewshot/{name}/predict", tags=["few-shot"], openapi_extra=PredictRequest.openapi_body())
async def fewshot_predict(name: Name, request: Request) -> Response:
    """Top-k labels with probabilities for each image/embedding: ``{"predictions": [[{"label", "probability"}]]}``."""
    rt = _rt(request)
    clf = _existing(rt.classifiers.get, name, CLASSIFIER)
    req = await _read(request, PredictRequest)
    p = await rt.classifiers.predict(name, req.inputs(), req.k)
    head = {"name": name, "model_id": clf.info.get("model_id") or rt.info.model_id}
    return _json_bytes(await rt.work.run(predictions_body, head, p.classes, p.top, p.probability,
                                         rt.settings.max_response_bytes))


@router.post("/fewshot/{name}/suggest", tags=["label loop"], openapi_extra=SuggestRequest.openapi_body())
async def fewshot_suggest(name: Name, request: Request) -> StrictJSONResponse:
    """The next ids to label for this classifier: uncertain ones, kept diverse; never the ids it was fitted on:
    ``{"ids", "uncertainty", "available", ...}``."""
    rt = _rt(request)
    _existing(rt.classifiers.get, name, CLASSIFIER)
    req = await _read(request, SuggestRequest)
    return StrictJSONResponse(await rt.classifiers.suggest(name, index=req.index, n=req.n, strategy=req.strategy,
                                                           seed=req.seed, exclude_ids=req.exclude_ids))


@router.post("/fewshot/{name}/predict_index", tags=["label loop"],
             openapi_extra=PredictIndexRequest.openapi_body())
async def fewshot_predict_index(name: Name, request: Request) -> Response:
    """One page of predictions over an index's stored items, with class counts over the whole index:
    ``{"total", "next_offset", "class_counts", "items": [{"id", "label", "probability", "margin", "top"}]}``."""
    rt = _rt(request)
    _existing(rt.classifiers.get, name, CLASSIFIER)
    req = await _read(request, PredictIndexRequest)
    page = await rt.classifiers.predict_index(name, index=req.index, offset=req.offset, limit=req.limit, k=req.k,
                                              order=req.order)
    return _json_bytes(await rt.work.run(index_page_body, page, rt.settings.max_response_bytes))


@router.get("/fewshot", tags=["few-shot"])
async def fewshot_list(request: Request) -> dict[str, Any]:
    return {"classifiers": _rt(request).classifiers.describe()}


@router.get("/fewshot/{name}", tags=["few-shot"])
async def fewshot_get(name: Name, request: Request) -> dict[str, Any]:
    clf = _existing(_rt(request).classifiers.get, name, CLASSIFIER)
    return {"name": clf.name, "classes": clf.classes, **clf.info}


@router.delete("/fewshot/{name}", tags=["few-shot"])
async def fewshot_delete(name: Name, request: Request) -> dict[str, Any]:
    await _rt(request).classifiers.delete(check_name(name, CLASSIFIER))  # the store refuses on a reader
    return {"deleted": name}


# ---- FAISS indexes ----------------------------------------------------------------------------------------------
@router.get("/index", tags=["index"])
async def index_list(request: Request) -> dict[str, Any]:
    return {"indexes": _rt(request).indexes.describe()}


@router.post("/index/{name}", status_code=201, tags=["index"], openapi_extra=IndexCreateRequest.openapi_body())
async def index_create(name: Name, request: Request) -> StrictJSONResponse:
    """Create an index (its options are fixed from then on)."""
    req = await _read(request, IndexCreateRequest, writes=True)
    stats = await _rt(request).indexes.create(check_name(name, INDEX), req.spec(), req.model)
    return StrictJSONResponse(status_code=201, content=stats)


@router.get("/index/{name}", tags=["index"])
async def index_stats(name: Name, request: Request) -> dict[str, Any]:
    return _existing(_rt(request).indexes.get, name, INDEX).stats()


@router.delete("/index/{name}", tags=["index"])
async def index_drop(name: Name, request: Request) -> dict[str, Any]:
    await _rt(request).indexes.drop(check_name(name, INDEX))  # the store refuses on a reader
    return {"deleted": name}


@router.post("/index/{name}/add", tags=["index"], openapi_extra=IndexAddRequest.openapi_body())
async def index_add(name: Name, request: Request) -> dict[str, Any]:
    """Add vectors (or embedded images) under external ids, replacing ids already there; creates a default flat
    index if needed."""
    req = await _read(request, IndexAddRequest, writes=True)
    return await _rt(request).indexes.add(check_name(name, INDEX), req.ids, req.inputs(), req.metadata)


@router.post("/index/{name}/search", tags=["index"], openapi_extra=SearchRequest.openapi_body())
async def index_search(name: Name, request: Request) -> Response:
    """k nearest neighbours of each query image/vector: ``results[i] = [{id, score, metadata?}, ...]``."""
    rt = _rt(request)
    _existing(rt.indexes.get, name, INDEX)
    req = await _read(request, SearchRequest)
    hits = await rt.indexes.search(name, req.inputs(), k=req.k, nprobe=req.nprobe, ef_search=req.ef_search)
    head = {"name": name, "metric": hits.metric, "k": req.k}
    return _json_bytes(await rt.work.run(search_body, head, hits.scores, hits.ids, hits.metadata,
                                         rt.settings.max_response_bytes))


@router.post("/index/{name}/select", tags=["label loop"], openapi_extra=SelectRequest.openapi_body())
async def index_select(name: Name, request: Request) -> StrictJSONResponse:
    """What to label first: ``n`` diverse, representative stored ids (deterministic for a seed): ``{"ids", ...}``."""
    rt = _rt(request)
    _existing(rt.indexes.get, name, INDEX)
    req = await _read(request, SelectRequest)
    return StrictJSONResponse(await rt.classifiers.select(name, n=req.n, strategy=req.strategy, seed=req.seed,
                                                          exclude_ids=req.exclude_ids))


@router.post("/index/{name}/delete", tags=["index"], openapi_extra=IndexDeleteRequest.openapi_body())
async def index_delete_ids(name: Name, request: Request) -> dict[str, Any]:
    req = await _read(request, IndexDeleteRequest, writes=True)
    return await _rt(request).indexes.remove(check_name(name, INDEX), req.ids)


# ---- replica consistency (docs/deploy.md) -----------------------------------------------------------------------
@router.post("/admin/snapshot", tags=["admin"])
async def admin_snapshot(request: Request) -> dict[str, Any]:
    """Writer: publish all indexes and classifiers as a new version under ``published/`` (readers load it)."""
    return await _rt(request).snapshots.publish()


@router.post("/admin/reload", tags=["admin"])
async def admin_reload(request: Request) -> dict[str, Any]:
    """Reader: switch atomically to the newest published version (also on SIGHUP); in-flight requests finish."""
    return await _rt(request).snapshots.reload()


@router.get("/admin/snapshot", tags=["admin"])
async def admin_snapshot_status(request: Request) -> dict[str, Any]:
    return await _rt(request).snapshots.status()


# ---- several models (docs/serving.md, "Several models") ---------------------------------------------------------
@router.put("/admin/models/{name}", tags=["admin"], openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "required": ["bundle"], "additionalProperties": False,
                                    "properties": {"bundle": {"type": "string",
                                                              "description": "bundle directory on the server"}}}}}}})
async def admin_put_model(name: str, request: Request) -> dict[str, Any]:
    """Add or replace model ``name`` with the bundle at ``bundle``: it is loaded, gated and warmed up before it takes
    traffic; requests already holding the old one finish on it, then it stops. A bundle that cannot be served is
    a 4xx and the old model keeps serving."""
    rt = _rt(request)
    rt.require_writer()
    body = loads(await request.body() or b"{}", "request body")
    if not isinstance(body, dict) or set(body) - {"bundle"}:
        raise unprocessable('send {"bundle": "/path/to/bundle"}: the bundle directory on the server')
    return await rt.put_model(name, body.get("bundle"))


@router.delete("/admin/models/{name}", tags=["admin"])
async def admin_delete_model(name: str, request: Request) -> dict[str, Any]:
    """Stop serving model ``name`` once its requests are done (not the last model; the first remaining model
    becomes the default when it was the default)."""
    return await _rt(request).remove_model(name)
