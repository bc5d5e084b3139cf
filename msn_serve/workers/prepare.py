"""The preparation and response stages of every embedding route in an HTTP process: ``POST /embed``,
``POST /v1/embeddings`` and OIP ``POST /v2/models/{m}/infer``.

The routes are the single process's own (:func:`msn_serve.http.routes.embed_with`,
:func:`msn_serve.http.openai_api.embeddings_with`, :func:`msn_serve.http.oip.infer_with`: the same code, so the same
answers and errors), run over a :class:`LinkEmbedder`: the model is looked up in the catalog the engine process sent,
the route's preparation (:mod:`msn_serve.http.embedder`) runs here — uploads decoded, cropped and normalised within
the pixel limits (:func:`msn_serve.embedding.preprocess.preprocess_bytes`) in this process's decoding threads, masks
resolved, OIP tensors checked — and the prepared images go into the ring for the engine stage
(:mod:`msn_serve.workers.desk`); the response is written here.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from msn_core.bundle import Preprocessing
from msn_serve.config import Settings
from msn_serve.embedding.models import ModelLookups
from msn_serve.embedding.preprocess import PixelBudget, preprocess_bytes
from msn_serve.errors import ApiError, unprocessable
from msn_serve.http.embedder import Embedded, Embedder, Prepare
from msn_serve.http.oip import infer_with
from msn_serve.http.openai_api import embeddings_with
from msn_serve.http.routes import embed_with
from msn_serve.workers import wire
from msn_serve.workers.link import EngineLink

log = logging.getLogger("msn_serve")
Route = Callable[..., Awaitable[Response]]
# (path pattern, the route template the single process's metrics name it by, the route): POST only.
ROUTES: list[tuple[re.Pattern[str], str, Route]] = [
    (re.compile(r"/embed"), "/embed", embed_with),
    (re.compile(r"/v1/embeddings"), "/v1/embeddings", embeddings_with),
    (re.compile(r"/v2/models/(?P<model>[^/]+)/infer"), "/v2/models/{model}/infer", infer_with),
    (re.compile(r"/v2/models/(?P<model>[^/]+)/versions/[^/]+/infer"), "/v2/models/{model}/versions/{ver}/infer",
     infer_with),
]


class RemoteError(ApiError):
    """An error the engine stage answered, with its body as it was written there."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None):
        super().__init__(status, str(body.get("error", "")), body.get("detail"), headers)
        self._body = body

    def body(self) -> dict[str, Any]:
        return dict(self._body)


class LinkEmbedder(Embedder):
    """An HTTP process's embedder: prepare here, embed in the engine process over ``link``."""

    def __init__(self, settings: Settings, link: EngineLink, threads: int = 2):
        self.settings, self.link = settings, link
        self._decoders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="msn-decode")

    @property
    def models(self) -> ModelLookups:
        if self.link.catalog is None:
            raise ApiError(503, "service is starting", headers={"Retry-After": "1"})
        return self.link.catalog

    def count_error(self, kind: str) -> None:
        self.link.count_error(kind)

    async def embed(self, name: str, prepare: Prepare, *, status: int) -> Embedded:
        for _ in range(2):  # a model replaced meanwhile: prepare again for the one served now, once
            info = self.models.get(name).info
            items = await prepare(info, functools.partial(self.decode, pre=info.preprocessing))
            reply = await self.link.embed(name, wire.preparation(info), items, status)
            if reply.status != wire.STALE:
                break
        else:
            raise ApiError(503, "the model was replaced twice while this request was prepared; retry",
                           headers={"Retry-After": "1"})
        if reply.status != 200:
            error = dict(reply.error or {})
            headers = error.pop("headers", None) or None
            raise RemoteError(reply.status, error, headers)
        assert reply.embeddings is not None
        return Embedded(reply.model_id, reply.embeddings, items)

    async def decode(self, images: list[tuple[str, bytes]], pre: Preprocessing) -> list[np.ndarray]:
        """Each upload decoded, cropped and normalised to float32 ``(C, H, W)``: in place for one image (no thread
        hop), in the decoding threads for several; the first failure, as the single process reports it."""
        s = self.settings
        budget = PixelBudget(s.max_request_pixels)

        def one(what: str, data: bytes) -> np.ndarray:
            return preprocess_bytes(data, pre, max_pixels=s.max_image_pixels, what=what, budget=budget)

        if len(images) == 1:
            results: list = [_attempt(one, *images[0])]
        else:
            loop = asyncio.get_running_loop()
            results = await asyncio.gather(*[loop.run_in_executor(self._decoders, _attempt, one, w, d)
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


class EmbedStages:
    """The embedding routes in an HTTP process (:data:`ROUTES`), over one :class:`LinkEmbedder`."""

    def __init__(self, settings: Settings, link: EngineLink, threads: int = 2):
        self.link = link
        self.embedder = LinkEmbedder(settings, link, threads)

    @staticmethod
    def match(method: str, path: str) -> tuple[str, Route, dict[str, str]] | None:
        """``(route template, route, path parameters)`` of an embedding route, or None (forward it)."""
        if method != "POST":
            return None
        for pattern, template, route in ROUTES:
            m = pattern.fullmatch(path)
            if m:
                return template, route, m.groupdict()
        return None

    async def __call__(self, route: Route, request: Request, params: dict[str, str]) -> Response:
        try:
            return await route(request, self.embedder, **params)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:  # as the single process's handler: logged, a JSON 500
            log.exception("unhandled error")
            self.link.count_error("internal")
            return JSONResponse({"error": f"internal server error: {type(e).__name__}"}, status_code=500)

    def close(self) -> None:
        self.embedder.close()


def _attempt(fn: Callable[..., np.ndarray], *args: object) -> np.ndarray | Exception:
    """``fn(*args)``, or the exception it raised (the first failure is reported in the order of the images)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
