"""The messages between an HTTP process and the engine process: small, length-prefixed, over a local socket.

Pixels never travel here: an embed request names the ring slots its images wait in (:mod:`msn_serve.workers.ring`).

- ``E`` (HTTP -> engine) embed: request id, model name, what the images were prepared for (:func:`preparation`),
  the status that answers non-finite embeddings (the route's: 422, or 400 under OIP), and per image its slot, shape
  ``(C, H, W)`` and kept-patch count.
- ``R`` (engine -> HTTP) the answer: status 200 with the model id and the float32 embeddings, :data:`STALE` when
  the model was replaced by one that prepares crops otherwise (prepare again from the new catalog), or an error
  status with its JSON body (``{"error", "headers"}``); the slots of the request are free again once it arrives.
- ``C`` (engine -> HTTP) the catalog of models served (each model's ``msn.json``, and the default's name): sent on
  connection and after every model change.
- ``M`` (HTTP -> engine) request records (route, method, status, seconds) and error counts, for the one
  ``/metrics`` the engine process renders: it outlives the HTTP processes, so their counters never go down.
- ``X`` (HTTP -> engine) how many of the connections the engine process handed over have closed.
"""
from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from msn_core.bundle import BundleInfo

_LEN = struct.Struct("<I")
_EMBED = struct.Struct("<IHHHH")  # request id, image count, model name length, preparation length, status
_IMAGE = struct.Struct("<IHHBH")  # slot, height, width, channels, kept patches
_REPLY = struct.Struct("<IHHHH")  # request id, status, count, dim, model id length
MAX_MESSAGE = 64 << 20
STALE = 1  # reply status: the crops were prepared for another model than the one served now under that name


@dataclass(frozen=True)
class ImageRef:
    slot: int
    height: int
    width: int
    channels: int
    kept: int


@dataclass(frozen=True)
class EmbedCall:
    request: int
    model: str | None  # None: the default model
    images: list[ImageRef]
    prepared_for: str = ""  # preparation(info) of the model the images and masks were made for
    status: int = 422  # the answer to non-finite embeddings


def preparation(info: BundleInfo) -> str:
    """What a prepared image and its kept indices depend on (decoding, the crop, normalisation, the patch grid, the
    graph's input shape): equal for two models means images prepared for one are right for the other."""
    p = info.preprocessing
    return (f"{p.resize}/{p.crop}/{p.channels}/{p.interpolation}/{list(p.mean)}/{list(p.std)}/{info.grid}/"
            f"{info.in_chans}x{info.image_size}")


@dataclass(frozen=True)
class Reply:
    request: int
    status: int
    model_id: str = ""
    embeddings: np.ndarray | None = None
    error: dict[str, Any] | None = None


def frame(kind: bytes, payload: bytes) -> bytes:
    return _LEN.pack(len(payload) + 1) + kind + payload


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """``(kind, payload)`` of the next message; ``IncompleteReadError`` at the end of the stream."""
    (size,) = _LEN.unpack(await reader.readexactly(4))
    if not 1 <= size <= MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    body = await reader.readexactly(size)
    return body[:1], body[1:]


def embed_message(call: EmbedCall) -> bytes:
    name, prepared = (call.model or "").encode(), call.prepared_for.encode()
    parts = [_EMBED.pack(call.request, len(call.images), len(name), len(prepared), call.status), name, prepared]
    parts += [_IMAGE.pack(i.slot, i.height, i.width, i.channels, i.kept) for i in call.images]
    return frame(b"E", b"".join(parts))


def parse_embed(payload: bytes) -> EmbedCall:
    request, count, name_len, prepared_len, status = _EMBED.unpack_from(payload)
    at = _EMBED.size
    name = payload[at: at + name_len].decode()
    prepared = payload[at + name_len: at + name_len + prepared_len].decode()
    at += name_len + prepared_len
    images = [ImageRef(*_IMAGE.unpack_from(payload, at + i * _IMAGE.size)) for i in range(count)]
    return EmbedCall(request, name or None, images, prepared, status)


def reply_message(reply: Reply) -> bytes:
    if reply.embeddings is not None:
        emb = np.ascontiguousarray(reply.embeddings, dtype="<f4")
        mid = reply.model_id.encode()
        head = _REPLY.pack(reply.request, reply.status, emb.shape[0], emb.shape[1], len(mid))
        return frame(b"R", head + mid + emb.tobytes())
    body = json.dumps(reply.error or {}).encode()
    return frame(b"R", _REPLY.pack(reply.request, reply.status, 0, 0, 0) + body)


def parse_reply(payload: bytes) -> Reply:
    request, status, count, dim, mid_len = _REPLY.unpack_from(payload)
    at = _REPLY.size
    if status != 200:
        return Reply(request, status, error=json.loads(payload[at:] or b"{}"))
    model_id = payload[at: at + mid_len].decode()
    at += mid_len
    emb = np.frombuffer(payload, dtype="<f4", count=count * dim, offset=at).reshape(count, dim)
    return Reply(request, status, model_id, emb)


def json_message(kind: bytes, document: Any) -> bytes:
    return frame(kind, json.dumps(document).encode())


def closed_message(count: int) -> bytes:
    return frame(b"X", _LEN.pack(count))


def parse_closed(payload: bytes) -> int:
    return _LEN.unpack(payload)[0]
