"""Images (or preprocessed arrays) and their kept patches in, embeddings out: the engine behind the shared batches.

Masks arrive already resolved to ``keep_idx`` rows (the HTTP layer resolves a client's mask specification, so a bad
mask is a parsing error); this service decodes and transforms images in a pool of its own
(:class:`~msn_serve.embedding.decode_pool.DecodePool`: two threads on a CPU engine, which leave the cores to ONNX
Runtime; worker processes with ``--preprocess-workers``), sends ``(pixels, keep_idx)`` items through the
:class:`~msn_serve.embedding.batcher.Batcher`, and owns what readiness means: warmed up, and inference works.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msn_core.bundle import BundleInfo
from msn_core.inference import available_cpus
from msn_serve.config import Settings
from msn_serve.embedding.batcher import Batcher
from msn_serve.embedding.decode_pool import DecodePool
from msn_serve.embedding.engine import InferenceEngine
from msn_serve.embedding.preprocess import PixelBudget
from msn_serve.errors import ApiError, too_large, unprocessable
from msn_serve.masks import request_keep_idx
from msn_serve.metrics import Metrics

log = logging.getLogger("msn_serve")
ImageFile = tuple[str, bytes]  # (what to call it in errors, the encoded file)


@dataclass(frozen=True)
class Inputs:
    """What a request embeds or carries: encoded images with the patches each keeps, or ready vectors."""

    images: list[ImageFile] = field(default_factory=list)
    keep_idx: list[np.ndarray] | None = None  # one row per image; None where no image is to be embedded
    vectors: np.ndarray | None = None  # (n, d) float32, sent instead of images
    # The request's mask specification when keep_idx is None: resolved on the grid of the model that embeds them
    # (with several models served, that model is known only once the store a request names is looked up).
    mask: Any = None

    @property
    def count(self) -> int:
        return len(self.vectors) if self.vectors is not None else len(self.images)


class EmbeddingService:
    """The bundle's encoder behind one batcher; the batcher exists from :meth:`start` (on the event loop) on."""

    def __init__(self, settings: Settings, info: BundleInfo, engine: InferenceEngine, metrics: Metrics):
        self.settings, self.info, self.engine, self.metrics = settings, info, engine, metrics
        self.batcher: Batcher | None = None
        self.warmed = False
        self.warmup_error: str | None = None
        threads = settings.preprocess_threads or (available_cpus() if engine.device != "cpu" else 2)
        self._pre_pool = DecodePool(workers=settings.preprocess_workers, threads=threads)

    def start(self) -> None:
        s = self.settings
        self.batcher = Batcher(self.engine, self.metrics, max_batch_size=s.max_batch_size,
                               max_wait_ms=s.max_wait_ms, queue_size=s.queue_size)
        self.batcher.start()

    async def warm_up(self, pool: ThreadPoolExecutor) -> None:
        """Run every (batch, tokens) bucket once in ``pool``; a failure is kept for ``/readyz`` to report."""
        t0 = time.perf_counter()
        try:
            n = await asyncio.get_running_loop().run_in_executor(pool, self.batcher.warmup)
        except Exception as e:
            log.exception("warm-up failed")
            self.warmup_error = repr(e)
            return
        self.warmed = True
        self.metrics.ready.set(1)
        log.info("warm-up done: %d (batch, tokens) buckets in %.2fs; ready", n, time.perf_counter() - t0)

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        self._pre_pool.shutdown()

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = warmed up and the worker can run inference; after failures, probe with a real forward."""
        detail: dict[str, Any] = {"warmed_up": self.warmed, "model_id": self.info.model_id,
                                  "precision": self.engine.precision, "device": self.engine.device,
                                  "runtime": self.engine.runtime}
        if self.warmup_error:
            detail["error"] = f"warm-up failed: {self.warmup_error}"
            return False, detail
        if not self.warmed or self.batcher is None:
            return False, detail
        if not self.batcher.healthy:
            try:  # TEI-style: an unhealthy worker must prove itself with a real inference
                probe = np.zeros((self.info.in_chans, self.info.image_size, self.info.image_size), np.float32)
                await asyncio.wait_for(self.batcher.embed([(probe, np.arange(1, dtype=np.int64))]), 10)
            except Exception as e:  # noqa: BLE001
                detail["error"] = f"inference is failing: {self.batcher.last_error or e!r}"
                self.metrics.ready.set(0)
                return False, detail
        self.metrics.ready.set(1)
        detail["queue_depth"] = self.batcher.queue_depth
        return True, detail

    async def preprocess(self, images: list[ImageFile]) -> list[np.ndarray]:
        """Decode and transform images in the pre-processing pool, within one request's pixel budget."""
        pre, limit = self.info.preprocessing, self.settings.max_image_pixels
        budget = PixelBudget(self.settings.max_request_pixels)
        tasks = [self._pre_pool.run(d, pre, max_pixels=limit, what=w, budget=budget) for w, d in images]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, ApiError):
                self.metrics.errors.labels("bad_image").inc()
                raise r
            if isinstance(r, BaseException):
                self.metrics.errors.labels("preprocess").inc()
                raise unprocessable(f"could not preprocess image: {r!r}")
        return results  # type: ignore[return-value]

    async def embed_images(self, images: list[ImageFile], keep_idx: list[np.ndarray] | None, *,
                           normalize: bool = False) -> np.ndarray:
        """Embeddings (n, D) of encoded images, each embedded with its ``keep_idx`` row."""
        if not images:
            raise unprocessable("no image: send files as 'image'/'images' (multipart) or base64 in JSON")
        if keep_idx is None or len(keep_idx) != len(images):
            raise ValueError("embed_images needs one keep_idx row per image")  # a caller's bug, not a client's
        pixels = await self.preprocess(images)
        emb = await self.embed_items(list(zip(pixels, keep_idx, strict=True)), status=422)
        if normalize:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb

    async def embed_items(self, items: list[tuple[np.ndarray, np.ndarray]], *, status: int = 400) -> np.ndarray:
        """Embed preprocessed ``(pixels, keep_idx)`` items through the shared batches (``/embed`` and OIP);
        ``status`` is the answer to non-finite embeddings (the client's input was out of range)."""
        self.check_count(len(items))
        if self.batcher is None:
            raise ApiError(503, "service is starting", headers={"Retry-After": "1"})
        emb = await self.batcher.embed(items)
        if not np.isfinite(emb).all():  # e.g. OIP pixel values far outside the normalised range
            raise ApiError(status, "the input produced non-finite embeddings (values far outside the model's "
                                   "normalised input range?)")
        return emb

    def check_count(self, n: int) -> None:
        if n > self.settings.max_images_per_request:
            raise too_large(f"{n} images exceed the limit of {self.settings.max_images_per_request} per request "
                            "(max_images_per_request)")

    async def vectors(self, inputs: Inputs, sent_as: str, dim: int) -> np.ndarray:
        """The vectors sent (as ``sent_as``), or else the embeddings of the images (never both).

        Either way of dimension ``dim``.
        """
        given = inputs.vectors
        if given is not None and inputs.images:
            raise unprocessable(f"send either images or {sent_as}, not both")
        if given is not None:
            if given.shape[1] != dim:
                raise unprocessable(f"{sent_as}: expected vectors of dimension {dim}, got {given.shape[1]}")
            return given
        if dim != self.info.embed_dim:
            raise unprocessable(f"expected vectors of dimension {dim}; the model embeds images to "
                                f"{self.info.embed_dim}: send {sent_as}")
        keep_idx = inputs.keep_idx
        if keep_idx is None and inputs.images:
            keep_idx = request_keep_idx(inputs.mask, len(inputs.images), self.info.grid)
        return await self.embed_images(inputs.images, keep_idx)
