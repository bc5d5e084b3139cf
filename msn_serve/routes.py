"""Native JSON/multipart endpoints: ``/embed``, ``/fewshot/...`` and ``/index/...``.

A route reads the request into a :class:`~msn_serve.inputs.Payload`, calls one :class:`~msn_serve.service.Service`
method (which holds every policy: checks, conflicts, defaults, auto-created indexes) and shapes the response.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import check_name
from .inputs import Payload, read_payload
from .publish import current_version
from .service import Service

router = APIRouter()


def _svc(request: Request) -> Service:
    return request.app.state.service


async def _payload(request: Request, *, writes: bool = False) -> tuple[Service, Payload]:
    """The request's payload; a write on a read-only replica is refused before its body is read."""
    svc = _svc(request)
    if writes:
        svc.require_writer()
    s = svc.settings
    payload = await read_payload(request, max_images=s.max_images_per_request, max_body=int(s.max_body_mb * 2**20))
    svc.check_count(len(payload.images))
    return svc, payload


def _doc(fields: dict[str, tuple[dict, str]], files: bool = True) -> dict[str, Any]:
    """OpenAPI request body for endpoints that read multipart *or* JSON themselves."""
    props = {k: {**schema, "description": desc} for k, (schema, desc) in fields.items()}
    multipart = dict(props)
    json_props = dict(props)
    if files:
        multipart["images"] = {"type": "array", "items": {"type": "string", "format": "binary"},
                               "description": "image files (also accepted as a single 'image')"}
        json_props["images"] = {"type": "array", "items": {"type": "string", "format": "byte"},
                                "description": "base64-encoded image files (or one 'image')"}
    return {"requestBody": {"content": {
        "multipart/form-data": {"schema": {"type": "object", "properties": multipart}},
        "application/json": {"schema": {"type": "object", "properties": json_props}}}}}


MASK_DOC = ({"type": "object"}, ('mask: {"ratio": 0.7, "seed": 1} | {"focal": {"size": [4, 4]}} | '
                                 '{"keep_idx": [...]} | {"bitmap": [[0/1]]} (1 = kept); or one per image (list). '
                                 "Seeded ratio masks are sort(numpy.random.default_rng(seed).permutation(N)[:K])"))


def _query_into(request: Request, payload: Payload, key: str) -> None:
    """``?k=10`` works like a body field (the body wins when both are given)."""
    if key in request.query_params and key not in payload.fields:
        payload.fields[key] = request.query_params[key]


# ---- embeddings -------------------------------------------------------------------------------------------------
@router.post("/embed", tags=["embeddings"], openapi_extra=_doc({
    "mask": MASK_DOC, "normalize": ({"type": "boolean"}, "L2-normalise the embeddings (default false)")}))
async def embed(request: Request) -> JSONResponse:
    """Embed one or many images (optionally masked); returns ``embeddings`` (n, dim) and, for a masked request,
    the ``keep_idx`` each image was embedded with."""
    svc, payload = await _payload(request)
    normalize = payload.boolean("normalize", False)
    emb, keeps = await svc.embed_payload(payload, normalize=normalize)
    body: dict[str, Any] = {"model_id": svc.info.model_id, "dim": svc.info.embed_dim, "count": len(keeps),
                            "normalized": normalize, "kept_tokens": [int(k.size) for k in keeps]}
    if "mask" in payload.fields:
        body["keep_idx"] = [k.tolist() for k in keeps]
    # A JSONResponse skips FastAPI's response-model pass over thousands of floats on the hot path.
    return JSONResponse({**body, "embeddings": emb.tolist()})


# ---- few-shot classifiers ---------------------------------------------------------------------------------------
@router.post("/fewshot/fit", status_code=201, tags=["few-shot"], openapi_extra=_doc({
    "name": ({"type": "string"}, "classifier name"),
    "labels": ({"type": "array", "items": {"type": "string"}}, "one label per image/embedding"),
    "embeddings": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                   "precomputed embeddings instead of images"),
    "lambd": ({"type": "number"}, "L2 strength; cyanure lambda_1 = lambd / n (MSN protocol)"),
    "overwrite": ({"type": "boolean"}, "replace an existing classifier"), "mask": MASK_DOC}))
async def fewshot_fit(request: Request) -> JSONResponse:
    """Fit a cyanure multinomial logistic regression on row-centred, L2-normalised embeddings."""
    svc, payload = await _payload(request, writes=True)
    clf = await svc.fit_classifier(payload)
    return JSONResponse(status_code=201, content={"name": clf.name, "classes": clf.classes, **clf.info})


@router.post("/fewshot/{name}/predict", tags=["few-shot"], openapi_extra=_doc({
    "embeddings": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "instead of images"),
    "k": ({"type": "integer"}, "top-k labels (default 5)"), "mask": MASK_DOC}))
