"""OpenAI-compatible routes: ``POST /v1/embeddings`` and ``GET /v1/models``, for the clients people already call
embedding servers with (the ``openai`` package, LangChain, LlamaIndex).

The embeddings go through the same embedding service and batcher as ``/embed`` (same preprocessing, same batches),
so the vectors are the ones ``/embed`` returns for the same images and mask (not L2-normalised, like ``/embed``'s
default). An input is an image: a base64 ``data:`` URL or raw base64, or an ``http(s)://`` URL when the operator
enabled URL inputs (:mod:`msn_serve.http.url_fetch`). A mask rides as the extension field ``mask`` (the format of
``/embed``, one spec for all inputs or one per input; ``extra_body={"mask": ...}`` with the ``openai`` client).
``usage`` counts the patch tokens the encoder saw: the kept patches of each image (all of them without a mask).
``model`` is a served name (``/v1/models`` lists each as its ``id``); the answer's ``model`` is the bundle's model
id, which says which weights made the vectors, as OpenAI answers a dated snapshot for an alias.

Errors on these routes are OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``, with 400 for
a malformed request (the native API's 422s), 404 for an unknown model; the limits, auth and body cap are the rest
of the API's. :class:`OpenAIErrorShape` rewrites the answers given before a route runs (401, 413 of the guard) and
any other ``{"error": "..."}`` on these paths into the same object.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from msn_core.bundle import BundleInfo
from msn_serve.config import Settings
from msn_serve.embedding.models import MSN_ALIAS, ModelLookups, ServedModel
from msn_serve.errors import ApiError
from msn_serve.http.embedder import Decode, Embedder, Items
from msn_serve.http.fields import MASK_DOC
from msn_serve.http.inputs import off_loop
from msn_serve.http.responses import StrictJSONResponse
from msn_serve.http.url_fetch import fetch_image
from msn_serve.jsontext import loads
from msn_serve.masks import request_keep_idx

if TYPE_CHECKING:  # the HTTP worker processes import this module (embeddings_with): not the runtime
    from msn_serve.runtime import Runtime

PREFIX = "/v1/"
FETCHES_AT_ONCE = 4  # URL inputs of one request fetched concurrently
FIELDS = {"model", "input", "encoding_format", "user", "mask", "dimensions"}
# OpenAI's ``type`` for each status (its API answers 400/401/403/404/409/413/422/429/5xx with these).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 503: "service_unavailable"}

router = APIRouter(prefix="/v1", tags=["openai"], default_response_class=StrictJSONResponse)


class OpenAIError(ApiError):
    """An :class:`ApiError` whose body is OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status, message, headers=headers)
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_object(self.status, self.message, self.param, self.code)


def error_object(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or CODES.get(status)}}


def _bad(message: str, param: str | None = "input") -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


def _check_model(models: ModelLookups, model: Any) -> Any:
    """The model ``model`` names: a served name (what ``/v1/models`` lists as ``id``), ``msn`` (the default), or a
    bundle's model id when one served model has it (400 when several do: their vectors may come from different
    runtimes and precisions, so the caller picks)."""
    if not isinstance(model, str) or not model:
        raise _bad("model: expected a served model's id (GET /v1/models lists them)", "model")
    served = models.models
    if model in served:
        return served[model]
    if model == MSN_ALIAS:
        return models.default
    named = [name for name, m in served.items() if m.info.model_id == model]
    if len(named) == 1:
        return served[named[0]]
    if named:
        raise _bad(f"model: {model[:200]!r} is the bundle of several served models ({', '.join(map(repr, named))});"
                   " pass one of their names (GET /v1/models)", "model")
    raise OpenAIError(404, f"The model {model[:200]!r} does not exist; this server serves "
                           f"{', '.join(map(repr, served))} (GET /v1/models)", param="model")


