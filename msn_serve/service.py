"""The process-wide service object: bundle, engine, batcher, stores, metrics and readiness.

Route modules stay thin: they read a request into its model (:mod:`msn_serve.http.schemas`, where types and the
request-size limits live) and call the methods here, which own the policies (where preprocessing runs, how masks
map to tokens, what a fit or an add checks, when an index is created on the fly, how large a result may be, when the
service counts as ready).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import ONNX_FILE, BundleInfo, load_bundle_info
from msn_core.masks import MaskError, resolve_masks

from msn_serve.classifiers import labelling
from msn_serve.embedding.batcher import Batcher
from msn_serve.config import Settings
from msn_serve.embedding.engine import Engine
from msn_serve.errors import ApiError, check_name, conflict, read_only_replica, too_large, unprocessable
from msn_serve.classifiers.fewshot import ClassifierStore, FewShotClassifier, check_fit_data, from_fit
from msn_serve.classifiers.fitpool import FitPool
from msn_serve.indexes.store import IndexStore
from msn_serve.http.label_schemas import PredictIndexRequest, SelectRequest, SuggestRequest
from msn_serve.metrics import Metrics
from msn_serve.embedding.preprocess import PixelBudget, preprocess_bytes
from msn_serve.publish import current_version, load_version, publish, state_signature
from msn_serve.http.responses import check_results, predictions_body, search_body
from msn_serve.http.schemas import (
    EmbedRequest,
    FitRequest,
    IndexAddRequest,
    IndexDeleteRequest,
    PredictRequest,
    RequestModel,
    SearchRequest,
)
from msn_serve.indexes.storage import clean_temp_files, lock_data_dir

log = logging.getLogger("msn_serve")


class Service:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.info: BundleInfo = load_bundle_info(settings.bundle, need=(ONNX_FILE,))
        self.api_key = settings.resolved_api_key()
        self.read_only = settings.reader
        self.snapshot_version: str | None = None  # reader: the published version it serves
        if self.read_only:  # never writes to the (possibly read-only) data volume, takes no lock: N readers share it
            if not settings.data_dir.is_dir():
                raise OSError(f"read-only replica: data directory {settings.data_dir} does not exist")
            cache_dir = Path(tempfile.gettempdir()) / "msn-serve-cache"
        else:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = lock_data_dir(settings.data_dir)
            cache_dir = settings.data_dir / "cache"
        self.engine = Engine(self.info, device=settings.device, intra_op_threads=settings.intra_op_threads,
                             fp16=settings.fp16, cache_dir=cache_dir, precision=settings.precision)
        self.metrics.model_info.labels(self.info.model_id, self.engine.precision, self.engine.device).set(1)
        self.batcher: Batcher | None = None
        self.quarantined: list[str] = []
        if self.read_only:
            # empty until the first published version loads (a reader never reads the writer's working files)
            self.classifiers = ClassifierStore(settings.data_dir, self.info.model_id, read_only=True)
            self.indexes = IndexStore(settings.data_dir, default_dim=self.info.embed_dim, model_id=self.info.model_id,
                                      read_only=True, device=settings.device)
            try:
                self._reload_sync()
            except Exception as e:  # faiss/JSON errors come in many types; the CLI reports ValueError cleanly
                raise ValueError(f"cannot load the published snapshot: {e}") from e
        else:
            clean_temp_files(settings.data_dir)
            self.classifiers = ClassifierStore(settings.data_dir, self.info.model_id)
            self.indexes = IndexStore(settings.data_dir, default_dim=self.info.embed_dim,
                                      model_id=self.info.model_id, compact_mb=settings.wal_compact_mb,
                                      metadata_mb=settings.max_index_metadata_mb, device=settings.device)
            self.quarantined = self.classifiers.load_all() + self.indexes.load_all()
        self._published_signature: tuple | None = None
        self._admin_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
        # Decoding/resizing is CPU work that releases the GIL in Pillow; a small pool keeps it off the loop
        # without oversubscribing the cores ONNX Runtime uses.
        self.pre_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msn-pre")
        self.work_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msn-work")
        self.fits = FitPool(workers=settings.fit_workers, max_queued=settings.max_queued_fits,
                            timeout_s=settings.fit_timeout_s, threads=settings.fit_threads,
                            on_change=self.metrics.fits.set)
        self.predictions = labelling.PredictionCache()
        self.warmed = False
        self.warmup_error: str | None = None
        self.started = time.time()

    async def start(self) -> None:
        s = self.settings
        self.batcher = Batcher(self.engine, self.metrics, max_batch_size=s.max_batch_size,
                               max_wait_ms=s.max_wait_ms, queue_size=s.queue_size)
        self.batcher.start()
        loop = asyncio.get_running_loop()
        loop.create_task(self._warmup(), name="msn-warmup")
        self._admin_lock = asyncio.Lock()
        # SIGHUP = reload on a reader; on the writer it is logged and ignored (its default action would kill it).
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self._on_sighup()))
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (in-process test clients)
            log.info("SIGHUP handler not installed (event loop not in the main thread)")
        period = s.reload_poll_s if self.read_only else s.publish_interval_s
        if period > 0:
            self._spawn(self._periodic(period))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- replica consistency: the writer publishes, readers reload -------------------------------------------
    def require_writer(self) -> None:
        if self.read_only:
            raise read_only_replica()

    async def publish(self) -> dict[str, Any]:
        """Writer: publish every index and classifier as a new version (see msn_serve.publish)."""
        if self.read_only:
            raise conflict("read-only replicas do not publish; POST /admin/snapshot on the writer")
        async with self._admin_lock:
            signature = state_signature(self.indexes, self.classifiers)
            manifest = await self.run_work(lambda: publish(
                self.settings.data_dir, self.indexes, self.classifiers, model_id=self.info.model_id,
                keep=self.settings.publish_keep))
            self._published_signature = signature
            return manifest

    async def reload(self) -> dict[str, Any]:
        """Reader: switch to the newest published version; requests in flight finish on the old objects."""
        if not self.read_only:
            raise conflict("the writer serves its live state; POST /admin/reload is for read-only replicas")
        async with self._admin_lock:
            try:
                return await self.run_work(self._reload_sync)
            except Exception as e:
                log.exception("reload failed; still serving version %s", self.snapshot_version)
                raise ApiError(500, f"reload failed, still serving version {self.snapshot_version}: {e}") from e

    def _reload_sync(self) -> dict[str, Any]:
        version, previous = current_version(self.settings.data_dir), self.snapshot_version
        if version is None or version == previous:
            if version is None:
                log.warning("no published snapshot under %s/published yet: serving no indexes or classifiers",
                            self.settings.data_dir)
            return {"changed": False, "version": previous}
        t0 = time.perf_counter()
        indexes, classifiers, _ = load_version(self.settings.data_dir, version, model_id=self.info.model_id,
                                               device=self.settings.device,
                                               default_dim=self.info.embed_dim)
        # Two reference swaps; a request that already looked up an index or classifier keeps using that object.
        self.indexes, self.classifiers, self.snapshot_version = indexes, classifiers, version
        seconds = round(time.perf_counter() - t0, 3)
        log.info("serving published version %s (was %s): %d indexes, %d classifiers, loaded in %.3fs", version,
                 previous, len(indexes.indexes), len(classifiers.items), seconds)
        return {"changed": True, "version": version, "previous": previous, "indexes": sorted(indexes.indexes),
                "classifiers": sorted(classifiers.items), "seconds": seconds}

    async def _on_sighup(self) -> None:
        if not self.read_only:
            log.warning("SIGHUP ignored: the writer has nothing to reload (POST /admin/snapshot publishes)")
            return
        with contextlib.suppress(ApiError):  # a failed reload was logged; the previous version keeps serving
            await self.reload()

    async def _periodic(self, period: float) -> None:
        """Reader: poll ``published/CURRENT``; writer: publish when the state changed since the last publish."""
        while True:
            await asyncio.sleep(period)
            try:
                if self.read_only:
                    if current_version(self.settings.data_dir) != self.snapshot_version:
                        await self.reload()
                elif state_signature(self.indexes, self.classifiers) != self._published_signature:
                    await self.publish()
            except Exception:
                log.exception("periodic %s failed", "reload" if self.read_only else "publish")

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
        for task in list(self._tasks):
            task.cancel()
        if self.batcher is not None:
            await self.batcher.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.indexes.close)
        self.fits.close()
        self.pre_pool.shutdown(wait=False)
        self.work_pool.shutdown(wait=True)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = warmed up and the worker can run inference; after failures, probe with a real forward."""
        detail: dict[str, Any] = {"warmed_up": self.warmed, "model_id": self.info.model_id,
                                  "precision": self.engine.precision, "device": self.engine.device}
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

    # ---- shared request helpers ------------------------------------------------------------------------------
    async def run_work(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.work_pool, fn, *args)

    async def preprocess(self, images: list[tuple[str, bytes]]) -> list[np.ndarray]:
        """Decode and transform a request's images in the pre-processing pool, within its pixel budget."""
        loop = asyncio.get_running_loop()
        pre, limit = self.info.preprocessing, self.settings.max_image_pixels
        budget = PixelBudget(self.settings.max_request_pixels)
        tasks = [loop.run_in_executor(self.pre_pool, lambda d=d, w=w: preprocess_bytes(
            d, pre, max_pixels=limit, what=w, budget=budget)) for w, d in images]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, ApiError):
                self.metrics.errors.labels("bad_image").inc()
                raise r
            if isinstance(r, BaseException):
                self.metrics.errors.labels("preprocess").inc()
                raise unprocessable(f"could not preprocess image: {r!r}")
        return results  # type: ignore[return-value]

    async def embed_images(self, images: list[tuple[str, bytes]], mask: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        """Embed images under a mask specification: ``(embeddings (n, D), keep_idx per image)``."""
        if not images:
            raise unprocessable("no image: send files as 'image'/'images' (multipart) or base64 in JSON")
        try:
            keeps = resolve_masks(mask, len(images), self.info.grid)
        except MaskError as e:
            raise unprocessable(str(e)) from None
        pixels = await self.preprocess(images)
        return await self.embed_items(list(zip(pixels, keeps, strict=True)), status=422), keeps

    async def embed_items(self, items: list[tuple[np.ndarray, np.ndarray]], *, status: int = 400) -> np.ndarray:
        """Embed preprocessed ``(pixels, keep_idx)`` items through the shared batches (``/embed`` and OIP)."""
        self.check_count(len(items))
        if self.batcher is None:
            raise ApiError(503, "service is starting", headers={"Retry-After": "1"})
        emb = await self.batcher.embed(items)
        if not np.isfinite(emb).all():  # e.g. OIP pixel values far outside the normalised range
            raise ApiError(status, "the input produced non-finite embeddings (values far outside the model's "
                                   "normalised input range?)")
        return emb

    async def embed(self, req: EmbedRequest) -> tuple[np.ndarray, list[np.ndarray]]:
        emb, keeps = await self.embed_images(req.images, req.mask)
        if req.normalize:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb, keeps

    def check_count(self, n: int) -> None:
        if n > self.settings.max_images_per_request:
            raise too_large(f"{n} images exceed the limit of {self.settings.max_images_per_request} per request "
                            "(max_images_per_request)")

    async def vectors(self, req: RequestModel, given: np.ndarray | None, field: str, dim: int) -> np.ndarray:
        """The vectors sent in ``field``, or else the embeddings of the request's images (never both)."""
        if given is not None and req.images:
            raise unprocessable(f"send either images or {field}, not both")
        if given is not None:
            if given.shape[1] != dim:
                raise unprocessable(f"{field}: expected vectors of dimension {dim}, got {given.shape[1]}")
            return given
        if dim != self.info.embed_dim:
            raise unprocessable(f"expected vectors of dimension {dim}; the model embeds images to "
                                f"{self.info.embed_dim}: send {field}")
        emb, _ = await self.embed_images(req.images, getattr(req, "mask", None))
        return emb

    @staticmethod
    def _queries(req: RequestModel, given: np.ndarray | None) -> int:
        return len(given) if given is not None else len(req.images)

    # ---- few-shot classifiers and indexes: what a request may do -----------------------------------------------
    async def fit_classifier(self, req: FitRequest) -> FewShotClassifier:
        """Fit (in a worker process) and store a classifier from images or embeddings and their labels
        (``lambd`` defaults to the settings', which default to the low-shot protocol's)."""
        self.require_writer()
        s = self.settings
        self.classifiers.check_free(req.name, overwrite=req.overwrite)  # before the embedding and fitting work
        if req.index is not None:  # the label loop: the stored vectors of ids of an index
            if req.images:
                raise unprocessable("send either index + ids or images, not both")
            if len(req.labels) != len(req.ids):
                raise unprocessable(f"{len(req.labels)} labels for {len(req.ids)} ids")
            x = await self.run_work(labelling.fit_vectors, self.indexes, req.index, req.ids)
        elif len(req.labels) != self._queries(req, req.embeddings):
            raise unprocessable(f"{len(req.labels)} labels for {self._queries(req, req.embeddings)} "
                                "images/embeddings")
        else:
            x = await self.vectors(req, req.embeddings, "embeddings", self.info.embed_dim)
        await self.run_work(lambda: check_fit_data(x, req.labels, max_classes=s.max_fit_classes))
        lambd = req.lambd if req.lambd is not None else s.default_lambd
        model = await self.fits.fit(x, req.labels, lambd=lambd)
        clf = from_fit(req.name, model, req.labels, dim=int(x.shape[1]), lambd=lambd, seconds=model.fit_seconds)
        if req.index is not None:
            clf.info["index"], clf.fit_ids = req.index, req.ids
        await self.run_work(lambda: self.classifiers.put(clf, overwrite=req.overwrite))
        return clf

    async def predict(self, name: str, req: PredictRequest) -> bytes:
        """Top-k labels with probabilities for each image/embedding, as a size-capped JSON body."""
        clf = self.classifiers.get(check_name(name, "classifier name"))
        s = self.settings
        check_results(self._queries(req, req.embeddings), min(req.k, len(clf.classes)), s.max_results_per_request)
        x = await self.vectors(req, req.embeddings, "embeddings", self.info.embed_dim)
        top, prob = await self.run_work(clf.top_k, x, req.k)
        head = {"name": name, "model_id": self.info.model_id}
        return await self.run_work(predictions_body, head, clf.classes, top, prob, s.max_response_bytes)

    # ---- the label loop (msn_serve.classifiers.labelling) ------------------------------------------------------------------
    async def select(self, name: str, req: SelectRequest) -> dict[str, Any]:
        return await self.run_work(labelling.select, self.indexes, name, req, self.settings.select_candidates)

    async def suggest(self, name: str, req: SuggestRequest) -> dict[str, Any]:
        clf = self.classifiers.get(check_name(name, "classifier name"))
        return await self.run_work(labelling.suggest, self.indexes, clf, req, self.settings.select_candidates)

    async def predict_index(self, name: str, req: PredictIndexRequest) -> bytes:
        clf, s = self.classifiers.get(check_name(name, "classifier name")), self.settings
        return await self.run_work(lambda: labelling.predict_index(
            self.indexes, clf, req, self.predictions, max_page=s.max_page, max_results=s.max_results_per_request,
            max_bytes=s.max_response_bytes))

    async def add_to_index(self, name: str, req: IndexAddRequest) -> dict[str, Any]:
        """Add (or replace) vectors or embedded images under ids; a missing index is created with the defaults."""
        self.require_writer()
        check_name(name, "index name")
        idx = self.indexes.find(name)
        vecs = await self.vectors(req, req.vectors, "vectors", idx.cfg.dim if idx is not None else self.info.embed_dim)
        if idx is None:
            idx = await self.run_work(lambda: self.indexes.create(name, {"dim": vecs.shape[1]}, exist_ok=True))
        out = await self.run_work(idx.add, req.ids, vecs, req.metadata)
        return {"name": name, **out, "ntotal": idx.ntotal}

    async def search_index(self, name: str, req: SearchRequest) -> bytes:
        """k nearest neighbours of each query, as a size-capped JSON body; k is capped at the index size."""
        idx = self.indexes.get(check_name(name, "index name"))
        s = self.settings
        queries = self._queries(req, req.vectors)
        if queries > s.max_queries_per_search:
            raise too_large(f"{queries} query images exceed the limit of {s.max_queries_per_search} "
                            "(max_queries_per_search)")
        k = min(req.k, idx.ntotal)
        check_results(queries, k, s.max_results_per_request)
        vecs = await self.vectors(req, req.vectors, "vectors", idx.cfg.dim)
        scores, ids, texts = await self.run_work(idx.query, vecs, k, req.nprobe, req.ef_search)
        head = {"name": name, "metric": idx.cfg.metric, "k": req.k}
        return await self.run_work(search_body, head, scores, ids, texts, s.max_response_bytes)

    async def remove_from_index(self, name: str, req: IndexDeleteRequest) -> dict[str, Any]:
        self.require_writer()
        idx = self.indexes.get(check_name(name, "index name"))
        out = await self.run_work(idx.remove, req.ids)
        return {"name": name, **out, "ntotal": idx.ntotal}
