"""Native JSON/multipart endpoints: ``/embed``, ``/fewshot/...`` and ``/index/...``.

A route reads the request into its model (:mod:`msn_serve.http.schemas`; the OpenAPI request bodies are generated from
the same models), calls one :class:`~msn_serve.service.Service` method (which holds every policy: checks, conflicts,
defaults, auto-created indexes, result limits) and shapes the response.
"""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from msn_serve.http.embed_response import JSON, NPY, RAW, embeddings_response, json_response, negotiate
from msn_serve.errors import NAME_RE, check_name
from msn_serve.http.inputs import M, read_request
from msn_serve.http.jsonio import StrictJSONResponse
from msn_serve.http.label_schemas import PredictIndexRequest, SelectRequest, SuggestRequest
from msn_serve.publish import current_version
from msn_serve.http.schemas import (
    EmbedRequest,
    FitRequest,
    IndexAddRequest,
    IndexCreateRequest,
    IndexDeleteRequest,
    PredictRequest,
    SearchRequest,
)
from msn_serve.service import Service

router = APIRouter(default_response_class=StrictJSONResponse)
# Stated in the OpenAPI document (and checked again by check_name, in Python, on every use).
Name = Annotated[str, Path(pattern=f"^{NAME_RE.pattern}$", description="classifier or index name")]


BINARY_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {
    RAW: {"schema": {"type": "string", "format": "binary",
                     "description": "n x dim little-endian float32, row-major; shape in X-Embedding-Shape"}},
    NPY: {"schema": {"type": "string", "format": "binary", "description": "the (n, dim) float32 array as .npy"}},
}}}


def _svc(request: Request) -> Service:
    return request.app.state.service


async def _read(request: Request, model: type[M], *, writes: bool = False) -> tuple[Service, M]:
    """The request's validated model; a write on a read-only replica is refused before its body is read."""
    svc = _svc(request)
    if writes:
        svc.require_writer()
    return svc, await read_request(request, model, svc.settings)


def _json_bytes(body: bytes) -> Response:
    return Response(body, media_type="application/json")


# ---- embeddings -------------------------------------------------------------------------------------------------
@router.post("/embed", tags=["embeddings"], openapi_extra=EmbedRequest.openapi_body(), responses=BINARY_DOC)
async def embed(request: Request) -> Response:
    """Embed one or many images (optionally masked); returns ``embeddings`` (n, dim) and, for a masked request,
    the ``keep_idx`` each image was embedded with. ``Accept: application/octet-stream`` (raw little-endian
    float32, shape in ``X-Embedding-Shape``) or ``application/x-npy`` returns the matrix alone, without JSON."""
    media = negotiate(request.headers.get("accept"))  # a 406 before any work
    svc, req = await _read(request, EmbedRequest)
    emb, keeps = await svc.embed(req)
    kept = [int(k.size) for k in keeps]
    if media != JSON:
        return embeddings_response(media, emb, model_id=svc.info.model_id, normalized=req.normalize,
                                   kept_tokens=kept)
    head = {"model_id": svc.info.model_id, "dim": svc.info.embed_dim, "count": len(keeps),
            "normalized": req.normalize, "kept_tokens": kept}
    return json_response(head, emb, keeps if "mask" in req.model_fields_set else None)


# ---- few-shot classifiers ---------------------------------------------------------------------------------------
@router.post("/fewshot/fit", status_code=201, tags=["few-shot"], openapi_extra=FitRequest.openapi_body())
async def fewshot_fit(request: Request) -> StrictJSONResponse:
    """Fit a cyanure multinomial logistic regression on row-centred, L2-normalised embeddings (in a worker
    process, so the server keeps answering during long fits)."""
    svc, req = await _read(request, FitRequest, writes=True)
    clf = await svc.fit_classifier(req)
    return StrictJSONResponse(status_code=201, content={"name": clf.name, "classes": clf.classes, **clf.info})


@router.post("/fewshot/{name}/predict", tags=["few-shot"], openapi_extra=PredictRequest.openapi_body())
async def fewshot_predict(name: Name, request: Request) -> Response:
    """Top-k labels with probabilities for each image/embedding: ``{"predictions": [[{"label", "probability"}]]}``."""
    svc = _svc(request)
    svc.classifiers.get(check_name(name, "classifier name"))  # 404 before reading the body
    _, req = await _read(request, PredictRequest)
    return _json_bytes(await svc.predict(name, req))


@router.post("/fewshot/{name}/suggest", tags=["label loop"], openapi_extra=SuggestRequest.openapi_body())
async def fewshot_suggest(name: Name, request: Request) -> StrictJSONResponse:
    """The next ids to label for this classifier: uncertain ones, kept diverse; never the ids it was fitted on:
    ``{"ids", "uncertainty", "available", ...}``."""
    svc = _svc(request)
    svc.classifiers.get(check_name(name, "classifier name"))  # 404 before reading the body
    _, req = await _read(request, SuggestRequest)
    return StrictJSONResponse(await svc.suggest(name, req))


@router.post("/fewshot/{name}/predict_index", tags=["label loop"],
             openapi_extra=PredictIndexRequest.openapi_body())
