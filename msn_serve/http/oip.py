"""Open Inference Protocol (KServe v2 REST) with Triton's binary tensor extension, under ``/v2``.

``tritonclient.http`` sends tensors as raw bytes after a JSON header by default (``Inference-Header-Content-Length``
gives the JSON length; each binary input carries ``parameters.binary_data_size``), so the extension is not
optional in practice. Inference goes through the same batcher as ``/embed``: every row of an OIP batch is an item,
so OIP and native clients share batches. Inputs: ``pixel_values`` FP32 [B,C,H,W] (already normalised), optional
``keep_idx`` INT64 [B,K] (``-1`` = padding, as in the bundle graph; a ``keep_mask`` BOOL [B,K] input is accepted
too); or, instead of ``keep_idx``, a request parameter ``mask`` holding the same mask specification ``/embed``
takes (:mod:`msn_core.masks`). Output ``embedding`` FP32 [B,D]. Errors: ``{"error": ...}``.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request, Response

from msn_core.bundle import BundleInfo
from msn_core.masks import PAD, check_keep
from msn_serve.embedding.models import ModelLookups, ServedModel
from msn_serve.errors import ApiError, bad_request, not_found
from msn_serve.http.embedder import Decode, Embedder, Items
from msn_serve.http.inputs import off_loop
from msn_serve.http.oip_tensors import HEADER, InferRequest, decompress, parse_request, split_body, tensors
from msn_serve.http.schemas import inline_schema
from msn_serve.jsontext import dumps, loads
from msn_serve.masks import rejecting_masks, request_keep_idx

if TYPE_CHECKING:  # the HTTP worker processes import this module (infer_with): not the runtime
    from msn_serve.runtime import Runtime

router = APIRouter(prefix="/v2", tags=["open inference protocol"])


def package_version() -> str:
    """The installed ``msn`` distribution's version (the server's and the OpenAPI document's)."""
    try:
        return version("msn")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


def _model(request: Request, model: str) -> ServedModel:
    """The model ``model`` names: a model's name, ``msn`` (the default model) or a model id (404 otherwise)."""
    return _named(_rt(request).models, model)


def _named(models: ModelLookups, model: str) -> Any:
    """:func:`_model` in ``models`` (the registry, or an HTTP worker process's catalog of it)."""
    served = models.resolve(model)
    if served is None:
        names = ", ".join(repr(n) for n in models.names())
        more = f" and the models {names}" if len(models.models) > 1 else f", named {names}"
        raise not_found(f"unknown model {model[:80]!r}; this server serves {models.default.info.model_id!r} "
                        f"(alias 'msn'){more}")
    return served


@router.get("")
async def server_metadata() -> dict[str, Any]:
    return {"name": "msn-serve", "version": package_version(), "extensions": ["binary_tensor_data"]}


@router.get("/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    ok, detail = await _rt(request).readiness()
    if not ok:
        raise ApiError(503, detail.get("error", "not ready: warming up"))
    return Response(status_code=200)


@router.get("/models/{model}/ready")
@router.get("/models/{model}/versions/{ver}/ready")
async def model_ready(model: str, request: Request, ver: str | None = None) -> Response:
    ok, detail = await _model(request, model).readiness()
    if not ok:
        raise ApiError(503, detail.get("error", "model not ready: warming up"))
    return Response(status_code=200)


@router.get("/models/{model}")
@router.get("/models/{model}/versions/{ver}")
async def model_metadata(model: str, request: Request, ver: str | None = None) -> dict[str, Any]:
    served = _model(request, model)
    i = served.info
    inputs = [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, i.in_chans, i.image_size, i.image_size]},
              {"name": "keep_idx", "datatype": "INT64", "shape": [-1, -1], "optional": True},  # -1 = padding
              {"name": "keep_mask", "datatype": "BOOL", "shape": [-1, -1], "optional": True}]
    return {"name": i.model_id, "versions": ["1"], "platform": "onnxruntime_onnx", "inputs": inputs,
            "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, i.embed_dim]}],
            "parameters": {"patch_grid": i.grid, "num_patches": i.num_patches, "feature": i.feature,
                           "preprocessing": i.preprocessing.to_dict(),
                           "mask": "request parameter: a mask specification as /embed takes, instead of keep_idx",
                           "model": served.name}}


