"""What goes on the wire: images as file bytes, masks as the server's JSON specification, request bodies.

Images travel as files (``multipart/form-data``, what ``curl -F image=@x.png`` sends) with the other fields as text
parts holding JSON, exactly as the server reads them (docs/serving.md); vectors travel as JSON. The body is built
here rather than by httpx so that the client and the benchmarks' load generator send the same bytes.
"""
from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import quote

import numpy as np

from msn_serve.client.options import NOT_GIVEN, NotGiven, Timeout

if TYPE_CHECKING:
    from PIL import Image as PILImage

#: One image: a file path, the file's bytes, a PIL image, or a uint8 array (H, W), (H, W, 3) or (H, W, 4).
ImageInput = Union[str, os.PathLike, bytes, bytearray, memoryview, "PILImage.Image", np.ndarray]
#: A mask: a specification dict (``{"ratio": 0.7, "seed": 1}``, ``{"focal": {"size": [4, 4]}}``,
#: ``{"keep_idx": [...]}``, ``{"bitmap": [[0/1]]}``), one per image (a list), or an array: a boolean/0-1 patch
#: grid (kept = true) or a 1-D array of kept patch indices.
MaskInput = dict | list | np.ndarray | None
#: One image or a list of them (a 4-D uint8 array is a batch).
Images = ImageInput | list[ImageInput]


def image_file(image: ImageInput, where: str = "image") -> tuple[str, bytes, str]:
    """``(filename, bytes, content type)`` of one image. Files and bytes are sent as they are (the server decodes
    them, so its preprocessing applies unchanged); PIL images and arrays are written as lossless PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return "upload", bytes(image), "application/octet-stream"
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        try:
            return path.name, path.read_bytes(), "application/octet-stream"
        except OSError as e:
            raise ValueError(f"{where}: cannot read {str(path)!r}: {e.strerror or e}") from None
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (1, 3, 4))):
            raise ValueError(f"{where}: an array image must be uint8 (H, W), (H, W, 3) or (H, W, 4), got "
                             f"{image.dtype} {image.shape}")
        from PIL import Image

        image = Image.fromarray(image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    save = getattr(image, "save", None)
    if save is None:
        raise TypeError(f"{where}: expected a path, bytes, a PIL image or a uint8 array, got {type(image).__name__}")
    buf = io.BytesIO()
    save(buf, format="PNG")
    return "image.png", buf.getvalue(), "image/png"


def mask_spec(mask: MaskInput) -> Any:
    """The JSON specification of a mask (arrays converted; dicts and lists pass as they are)."""
    if isinstance(mask, np.ndarray):
        if mask.ndim == 2:
            return {"bitmap": mask.astype(bool).astype(int).tolist()}
        if mask.ndim == 1 and mask.dtype.kind in "iu":
            return {"keep_idx": mask.astype(int).tolist()}
        raise ValueError(f"mask: an array mask is a 2-D patch grid or 1-D kept indices, got {mask.dtype} "
                         f"{mask.shape}")
    return mask


def jsonable(value: Any) -> Any:
    """``value`` with NumPy arrays and scalars as lists and numbers (what ``json`` writes)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def multipart_body(files: list[tuple[str, bytes, str]], fields: dict[str, Any], *, text_fields: tuple[str, ...] = (),
                   boundary: str | None = None) -> tuple[bytes, str]:
    """``(body, content type)``: one ``images`` part per file, then one text part per field that is not ``None``
    (as JSON, except ``text_fields``, which are sent as they are)."""
    boundary = boundary or f"msnclient{uuid.uuid4().hex}"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="{name}"\r\n'
             f"Content-Type: {ctype}\r\n\r\n".encode() + data + b"\r\n" for name, data, ctype in files]
    for key, value in fields.items():
        if value is None:
            continue
        text = value if key in text_fields else json.dumps(jsonable(value), separators=(",", ":"))
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{text}\r\n'.encode())
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def json_body(fields: dict[str, Any]) -> bytes:
    """A JSON object of the fields that are not ``None``."""
    return json.dumps({k: jsonable(v) for k, v in fields.items() if v is not None}, separators=(",", ":")).encode()


@dataclass
class Call:
    """One request and how to read its answer: built once by a resource, sent by the sync or the async client."""

    method: str
    path: str
    parse: Callable[[Any], Any]  # the decoded answer (JSON value, or the :class:`Answer` when ``raw``) -> result
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] | None = None
    raw: bool = False  # hand ``parse`` the whole :class:`Answer` (binary bodies, headers)
    accept_status: tuple[int, ...] = ()  # non-2xx statuses that are an answer, not an error (/readyz's 503)
    idempotent: bool = True  # sending it twice leaves what sending it once does: retried after a lost answer
    retry: bool = True  # False for probes (health, ready): answered as they are, never sent again
    timeout: Timeout | NotGiven = NOT_GIVEN  # this call's timeout (the client's when not given)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    content: bytes


def image_call(method: str, path: str, parse: Callable[[Any], Any], images: list[ImageInput],
               fields: dict[str, Any], *, text_fields: tuple[str, ...] = ("model",),
               headers: dict[str, str] | None = None, **kw: Any) -> Call:
    """A request with images (multipart) or without (JSON), with ``fields``; ``kw``: the rest of :class:`Call`."""
    if images:
        files = [image_file(im, f"images[{i}]") for i, im in enumerate(images)]
        body, ctype = multipart_body(files, fields, text_fields=text_fields)
    else:
        body, ctype = json_body(fields), "application/json"
    return Call(method, path, parse, content=body, headers={"Content-Type": ctype, **(headers or {})}, **kw)


def json_call(method: str, path: str, parse: Callable[[Any], Any], fields: dict[str, Any] | None = None,
              **kw: Any) -> Call:
    """A request with a JSON body of ``fields`` (none for ``None``)."""
    if fields is None:
        return Call(method, path, parse, **kw)
    return Call(method, path, parse, content=json_body(fields),
                headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def quoted(name: str) -> str:
    """A store's or model's name as one path segment."""
    return quote(name, safe="")


def id_list(ids: Any) -> list[int] | None:
    """Ids (any int sequence or array) as a JSON list; ``None`` stays ``None``."""
    return None if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]


def matrix(value: Any) -> np.ndarray | None:
    """Vectors as (n, dim) float32; one 1-D vector is one row."""
    return None if value is None else np.atleast_2d(np.asarray(value, dtype=np.float32))


def images_or_vectors(images: Any, vectors: Any, what: str) -> list[ImageInput]:
    """The images to send as files (none when ``vectors`` are sent instead); exactly one of the two is given."""
    if (images is None) == (vectors is None):
        raise ValueError(f"send either images or {what}")
    return [] if images is None else as_image_list(images)


def as_image_list(images: ImageInput | list[ImageInput] | tuple[ImageInput, ...]) -> list[ImageInput]:
    """One image or a sequence of them, as a list. A 4-D uint8 array is a batch of images."""
    if isinstance(images, (list, tuple)):
        return list(images)
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    return [images]
