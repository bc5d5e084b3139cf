"""The preparation and response stages of ``POST /embed`` in an HTTP process.

Preparation is everything the single process does before its batcher, with the same code and the same errors:
content negotiation, the body (multipart or JSON) read and validated (:func:`msn_serve.http.inputs.read_request`),
the model looked up in the catalog and the masks resolved on its grid, each upload decoded and cropped within the
pixel limits (:func:`msn_serve.embedding.preprocess.resized_bytes`) and left as uint8 in the ring. The engine
stage normalises and embeds (:mod:`msn_serve.workers.desk`); the response stage writes its embeddings as
:func:`msn_serve.http.embed_response.embed_response` does.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from msn_core.bundle import Preprocessing
from msn_serve.config import Settings
from msn_serve.embedding.preprocess import PixelBudget, resized_bytes
from msn_serve.errors import ApiError, unprocessable
from msn_serve.http.embed_response import embed_response, negotiate
from msn_serve.http.inputs import read_request
from msn_serve.http.schemas import EmbedRequest
from msn_serve.workers import wire
from msn_serve.workers.link import EngineLink

log = logging.getLogger("msn_serve")


@dataclass(frozen=True)
class Embedded:
    """What the response names: the model that embedded (the engine says which) and the width."""

    model_id: str
    embed_dim: int


class EmbedStages:
    """``POST /embed`` in an HTTP process: prepare here, embed in the engine process, respond here."""

    def __init__(self, settings: Settings, link: EngineLink, threads: int = 2):
        self.settings, self.link = settings, link
        self._decoders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="msn-decode")

    async def __call__(self, request: Request) -> Response:
        try:
            return await self.respond(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:  # as the single process's handler: logged, a JSON 500
            log.exception("unhandled error")
            self.link.count_error("internal")
            return JSONResponse({"error": f"internal server error: {type(e).__name__}"}, status_code=500)

    async def respond(self, request: Request) -> Response:
        media = negotiate(request.headers.get("accept"))  # a 406 before any work
        req = await read_request(request, EmbedRequest, self.settings)
        for _ in range(2):  # a model replaced meanwhile: prepare again for the one served now, once
            if self.link.catalog is None:
                raise ApiError(503, "service is starting", headers={"Retry-After": "1"})
            info = self.link.catalog.get(req.model)
            req.resolve_masks(info.grid)
            if not req.images:
                raise unprocessable("no image: send files as 'image'/'images' (multipart) or base64 in JSON")
            crops = await self.prepare(req.images, info.preprocessing)
            reply = await self.link.embed(req.model, wire.preparation(info), crops, req.keep_idx)
            if reply.status != wire.STALE:
                break
        if reply.status == wire.STALE:
            raise ApiError(503, "the model was replaced twice while this request was prepared; retry",
                           headers={"Retry-After": "1"})
        if reply.status != 200:
            error = dict(reply.error or {})
            headers = error.pop("headers", None) or None
            return JSONResponse(error, status_code=reply.status, headers=headers)
        emb = reply.embeddings
        assert emb is not None
        if req.normalize:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return embed_response(media, emb, req, Embedded(reply.model_id, emb.shape[1]))  # type: ignore[arg-type]

    async def prepare(self, images: list[tuple[str, bytes]], pre: Preprocessing) -> list[np.ndarray]:
        """Each upload decoded and cropped to uint8 ``(H, W[, C])``: in place for one image (no thread hop), in the
        decoding threads for several; the first failure, as the single process reports it."""
        s = self.settings
        budget = PixelBudget(s.max_request_pixels)

        def crop(what: str, data: bytes) -> np.ndarray:
            return np.asarray(resized_bytes(data, pre, max_pixels=s.max_image_pixels, what=what, budget=budget))

        if len(images) == 1:
            results: list = [_attempt(crop, *images[0])]
        else:
            loop = asyncio.get_running_loop()
            results = await asyncio.gather(*[loop.run_in_executor(self._decoders, _attempt, crop, w, d)
                                             for w, d in images])
        for r in results:
            if isinstance(r, ApiError):
                self.link.count_error("bad_image")
                raise r
            if isinstance(r, BaseException):
                self.link.count_error("preprocess")
                raise unprocessable(f"could not preprocess image: {r!r}")
        return results

    def close(self) -> None:
        self._decoders.shutdown(wait=False, cancel_futures=True)


def _attempt(fn: Callable[..., np.ndarray], *args: object) -> np.ndarray | Exception:
    """``fn(*args)``, or the exception it raised (the first failure is reported in the order of the images)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