def _decode(item: Any, i: int) -> bytes:
    """Input ``i`` as file bytes: a base64 ``data:`` URL or raw base64 (400 naming the index otherwise)."""
    if not isinstance(item, str):
        raise _bad(f"input[{i}]: expected an image as a base64 string or data URL, got {type(item).__name__} "
                   "(this model embeds images, not text tokens)")
    text = item
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or ";base64" not in head:
            raise _bad(f"input[{i}]: a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"input[{i}]: invalid base64 (send a data URL or the base64 of an image file)") from None
    if not data:
        raise _bad(f"input[{i}]: empty image")
    return data


async def _fetch_all(urls: dict[int, str], s: Settings) -> dict[int, bytes]:
    """The URL inputs' bytes, fetched on worker threads, a few at a time; together they may hold no more than a
    request body (``max_body_mb``, 413 beyond), each no more than ``url_max_mb``."""
    budget = [s.max_body_bytes]
    gate = asyncio.Semaphore(FETCHES_AT_ONCE)

    def over(i: int) -> OpenAIError:
        return OpenAIError(413, f"the images fetched for input[{i}] and before exceed the request body limit of "
                                f"{s.max_body_bytes} bytes (max_body_mb)", param="input")

    async def one(i: int, url: str) -> bytes:
        async with gate:
            if budget[0] <= 0:
                raise over(i)
            cap = min(int(s.url_max_mb * 2**20), budget[0])
            try:
                data = await asyncio.to_thread(fetch_image, url, max_bytes=cap, timeout_s=s.url_timeout_s)
            except ApiError as e:
                raise OpenAIError(e.status, f"input[{i}]: {e.message}", param="input") from None
            budget[0] -= len(data)
            if budget[0] < 0:
                raise over(i)
            return data

    fetched = await asyncio.gather(*(one(i, u) for i, u in urls.items()))
    return dict(zip(urls, fetched, strict=True))


def _parse(body: bytes, models: ModelLookups,
           settings: Settings) -> tuple[dict[str, Any], dict[int, bytes], dict[int, str]]:
    """The request's fields, its decoded images and its URLs (by input index); the model, the fields and the
    count are checked before any image is decoded (the model again, by the route, once it is parsed)."""
    data = loads(body, "request body", status=400)
    if not isinstance(data, dict):
        raise _bad("the request body must be a JSON object", None)
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise _bad(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(FIELDS))}",
                   unknown[0])
    info = _check_model(models, data.get("model")).info
    if data.get("encoding_format", "float") not in ("float", "base64"):
        raise _bad("encoding_format: expected 'float' or 'base64'", "encoding_format")
    dims = data.get("dimensions")
    if dims is not None and dims != info.embed_dim:
        raise _bad(f"dimensions: this model's embeddings have {info.embed_dim} dimensions and are not "
                   "shortened", "dimensions")
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise _bad("user: expected a string", "user")
    if "input" not in data:
        raise _bad("input: required (an image as a base64 data URL, or a list of them)")
    raw = data["input"]
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise _bad("input: expected an image (base64 data URL) or a non-empty list of them")
    limit = settings.max_images_per_request
    if len(items) > limit:
        raise OpenAIError(413, f"{len(items)} inputs exceed the limit of {limit} per request "
                               "(max_images_per_request)", param="input")
    urls = {i: s for i, s in enumerate(items) if isinstance(s, str) and s.startswith(("http://", "https://"))}
    if urls and not settings.allow_url_inputs:
        raise _bad(f"input[{min(urls)}]: URL inputs are disabled on this server (the operator enables them with "
                   "--allow-url-inputs); send the image as a base64 data URL")
    data["input"] = items
    return data, {i: _decode(s, i) for i, s in enumerate(items) if i not in urls}, urls


async def _read(request: Request, embedder: Embedder) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """The request's fields and its images as ``(name, bytes)``; a large body is parsed off the event loop, URL
    inputs are fetched on worker threads."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        raise OpenAIError(415, f"unsupported content type {ctype!r}; send application/json")
    body = await request.body()
    data, decoded, urls = await off_loop(len(body), _parse, body, embedder.models, embedder.settings)
    decoded.update(await _fetch_all(urls, embedder.settings))
    return data, [(f"input[{i}]", decoded[i]) for i in range(len(data["input"]))]


def _as_openai(e: ApiError) -> OpenAIError:
    """The native API's error in OpenAI's shape: its 422 (bad image, bad mask) is OpenAI's 400."""
    if isinstance(e, OpenAIError):
        return e
    return OpenAIError(400 if e.status == 422 else e.status, e.message, param=getattr(e, "param", None),
                       headers=e.headers)


