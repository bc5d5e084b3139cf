"""The process-wide service object: bundle, engine, batcher, stores, metrics and readiness.

Route modules stay thin: they parse a request into a :class:`~msn_serve.inputs.Payload` and call the methods here,
which own the policies (where preprocessing runs, how masks map to tokens, when the service counts as ready).
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .batcher import Batcher
from .bundle import BundleInfo, Engine, load_bundle
from .config import Settings
from .errors import ApiError, unprocessable
from .fewshot import ClassifierStore
from .indexes import IndexStore
from .inputs import Payload
from .masks import resolve_masks
from .metrics import Metrics
from .preprocess import preprocess_bytes
from .storage import clean_temp_files, lock_data_dir

log = logging.getLogger("msn_serve")


class Service:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.info: BundleInfo = load_bundle(settings.bundle)
        self.api_key = settings.resolved_api_key()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock = lock_data_dir(settings.data_dir)
        self.engine = Engine(self.info, device=settings.device, intra_op_threads=settings.intra_op_threads,
                             fp16=settings.fp16, cache_dir=settings.data_dir / "cache")
        self.batcher: Batcher | None = None
        clean_temp_files(settings.data_dir)
        self.classifiers = ClassifierStore(settings.data_dir, self.info.model_id)
        self.indexes = IndexStore(settings.data_dir, default_dim=self.info.embed_dim, model_id=self.info.model_id,
                                  compact_mb=settings.wal_compact_mb)
        self.quarantined = self.classifiers.load_all() + self.indexes.load_all()
        # Decoding/resizing is CPU work that releases the GIL in Pillow; a small pool keeps it off the loop
        # without oversubscribing the cores ONNX Runtime uses.
        self.pre_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msn-pre")
        self.work_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msn-work")
        self.warmed = False
        self.warmup_error: str | None = None
        self.started = time.time()

    async def start(self) -> None:
        s = self.settings
        self.batcher = Batcher(self.engine, self.metrics, max_batch_size=s.max_batch_size,
                               max_wait_ms=s.max_wait_ms, queue_size=s.queue_size)
        self.batcher.start()
        asyncio.get_running_loop().create_task(self._warmup(), name="msn-warmup")

    async def _warmup(self) -> None:
        t0 = time.perf_counter()
        try:
            n = await asyncio.get_running_loop().run_in_executor(self.work_pool, self.batcher.warmup)
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
        await asyncio.get_running_loop().run_in_executor(None, self.indexes.close)
        self.pre_pool.shutdown(wait=False)
        self.work_pool.shutdown(wait=True)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = warmed up and the worker can run inference; after failures, probe with a real forward."""
        detail: dict[str, Any] = {"warmed_up": self.warmed, "model_id": self.info.model_id}
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
        detail["queue_depth"] = len(self.batcher._queue)
        return True, detail

    # ---- shared request helpers ------------------------------------------------------------------------------
    async def run_work(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.work_pool, fn, *args)

    async def preprocess(self, images: list[tuple[str, bytes]]) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        pre, limit = self.info.pre, self.settings.max_image_pixels
        tasks = [loop.run_in_executor(self.pre_pool, lambda d=d, w=w: preprocess_bytes(d, pre, max_pixels=limit,
                                                                                           what=w))
                 for w, d in images]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, ApiError):
                self.metrics.errors.labels("bad_image").inc()
                raise r
            if isinstance(r, BaseException):
                self.metrics.errors.labels("preprocess").inc()
                raise unprocessable(f"could not preprocess image: {r!r}")
        return results  # type: ignore[return-value]

    async def embed_payload(self, payload: Payload, *, required: bool = True,
                            normalize: bool = False) -> tuple[np.ndarray | None, list[int]]:
        """Embed the payload's images with its ``mask`` field; ``None`` when it has no images."""
        if not payload.images:
            if required:
                raise unprocessable("no image: send files as 'image'/'images' (multipart) or base64 in JSON")
            return None, []
        if self.batcher is None:
            raise ApiError(503, "service is starting")
        mask_spec = payload.json_field("mask")
        keeps = resolve_masks(mask_spec, len(payload.images), self.info.grid)
        pixels = await self.preprocess(payload.images)
        emb = await self.batcher.embed(list(zip(pixels, keeps, strict=True)))
        if normalize:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb, [int(k.size) for k in keeps]

    def check_count(self, n: int) -> None:
        if n > self.settings.max_images_per_request:
            raise ApiError(413, f"at most {self.settings.max_images_per_request} images/vectors per request")