@router.get("/models/{model}/config")
@router.get("/models/{model}/versions/{ver}/config")
async def model_config(model: str, request: Request, ver: str | None = None) -> dict[str, Any]:
    """Triton's model-configuration extension (read by perf_analyzer): dims exclude the batch dimension."""
    served = _model(request, model)
    i, s = served.info, _rt(request).settings
    return {"name": i.model_id, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
            "max_batch_size": s.max_images_per_request,
            "input": [{"name": "pixel_values", "data_type": "TYPE_FP32", "dims": [i.in_chans, i.image_size,
                                                                                 i.image_size]},
                      {"name": "keep_idx", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
                      {"name": "keep_mask", "data_type": "TYPE_BOOL", "dims": [-1], "optional": True}],
            "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [i.embed_dim]}],
            "dynamic_batching": {"max_queue_delay_microseconds": int(s.max_wait_ms * 1000),
                                 "preferred_batch_size": [s.max_batch_size]},
            "instance_group": [{"count": 1, "kind": "KIND_GPU" if served.embedding.engine.device == "cuda"
                                else "KIND_CPU"}]}


def _keep_rows(t: dict[str, np.ndarray], batch: int) -> list[np.ndarray]:
    """``keep_idx`` rows without their padding (``-1`` entries, or ``keep_mask`` False)."""
    ki, km = t["keep_idx"], t.get("keep_mask")
    if ki.dtype.kind not in "iu" or ki.ndim != 2 or ki.shape[0] != batch or ki.shape[1] < 1:
        raise bad_request(f"keep_idx must be an integer tensor [B={batch}, K>=1], got {ki.dtype} {list(ki.shape)}")
    if km is not None and (km.dtype != np.bool_ or km.shape != ki.shape):
        raise bad_request(f"keep_mask must be BOOL with the shape of keep_idx {list(ki.shape)}")
    kept = ki != PAD if km is None else km & (ki != PAD)
    return [ki[r][kept[r]] for r in range(batch)]


def oip_items(info: BundleInfo, t: dict[str, np.ndarray], mask: Any = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Input tensors, and the request's ``mask`` parameter, -> ``(pixels (C,H,W), keep_idx (K,))`` per row."""
    unknown = sorted(set(t) - {"pixel_values", "keep_idx", "keep_mask"})
    if unknown:
        raise bad_request(f"unknown input(s) {unknown}; expected pixel_values [, keep_idx, keep_mask]")
    if "pixel_values" not in t:
        raise bad_request("missing input 'pixel_values'")
    px = t["pixel_values"]
    want = (info.in_chans, info.image_size, info.image_size)
    if px.ndim != 4 or px.shape[1:] != want:
        raise bad_request(f"pixel_values must have shape [B, {want[0]}, {want[1]}, {want[2]}], got {list(px.shape)}")
    px = px.astype(np.float32)
    if not np.isfinite(px).all():
        raise bad_request("pixel_values contain NaN or infinity")
    if "keep_mask" in t and "keep_idx" not in t:
        raise bad_request("keep_mask needs keep_idx")
    if mask is not None and "keep_idx" in t:
        raise bad_request("give either the keep_idx input or the mask parameter, not both")
    if "keep_idx" in t:
        rows = _keep_rows(t, px.shape[0])
        with rejecting_masks(status=400):
            keeps = [check_keep(row, info.num_patches, f"keep_idx row {r}") for r, row in enumerate(rows)]
    else:
        spec = loads(mask, "parameters.mask", status=400) if isinstance(mask, str) else mask
        keeps = request_keep_idx(spec, px.shape[0], info.grid, status=400)
    return list(zip(px, keeps, strict=True))


def _parse_infer(body: bytes, encoding: str, header_length: str | None,
                 limit: int) -> tuple[InferRequest, dict[str, np.ndarray]]:
    """The request and its tensors from the raw body: decompression, the JSON header, tensors (JSON ``data`` lists
    included). Blocking; a large body runs it in a parser thread."""
    body = decompress(body, encoding, limit)
    head, binary = split_body(body, header_length)
    req = parse_request(head)
    return req, tensors(req, binary, limit)


def _infer_items(info: BundleInfo, req: InferRequest, t: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``(pixels, keep_idx)`` rows of a parsed request for the model of ``info``, and the output's check."""
    items = oip_items(info, t, req.parameters.mask)
    if any(o.name != "embedding" for o in req.outputs or []):
        raise bad_request("the only output is 'embedding'")
    return items


@router.post("/models/{model}/infer", openapi_extra={"requestBody": {"content": {"application/json": {
    "schema": inline_schema(InferRequest)}}}})
@router.post("/models/{model}/versions/{ver}/infer")
async def infer(model: str, request: Request, ver: str | None = None) -> Response:
    """Where the work runs: the body is received on the event loop; a body over
    :data:`~msn_serve.http.inputs.OFF_LOOP_ABOVE` bytes is parsed, converted to tensors and checked in the parser
    threads (as the native routes' bodies are), and a large JSON response is written there too."""
    return await infer_with(request, request.app.state.embedder, model)


async def infer_with(request: Request, embedder: Embedder, model: str) -> Response:
    """OIP infer through ``embedder``: in this process, or prepared by an HTTP worker process. ``pixel_values`` are
    the graph's input already: preparing them is checking them (and the mask) for the model that embeds."""
    limit = embedder.settings.max_body_bytes
    name = _named(embedder.models, model).name
    raw = await request.body()
    req, t = await off_loop(len(raw), _parse_infer, raw, request.headers.get("content-encoding", "").lower(),
                            request.headers.get(HEADER), limit)

    async def prepare(info: BundleInfo, _: Decode) -> Items:
        return await off_loop(len(raw), _infer_items, info, req, t)

    done = await embedder.embed(name, prepare, status=400)
    emb = done.embeddings
    out: dict[str, Any] = {"name": "embedding", "datatype": "FP32", "shape": list(emb.shape)}
    resp: dict[str, Any] = {"model_name": done.model_id, "model_version": "1", "outputs": [out]}
    if req.id is not None:
        resp["id"] = req.id
    if not req.binary_output:
        out["data"] = emb.reshape(-1).tolist()
        text = await off_loop(emb.size * 12, dumps, resp)  # about 12 bytes of JSON per float
        return Response(text, media_type="application/json")
    raw_out = emb.astype("<f4").tobytes()
    out["parameters"] = {"binary_data_size": len(raw_out)}
    header = dumps(resp).encode()
    return Response(header + raw_out, media_type="application/octet-stream", headers={HEADER: str(len(header))})