def _body(model_id: str, emb: np.ndarray, keeps: list[np.ndarray], encoding: str) -> bytes:
    """OpenAI's embeddings list; ``base64`` is each vector's little-endian float32 bytes, base64-encoded."""
    arr = np.ascontiguousarray(emb, dtype="<f4")
    if encoding == "base64":
        vectors: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in arr]
    else:
        vectors = list(arr)
    tokens = int(sum(k.size for k in keeps))
    body = {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": model_id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


IMAGE_DOC = "an image: a base64 data URL (data:image/png;base64,...), raw base64, or an http(s) URL if enabled"
EMBEDDINGS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "description": "a served model's id (GET /v1/models), 'msn' (the default) "
                                                   "or a bundle's model id served under one name"},
        "input": {"oneOf": [{"type": "string", "description": IMAGE_DOC},
                            {"type": "array", "minItems": 1, "items": {"type": "string", "description": IMAGE_DOC}}]},
        "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float"},
        "dimensions": {"type": "integer", "description": "if given, the model's embedding size"},
        "user": {"type": "string"},
        "mask": {"description": "extension: " + MASK_DOC}}}}}}}


@router.post("/embeddings", openapi_extra=EMBEDDINGS_BODY)
async def embeddings(request: Request) -> Response:
    """OpenAI's embeddings endpoint for images: ``{"model", "input": [data URL, ...], "encoding_format"?,
    "mask"?}`` -> ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage"}``; ``usage`` counts kept patch tokens. Errors are OpenAI's error object."""
    return await embeddings_with(request, request.app.state.embedder)


async def embeddings_with(request: Request, embedder: Embedder) -> Response:
    """``POST /v1/embeddings`` through ``embedder``: in this process, or prepared by an HTTP worker process."""
    try:
        data, images = await _read(request, embedder)
        name = _check_model(embedder.models, data["model"]).name

        async def prepare(info: BundleInfo, decode: Decode) -> Items:
            keeps = request_keep_idx(data.get("mask"), len(images), info.grid)  # MaskRejected: param "mask"
            return list(zip(await decode(images), keeps, strict=True))

        done = await embedder.embed(name, prepare, status=422)
    except ApiError as e:
        raise _as_openai(e) from None
    emb = done.embeddings
    body = await off_loop(emb.size * 12, _body, done.model_id, emb, done.keeps, data.get("encoding_format", "float"))
    return Response(body, media_type="application/json")


def _model_card(served: ServedModel) -> dict[str, Any]:
    try:
        created = int((served.spec.bundle / "msn.json").stat().st_mtime)
    except OSError:
        created = 0
    return {"id": served.name, "object": "model", "created": created, "owned_by": "msn-serve",
            "model_id": served.info.model_id}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The served models, as OpenAI lists models, the default first. ``id`` is the served name (unique: what
    ``model`` takes), ``model_id`` the bundle's model id (what stores record; two names may serve one bundle),
    ``created`` when the bundle's ``msn.json`` was written."""
    return {"object": "list", "data": [_model_card(m) for m in _rt(request).models.models.values()]}


@router.get("/models/{model}")
async def model(model: str, request: Request) -> dict[str, Any]:
    """One model's card (by served name, ``msn``, or a model id one model has); 404 in OpenAI's shape else."""
    return _model_card(_check_model(_rt(request).models, model))


class OpenAIErrorShape:
    """Error answers on ``/v1/`` paths as OpenAI's error object, also those given before a route runs (the guard's
    401 and 413, an unknown ``/v1`` path, a 500): a JSON body whose ``error`` is a string is rewritten."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(msg: Message) -> None:
            nonlocal held
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                held = msg
                return
            if held is None or msg["type"] != "http.response.body":
                await send(msg)
                return
            chunks.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            body = b"".join(chunks)
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
                body = json.dumps(error_object(held["status"], parsed["error"])).encode()
            headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**held, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def install(app: FastAPI) -> None:
    """Add the routes and, outside the guard (call after it was added), the error rewriting."""
    app.include_router(router)
    app.add_middleware(OpenAIErrorShape)
