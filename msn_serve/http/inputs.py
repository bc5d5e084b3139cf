"""One reader for the two request encodings every image endpoint accepts.

``multipart/form-data``: files in ``image``/``images`` (``curl -F image=@x.jpg``), other parameters as text fields
holding JSON (``-F mask='{"ratio": 0.5}'``). ``application/json``: the same names, images as base64 strings
(optionally ``data:`` URIs). :func:`read_request` then validates the fields with the endpoint's request model
(:mod:`msn_serve.http.schemas`), which answers a 422 naming the field when one is wrong (the mask included).

Where the work runs: the body is *received* on the event loop (a multipart body is split into parts as it streams
in, chunk by chunk); parsing the JSON, decoding base64 images and validating the fields run in a small thread pool
of their own once the body is over :data:`OFF_LOOP_ABOVE` bytes, so a 30 MB few-shot fit never holds ``/healthz``
(:func:`msn_serve.jsontext.loads` lets that thread hand the GIL back while it parses; docs/serving.md).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.datastructures import UploadFile
from starlette.requests import Request

from msn_serve.config import Settings
from msn_serve.errors import ApiError, too_large, unprocessable
from msn_serve.http.schemas import RequestModel
from msn_serve.jsontext import loads

IMAGE_FIELDS = ("image", "images")
M = TypeVar("M", bound=RequestModel)
T = TypeVar("T")
OFF_LOOP_ABOVE = 64 * 1024  # bodies up to this size are parsed in place (a thread hop costs more than the parse)
# Its own two threads: a large parse never queues behind FAISS or store work (msn_serve.work), nor they behind it.
_PARSERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msn-parse")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in place for a body of ``size`` bytes up to :data:`OFF_LOOP_ABOVE`, else in a parser thread."""
    if size <= OFF_LOOP_ABOVE:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_PARSERS, fn, *args)


@dataclass
class Payload:
    """A request body before validation: decoded images and the other fields (multipart text or JSON values)."""

    images: list[tuple[str, bytes]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    multipart: bool = False


def _b64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise unprocessable(f"{what}: expected a base64 string, got {type(text).__name__}")
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if ";base64" not in head:
            raise unprocessable(f"{what}: data URI must be base64-encoded")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise unprocessable(f"{what}: invalid base64") from None


async def read_payload(request: Request, *, max_images: int, max_body: int) -> tuple[Payload | bytes, int]:
    """Receive the body: a multipart body as its :class:`Payload` (parts split as they stream in), a JSON body as
    its bytes for :func:`json_payload`; with the body's size in bytes. 4xx on anything malformed."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=max_images, max_fields=64, max_part_size=max_body)
        except ApiError:  # 413 from the body-size guard while the parts stream in
            raise
        except Exception as e:  # noqa: BLE001 - starlette raises MultiPartException / HTTPException for malformed bodies
            msg = getattr(e, "detail", None) or getattr(e, "message", None) or str(e)
            if "Too many files" in str(msg):
                raise ApiError(413, f"too many files: at most {max_images} images per request") from None
            raise unprocessable(f"malformed multipart body: {msg}") from None
        out, size = Payload(multipart=True), 0
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in IMAGE_FIELDS:
                    raise unprocessable(f"unexpected file field {key!r}; send images as 'image' or 'images'")
                data = await value.read()
                size += len(data)
                out.images.append((f"{key}[{len(out.images)}] ({value.filename or 'upload'})", data))
            elif key in IMAGE_FIELDS:
                raise unprocessable(f"{key}: must be a file upload (curl -F {key}=@file.jpg), not a text field")
            elif key in out.fields:
                raise unprocessable(f"field {key!r} given more than once")
            else:
                size += len(value)
                out.fields[key] = value
        await form.close()
        return out, size
    if ctype in ("application/json", ""):
        body = await request.body()
        return body, len(body)
    raise ApiError(415, f"unsupported content type {ctype!r}; use multipart/form-data or application/json")


def json_payload(body: bytes, max_images: int) -> Payload:
    """A JSON body's images (base64-decoded) and other fields; 4xx on anything malformed."""
    if not body:
        return Payload()
    data = loads(body, "request body")
    if not isinstance(data, dict):
        raise unprocessable("JSON body must be an object")
    out = Payload(fields={k: v for k, v in data.items() if k not in IMAGE_FIELDS})
    if "image" in data:
        out.images.append(("image", _b64(data["image"], "image")))
    if "images" in data:
        imgs = data["images"]
        if not isinstance(imgs, list):
            raise unprocessable("images: expected a list of base64 strings")
        if len(imgs) > max_images:
            raise too_large(f"too many images: at most {max_images} per request")
        out.images += [(f"images[{i}]", _b64(s, f"images[{i}]")) for i, s in enumerate(imgs)]
    return out


async def read_request(request: Request, model: type[M], settings: Settings) -> M:
    """Read the body (multipart or JSON) and the model's query parameters into a validated ``model``; a large body is
    parsed and validated off the event loop. Its mask is resolved later, on the grid of the model that embeds."""
    raw, size = await read_payload(request, max_images=settings.max_images_per_request,
                                   max_body=settings.max_body_bytes)
    query = {key: request.query_params[key] for key in model.QUERY if key in request.query_params}

    def parse() -> M:
        payload = raw if isinstance(raw, Payload) else json_payload(raw, settings.max_images_per_request)
        fields = payload.fields
        for key, value in query.items():  # ?k=10 works like a body field; the body wins when both are given
            fields.setdefault(key, value)
        return model.from_fields(fields, settings, multipart=payload.multipart, images=payload.images)

    return await off_loop(size, parse)
