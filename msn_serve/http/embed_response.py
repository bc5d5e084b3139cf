"""``/embed`` response bodies: content negotiation between JSON and raw float32, and fast encodings of both.

At 64 single-image clients the event loop's largest cost was writing embeddings as JSON text with the standard
library (``float.__repr__`` per value: more than parsing the multipart upload). JSON is therefore written by
orjson straight from the float32 array (shortest float32 text, a small fraction of that; still exact: parsing it
back to float32 gives the same bits), and a client that only wants the matrix can ask for the bytes instead:

- ``Accept: application/octet-stream``: the embeddings as row-major little-endian float32 (``n * dim * 4``
  bytes), ``X-Embedding-Shape: n,dim`` and ``X-Embedding-Dtype: <f4``; ``np.frombuffer(body, "<f4").reshape(n, dim)``
- ``Accept: application/x-npy``: the same array as a NumPy ``.npy`` file; ``np.load(io.BytesIO(body))``

Both carry ``X-Model-Id``, ``X-Normalized`` and ``X-Kept-Tokens`` (kept patches per image, comma-separated). The
``keep_idx`` of a masked request is only in the JSON form. JSON stays the default (no ``Accept``, ``*/*``,
``application/json``); an ``Accept`` that allows none of the three is a 406 naming them. Errors are always JSON.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response

from msn_core.bundle import BundleInfo
from msn_serve.errors import ApiError
from msn_serve.http.schemas import EmbedRequest

JSON, RAW, NPY = "application/json", "application/octet-stream", "application/x-npy"
SUPPORTED = (JSON, RAW, NPY)
# What a wildcard stands for: JSON, the format every client can read.
_WILDCARDS = {"*/*": JSON, "application/*": JSON}


def negotiate(accept: str | None) -> str:
    """The response type for an ``Accept`` header: the listed type with the highest q (the first of equals) that
    ``/embed`` can write; 406 when none is acceptable."""
    if not accept or not accept.strip():
        return JSON
    best, best_q = None, 0.0
    for part in accept.split(","):
        media, _, params = part.strip().partition(";")
        media = media.strip().lower()
        q = 1.0
        for p in params.split(";"):
            key, _, value = p.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        chosen = media if media in SUPPORTED else _WILDCARDS.get(media)
        if chosen is not None and q > best_q:
            best, best_q = chosen, q
    if best is None:
        raise ApiError(406, f"cannot answer with {accept[:200]!r}; /embed writes {', '.join(SUPPORTED)}")
    return best


def json_response(head: dict[str, Any], emb: np.ndarray, keep_idx: list[np.ndarray] | None) -> Response:
    """``{**head, "keep_idx"?: [[...]], "embeddings": [[...]]}``; the caller checked the embeddings are finite
    (orjson would write a non-finite float as ``null``)."""
    body = dict(head)
    if keep_idx is not None:
        body["keep_idx"] = [np.ascontiguousarray(k, dtype=np.int64) for k in keep_idx]
    body["embeddings"] = np.ascontiguousarray(emb, dtype=np.float32)
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type=JSON)


def embeddings_response(media: str, emb: np.ndarray, *, model_id: str, normalized: bool,
                        kept_tokens: list[int]) -> Response:
    """``emb`` (n, dim) as a raw float32 or ``.npy`` body with its shape and provenance in headers."""
    arr = np.ascontiguousarray(emb, dtype="<f4")
    if media == NPY:
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        body = buf.getvalue()
    else:
        body = arr.tobytes()
    headers = {"X-Embedding-Shape": f"{arr.shape[0]},{arr.shape[1]}", "X-Embedding-Dtype": "<f4",
               "X-Model-Id": model_id, "X-Normalized": "true" if normalized else "false",
               "X-Kept-Tokens": ",".join(str(k) for k in kept_tokens), "Vary": "Accept"}
    return Response(body, media_type=media, headers=headers)


def embed_response(media: str, emb: np.ndarray, req: EmbedRequest, info: BundleInfo) -> Response:
    """The ``/embed`` answer in ``media``; ``keep_idx`` is echoed (JSON only) when the client sent a mask."""
    keeps = req.keep_idx or []
    kept = [int(k.size) for k in keeps]
    if media != JSON:
        return embeddings_response(media, emb, model_id=info.model_id, normalized=req.normalize, kept_tokens=kept)
    head = {"model_id": info.model_id, "dim": info.embed_dim, "count": len(keeps), "normalized": req.normalize,
            "kept_tokens": kept}
    return json_response(head, emb, keeps if "mask" in req.model_fields_set else None)