async def fewshot_predict_index(name: Name, request: Request) -> Response:
    """One page of predictions over an index's stored items, with class counts over the whole index:
    ``{"total", "next_offset", "class_counts", "items": [{"id", "label", "probability", "margin", "top"}]}``."""
    svc = _svc(request)
    svc.classifiers.get(check_name(name, "classifier name"))  # 404 before reading the body
    _, req = await _read(request, PredictIndexRequest)
    return _json_bytes(await svc.predict_index(name, req))


@router.get("/fewshot", tags=["few-shot"])
async def fewshot_list(request: Request) -> dict[str, Any]:
    return {"classifiers": _svc(request).classifiers.describe()}


@router.get("/fewshot/{name}", tags=["few-shot"])
async def fewshot_get(name: Name, request: Request) -> dict[str, Any]:
    clf = _svc(request).classifiers.get(check_name(name, "classifier name"))
    return {"name": clf.name, "classes": clf.classes, **clf.info}


@router.delete("/fewshot/{name}", tags=["few-shot"])
async def fewshot_delete(name: Name, request: Request) -> dict[str, Any]:
    svc = _svc(request)  # the store refuses on a read-only replica
    await svc.run_work(svc.classifiers.delete, check_name(name, "classifier name"))
    return {"deleted": name}


# ---- FAISS indexes ----------------------------------------------------------------------------------------------
@router.get("/index", tags=["index"])
async def index_list(request: Request) -> dict[str, Any]:
    return {"indexes": _svc(request).indexes.describe()}


@router.post("/index/{name}", status_code=201, tags=["index"], openapi_extra=IndexCreateRequest.openapi_body())
async def index_create(name: Name, request: Request) -> StrictJSONResponse:
    """Create an index (its options are fixed from then on)."""
    svc, req = await _read(request, IndexCreateRequest, writes=True)
    idx = await svc.run_work(lambda: svc.indexes.create(check_name(name, "index name"), req.spec()))
    return StrictJSONResponse(status_code=201, content=idx.stats())


@router.get("/index/{name}", tags=["index"])
async def index_stats(name: Name, request: Request) -> dict[str, Any]:
    return _svc(request).indexes.get(check_name(name, "index name")).stats()


@router.delete("/index/{name}", tags=["index"])
async def index_drop(name: Name, request: Request) -> dict[str, Any]:
    svc = _svc(request)  # the store refuses on a read-only replica
    await svc.run_work(svc.indexes.drop, check_name(name, "index name"))
    return {"deleted": name}


@router.post("/index/{name}/add", tags=["index"], openapi_extra=IndexAddRequest.openapi_body())
async def index_add(name: Name, request: Request) -> dict[str, Any]:
    """Add vectors (or embedded images) under external ids, replacing ids already there; creates a default flat
    index if needed."""
    svc, req = await _read(request, IndexAddRequest, writes=True)
    return await svc.add_to_index(name, req)


@router.post("/index/{name}/search", tags=["index"], openapi_extra=SearchRequest.openapi_body())
async def index_search(name: Name, request: Request) -> Response:
    """k nearest neighbours of each query image/vector: ``results[i] = [{id, score, metadata?}, ...]``."""
    svc = _svc(request)
    svc.indexes.get(check_name(name, "index name"))  # 404 before reading the body
    _, req = await _read(request, SearchRequest)
    return _json_bytes(await svc.search_index(name, req))


@router.post("/index/{name}/select", tags=["label loop"], openapi_extra=SelectRequest.openapi_body())
async def index_select(name: Name, request: Request) -> StrictJSONResponse:
    """What to label first: ``n`` diverse, representative stored ids (deterministic for a seed): ``{"ids", ...}``."""
    svc = _svc(request)
    svc.indexes.get(check_name(name, "index name"))  # 404 before reading the body
    _, req = await _read(request, SelectRequest)
    return StrictJSONResponse(await svc.select(name, req))


@router.post("/index/{name}/delete", tags=["index"], openapi_extra=IndexDeleteRequest.openapi_body())
async def index_delete_ids(name: Name, request: Request) -> dict[str, Any]:
    svc, req = await _read(request, IndexDeleteRequest, writes=True)
    return await svc.remove_from_index(name, req)


# ---- replica consistency (docs/deploy.md) -----------------------------------------------------------------------
@router.post("/admin/snapshot", tags=["admin"])
async def admin_snapshot(request: Request) -> dict[str, Any]:
    """Writer: publish all indexes and classifiers as a new version under ``published/`` (readers load it)."""
    return await _svc(request).publish()


@router.post("/admin/reload", tags=["admin"])
async def admin_reload(request: Request) -> dict[str, Any]:
    """Reader: switch atomically to the newest published version (also on SIGHUP); in-flight requests finish."""
    return await _svc(request).reload()


@router.get("/admin/snapshot", tags=["admin"])
async def admin_snapshot_status(request: Request) -> dict[str, Any]:
    svc = _svc(request)
    return {"role": "reader" if svc.read_only else "writer", "serving": svc.snapshot_version,
            "current": await svc.run_work(current_version, svc.settings.data_dir)}