async def fewshot_predict(name: str, request: Request) -> dict[str, Any]:
    """Top-k labels with probabilities for each image/embedding."""
    svc = _svc(request)
    svc.classifiers.get(check_name(name, "classifier name"))  # 404 before reading the body
    _, payload = await _payload(request)
    _query_into(request, payload, "k")
    return {"name": name, "model_id": svc.info.model_id, "predictions": await svc.predict(name, payload)}


@router.get("/fewshot", tags=["few-shot"])
async def fewshot_list(request: Request) -> dict[str, Any]:
    return {"classifiers": _svc(request).classifiers.describe()}


@router.get("/fewshot/{name}", tags=["few-shot"])
async def fewshot_get(name: str, request: Request) -> dict[str, Any]:
    clf = _svc(request).classifiers.get(check_name(name, "classifier name"))
    return {"name": clf.name, "classes": clf.classes, **clf.info}


@router.delete("/fewshot/{name}", tags=["few-shot"])
async def fewshot_delete(name: str, request: Request) -> dict[str, Any]:
    svc = _svc(request)  # the store refuses on a read-only replica
    await svc.run_work(svc.classifiers.delete, check_name(name, "classifier name"))
    return {"deleted": name}


# ---- FAISS indexes ----------------------------------------------------------------------------------------------
@router.get("/index", tags=["index"])
async def index_list(request: Request) -> dict[str, Any]:
    return {"indexes": _svc(request).indexes.describe()}


@router.post("/index/{name}", status_code=201, tags=["index"], openapi_extra=_doc({
    "metric": ({"type": "string", "enum": ["ip", "l2"]}, "ip (cosine when normalised, default) or l2"),
    "type": ({"type": "string", "enum": ["flat", "ivf", "hnsw", "auto"]},
             "flat = exact; auto = exact, then tuned as it grows (target_recall, exact_below, retune_growth, deletes)"),
    "dim": ({"type": "integer"}, "vector size (default: the model's)"),
    "normalize": ({"type": "boolean"}, "L2-normalise added and query vectors (default true for ip)"),
    "nlist": ({"type": "integer"}, "ivf lists"), "nprobe": ({"type": "integer"}, "ivf default nprobe"),
    "m": ({"type": "integer"}, "hnsw M"), "ef_search": ({"type": "integer"}, "hnsw default efSearch")},
    files=False))
async def index_create(name: str, request: Request) -> JSONResponse:
    svc, payload = await _payload(request, writes=True)
    spec = {k: payload.raw(k) for k in payload.fields}
    idx = await svc.run_work(lambda: svc.indexes.create(check_name(name, "index name"), spec))
    return JSONResponse(status_code=201, content=idx.stats())


@router.get("/index/{name}", tags=["index"])
async def index_stats(name: str, request: Request) -> dict[str, Any]:
    return _svc(request).indexes.get(check_name(name, "index name")).stats()


@router.delete("/index/{name}", tags=["index"])
async def index_drop(name: str, request: Request) -> dict[str, Any]:
    svc = _svc(request)  # the store refuses on a read-only replica
    await svc.run_work(svc.indexes.drop, check_name(name, "index name"))
    return {"deleted": name}


@router.post("/index/{name}/add", tags=["index"], openapi_extra=_doc({
    "ids": ({"type": "array", "items": {"type": "integer"}}, "one non-negative int64 id per image/vector"),
    "vectors": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "instead of images"),
    "metadata": ({"type": "array"}, "optional JSON value per id"), "mask": MASK_DOC}))
async def index_add(name: str, request: Request) -> dict[str, Any]:
    """Add vectors (or embedded images) under external ids; creates a default flat index if needed."""
    svc, payload = await _payload(request, writes=True)
    return await svc.add_to_index(name, payload)


@router.post("/index/{name}/search", tags=["index"], openapi_extra=_doc({
    "vectors": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "query vectors"),
    "k": ({"type": "integer"}, "neighbours per query (default 10; also ?k=)"),
    "nprobe": ({"type": "integer"}, "ivf only"), "ef_search": ({"type": "integer"}, "hnsw only"),
    "mask": MASK_DOC}))
async def index_search(name: str, request: Request) -> dict[str, Any]:
    """k nearest neighbours of each query image/vector: ``results[i] = [{id, score, metadata?}, ...]``."""
    svc = _svc(request)
    svc.indexes.get(check_name(name, "index name"))  # 404 before reading the body
    _, payload = await _payload(request)
    for key in ("k", "nprobe", "ef_search"):
        _query_into(request, payload, key)
    return await svc.search_index(name, payload)


@router.post("/index/{name}/delete", tags=["index"], openapi_extra=_doc({
    "ids": ({"type": "array", "items": {"type": "integer"}}, "ids to remove")}, files=False))
async def index_delete_ids(name: str, request: Request) -> dict[str, Any]:
    svc, payload = await _payload(request, writes=True)
    return await svc.remove_from_index(name, payload)


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
