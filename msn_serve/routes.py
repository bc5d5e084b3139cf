"""Native JSON/multipart endpoints: ``/embed``, ``/fewshot/...`` and ``/index/...``."""
from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import ApiError, check_name, unprocessable
from .fewshot import fit as fit_classifier
from .inputs import Payload, read_payload
from .publish import current_version
from .service import Service

router = APIRouter()


def _svc(request: Request) -> Service:
    return request.app.state.service


async def _payload(request: Request) -> tuple[Service, Payload]:
    svc = _svc(request)
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
                                 '{"keep_idx": [...]} | {"bitmap": [[0/1]]} (1 = kept); or one per image (list)'))


def _query_into(request: Request, payload: Payload, key: str) -> None:
    """``?k=10`` works like a body field (the body wins when both are given)."""
    if key in request.query_params and key not in payload.fields:
        payload.fields[key] = request.query_params[key]


# ---- embeddings -------------------------------------------------------------------------------------------------
@router.post("/embed", tags=["embeddings"], openapi_extra=_doc({
    "mask": MASK_DOC, "normalize": ({"type": "boolean"}, "L2-normalise the embeddings (default false)")}))
async def embed(request: Request) -> JSONResponse:
    """Embed one or many images (optionally masked); returns ``embeddings`` (n, dim)."""
    svc, payload = await _payload(request)
    normalize = payload.boolean("normalize", False)
    emb, kept = await svc.embed_payload(payload, normalize=normalize)
    # A JSONResponse skips FastAPI's response-model pass over thousands of floats on the hot path.
    return JSONResponse({"model_id": svc.info.model_id, "dim": svc.info.embed_dim, "count": len(kept),
                         "normalized": normalize, "kept_tokens": kept, "embeddings": emb.tolist()})


# ---- few-shot classifiers ---------------------------------------------------------------------------------------
async def _features(svc: Service, payload: Payload, field: str) -> np.ndarray:
    vecs = payload.matrix(field, svc.info.embed_dim)
    if vecs is not None and payload.images:
        raise unprocessable(f"send either images or {field}, not both")
    if vecs is not None:
        return vecs
    emb, _ = await svc.embed_payload(payload)
    return emb


@router.post("/fewshot/fit", status_code=201, tags=["few-shot"], openapi_extra=_doc({
    "name": ({"type": "string"}, "classifier name"),
    "labels": ({"type": "array", "items": {"type": "string"}}, "one label per image/embedding"),
    "embeddings": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                   "precomputed embeddings instead of images"),
    "lambd": ({"type": "number"}, "L2 strength; cyanure lambda_1 = lambd / n (MSN protocol)"),
    "overwrite": ({"type": "boolean"}, "replace an existing classifier"), "mask": MASK_DOC}))
async def fewshot_fit(request: Request) -> JSONResponse:
    """Fit a cyanure multinomial logistic regression on row-centred, L2-normalised embeddings."""
    _svc(request).require_writer()
    svc, payload = await _payload(request)
    name = check_name(payload.string("name") or "", "classifier name")
    labels = payload.json_field("labels")
    if not isinstance(labels, list) or not labels or not all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                            for v in labels):
        raise unprocessable("labels: expected a non-empty JSON list of strings (one per image/embedding)")
    labels = [str(v) for v in labels]
    lambd = payload.number("lambd", svc.settings.default_lambd)
    overwrite = payload.boolean("overwrite", False)
    if name in svc.classifiers.items and not overwrite:
        raise ApiError(409, f"classifier {name!r} exists; pass overwrite=true to replace it")
    x = await _features(svc, payload, "embeddings")
    if len(labels) != len(x):
        raise unprocessable(f"{len(labels)} labels for {len(x)} images/embeddings")
    clf = await svc.run_work(lambda: fit_classifier(name, x, labels, lambd=lambd, threads=svc.settings.fit_threads))
    await svc.run_work(lambda: svc.classifiers.put(clf, overwrite=overwrite))
    return JSONResponse(status_code=201, content={"name": name, "classes": clf.classes, **clf.info})


@router.post("/fewshot/{name}/predict", tags=["few-shot"], openapi_extra=_doc({
    "embeddings": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "instead of images"),
    "k": ({"type": "integer"}, "top-k labels (default 5)"), "mask": MASK_DOC}))
async def fewshot_predict(name: str, request: Request) -> dict[str, Any]:
    """Top-k labels with probabilities for each image/embedding."""
    svc = _svc(request)
    clf = svc.classifiers.get(check_name(name, "classifier name"))
    _, payload = await _payload(request)
    _query_into(request, payload, "k")
    k = payload.integer("k", 5, 1, 10_000)
    x = await _features(svc, payload, "embeddings")
    return {"name": name, "model_id": svc.info.model_id, "predictions": clf.predict(x, k)}


@router.get("/fewshot", tags=["few-shot"])
async def fewshot_list(request: Request) -> dict[str, Any]:
    return {"classifiers": _svc(request).classifiers.describe()}


@router.get("/fewshot/{name}", tags=["few-shot"])
async def fewshot_get(name: str, request: Request) -> dict[str, Any]:
    clf = _svc(request).classifiers.get(check_name(name, "classifier name"))
    return {"name": clf.name, "classes": clf.classes, **clf.info}


@router.delete("/fewshot/{name}", tags=["few-shot"])
async def fewshot_delete(name: str, request: Request) -> dict[str, Any]:
    svc = _svc(request)
    svc.require_writer()
    await svc.run_work(svc.classifiers.delete, check_name(name, "classifier name"))
    return {"deleted": name}


