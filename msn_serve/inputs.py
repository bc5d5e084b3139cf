"""One reader for the two request encodings every image endpoint accepts.

``multipart/form-data``: files in ``image``/``images`` (``curl -F image=@x.jpg``), other parameters as text fields
holding JSON (``-F mask='{"ratio": 0.5}'``). ``application/json``: the same names, images as base64 strings
(optionally ``data:`` URIs). Handlers then ask for typed fields and get a 422 naming the field when it is wrong.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.datastructures import UploadFile
from starlette.requests import Request

from .errors import ApiError, too_large, unprocessable

IMAGE_FIELDS = ("image", "images")


@dataclass
class Payload:
    images: list[tuple[str, bytes]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    multipart: bool = False

    # -- typed accessors ---------------------------------------------------------------------------------------
    def raw(self, name: str, default: Any = None) -> Any:
        """JSON value of a field (multipart text is parsed as JSON, falling back to the plain string)."""
        return self._value(name, default, strict=False)

    def json_field(self, name: str, default: Any = None) -> Any:
        """Like :meth:`raw` but a multipart value *must* be valid JSON (lists, objects)."""
        return self._value(name, default, strict=True)

    def _value(self, name: str, default: Any, *, strict: bool) -> Any:
        if name not in self.fields:
            return default
        value = self.fields[name]
        if not (self.multipart and isinstance(value, str)):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            if not strict:
                return value
            raise unprocessable(f"{name}: not valid JSON ({e.msg} at position {e.pos})") from None

    def string(self, name: str, default: str | None = None) -> str | None:
        if name not in self.fields:
            return default
        v = self.fields[name]
        if not isinstance(v, str):
            raise unprocessable(f"{name}: expected a string, got {type(v).__name__}")
        return v

    def boolean(self, name: str, default: bool) -> bool:
        v = self.raw(name, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
            return v.lower() in ("true", "1", "yes")
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise unprocessable(f"{name}: expected true or false, got {v!r}")

    def integer(self, name: str, default: int, lo: int, hi: int) -> int:
        v = self.raw(name, default)
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise unprocessable(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}")
        return v

    def number(self, name: str, default: float) -> float:
        v = self.raw(name, default)
        try:
            f = float(v) if not isinstance(v, bool) else math.nan
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f):
            raise unprocessable(f"{name}: expected a finite number, got {v!r}")
        return f

    def matrix(self, name: str, dim: int) -> np.ndarray | None:
        """A list of equal-length numeric rows (embeddings / vectors), checked for shape and NaN."""
        v = self.json_field(name)
        if v is None:
            return None
        if not isinstance(v, list) or not v or not all(isinstance(r, list) for r in v):
            raise unprocessable(f"{name}: expected a non-empty list of vectors (list of lists of numbers)")
        try:
            arr = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise unprocessable(f"{name}: vectors must be equal-length lists of numbers") from None
        if arr.ndim != 2 or arr.shape[1] != dim:
            shape = arr.shape if arr.ndim == 2 else f"ragged/{arr.ndim}-d"
            raise unprocessable(f"{name}: expected vectors of dimension {dim}, got shape {shape}")
        if not np.isfinite(arr).all():
            raise unprocessable(f"{name}: vectors contain NaN or infinity")
        return arr.astype(np.float32)


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


async def read_payload(request: Request, *, max_images: int, max_body: int) -> Payload:
    """Parse the request body (multipart or JSON) into images + fields; 4xx on anything malformed."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=max_images, max_fields=64, max_part_size=max_body)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - starlette raises MultiPartException / HTTPException for malformed bodies
            msg = getattr(e, "detail", None) or getattr(e, "message", None) or str(e)
            if "Too many files" in str(msg):
                raise ApiError(413, f"too many files: at most {max_images} images per request") from None
            raise unprocessable(f"malformed multipart body: {msg}") from None
        out = Payload(multipart=True)
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in IMAGE_FIELDS:
                    raise unprocessable(f"unexpected file field {key!r}; send images as 'image' or 'images'")
                out.images.append((f"{key}[{len(out.images)}] ({value.filename or 'upload'})", await value.read()))
            elif key in IMAGE_FIELDS:
                raise unprocessable(f"{key}: must be a file upload (curl -F {key}=@file.jpg), not a text field")
            elif key in out.fields:
                raise unprocessable(f"field {key!r} given more than once")
            else:
                out.fields[key] = value
        await form.close()
        return out
    if ctype in ("application/json", ""):
        body = await request.body()
        if not body:
            return Payload()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise unprocessable(f"request body is not valid JSON ({e})") from None
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
    raise ApiError(415, f"unsupported content type {ctype!r}; use multipart/form-data or application/json")