# ---- FAISS indexes ----------------------------------------------------------------------------------------------
@router.get("/index", tags=["index"])
async def index_list(request: Request) -> dict[str, Any]:
    return {"indexes": [i.stats() for i in _svc(request).indexes.indexes.values()]}


@router.post("/index/{name}", status_code=201, tags=["index"], openapi_extra=_doc({
    "metric": ({"type": "string", "enum": ["ip", "l2"]}, "ip (cosine when normalised, default) or l2"),
    "type": ({"type": "string", "enum": ["flat", "ivf", "hnsw"]}, "flat = exact IndexIDMap2(IndexFlat*)"),
    "dim": ({"type": "integer"}, "vector size (default: the model's)"),
    "normalize": ({"type": "boolean"}, "L2-normalise added and query vectors (default true for ip)"),
    "nlist": ({"type": "integer"}, "ivf lists"), "nprobe": ({"type": "integer"}, "ivf default nprobe"),
    "m": ({"type": "integer"}, "hnsw M"), "ef_search": ({"type": "integer"}, "hnsw default efSearch")},
    files=False))
async def index_create(name: str, request: Request) -> JSONResponse:
    _svc(request).require_writer()
    svc, payload = await _payload(request)
    spec = {k: payload.raw(k) for k in payload.fields}
    idx = await svc.run_work(lambda: svc.indexes.create(check_name(name, "index name"), spec))
    return JSONResponse(status_code=201, content=idx.stats())


@router.get("/index/{name}", tags=["index"])
async def index_stats(name: str, request: Request) -> dict[str, Any]:
    return _svc(request).indexes.get(check_name(name, "index name")).stats()


@router.delete("/index/{name}", tags=["index"])
async def index_drop(name: str, request: Request) -> dict[str, Any]:
    svc = _svc(request)
    svc.require_writer()
    await svc.run_work(svc.indexes.drop, check_name(name, "index name"))
    return {"deleted": name}


async def _vectors(svc: Service, payload: Payload, dim: int) -> np.ndarray:
    vecs = payload.matrix("vectors", dim)
    if vecs is not None and payload.images:
        raise unprocessable("send either images or vectors, not both")
    if vecs is not None:
        return vecs
    if dim != svc.info.embed_dim:
        raise unprocessable(f"index dimension {dim} differs from the model's {svc.info.embed_dim}: send vectors")
    emb, _ = await svc.embed_payload(payload)
    return emb


@router.post("/index/{name}/add", tags=["index"], openapi_extra=_doc({
    "ids": ({"type": "array", "items": {"type": "integer"}}, "one non-negative int64 id per image/vector"),
    "vectors": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "instead of images"),
    "metadata": ({"type": "array"}, "optional JSON value per id"), "mask": MASK_DOC}))
async def index_add(name: str, request: Request) -> dict[str, Any]:
    """Add vectors (or embedded images) under external ids; creates a default flat index if needed."""
    _svc(request).require_writer()
    svc, payload = await _payload(request)
    check_name(name, "index name")
    ids = payload.json_field("ids")
    metadata = payload.json_field("metadata")
    idx = svc.indexes.indexes.get(name)
    dim = idx.cfg.dim if idx is not None else svc.info.embed_dim
    vecs = await _vectors(svc, payload, dim)
    if idx is None:
        idx = await svc.run_work(lambda: svc.indexes.create(name, {"dim": vecs.shape[1]}, exist_ok=True))
    added = await svc.run_work(idx.add, ids, vecs, metadata)
    return {"name": name, "added": added, "ntotal": int(idx.index.ntotal)}


@router.post("/index/{name}/search", tags=["index"], openapi_extra=_doc({
    "vectors": ({"type": "array", "items": {"type": "array", "items": {"type": "number"}}}, "query vectors"),
    "k": ({"type": "integer"}, "neighbours per query (default 10; also ?k=)"),
    "nprobe": ({"type": "integer"}, "ivf only"), "ef_search": ({"type": "integer"}, "hnsw only"),
    "mask": MASK_DOC}))
async def index_search(name: str, request: Request) -> dict[str, Any]:
    """k nearest neighbours of each query image/vector: ``results[i] = [{id, score, metadata?}, ...]``."""
    svc = _svc(request)
    idx = svc.indexes.get(check_name(name, "index name"))
    _, payload = await _payload(request)
    for key in ("k", "nprobe", "ef_search"):
        _query_into(request, payload, key)
    k = payload.integer("k", 10, 1, 10_000)
    nprobe = payload.integer("nprobe", idx.cfg.nprobe, 1, 1 << 20)
    ef = payload.integer("ef_search", idx.cfg.ef_search, 1, 1 << 16)
    vecs = await _vectors(svc, payload, idx.cfg.dim)
    results = await svc.run_work(lambda: idx.search(vecs, k, nprobe, ef))
    return {"name": name, "metric": idx.cfg.metric, "k": k, "results": results}


@router.post("/index/{name}/delete", tags=["index"], openapi_extra=_doc({
    "ids": ({"type": "array", "items": {"type": "integer"}}, "ids to remove")}, files=False))
async def index_delete_ids(name: str, request: Request) -> dict[str, Any]:
    svc = _svc(request)
    svc.require_writer()
    idx = svc.indexes.get(check_name(name, "index name"))
    _, payload = await _payload(request)
    out = await svc.run_work(idx.remove, payload.json_field("ids"))
    return {"name": name, **out, "ntotal": int(idx.index.ntotal)}


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
