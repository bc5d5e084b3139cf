"""The running service: builds the three services from the settings and the bundle, and owns their lifecycle.

:class:`Runtime` is what the HTTP edge holds (``app.state.runtime``): start/stop, warm-up, readiness, the SIGHUP and
periodic publish/reload tasks, and the read-only replica rule. It holds no request policy itself; those live in
:class:`~msn_serve.embedding.service.EmbeddingService`, :class:`~msn_serve.classifiers.service.ClassifierService`,
:class:`~msn_serve.indexes.service.IndexService` and :class:`~msn_serve.snapshots.Snapshots`.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from msn_core.bundle import ONNX_FILE, BundleInfo, load_bundle_info
from msn_core.durable import clean_temp_files, lock_data_dir
from msn_core.hardware import cpu_info
from msn_serve.classifiers.fewshot import ClassifierStore
from msn_serve.classifiers.service import ClassifierService
from msn_serve.config import Settings
from msn_serve.embedding.choice import Request, RuntimeChoice, choose_engine
from msn_serve.embedding.engine import Engine, InferenceEngine
from msn_serve.embedding.service import EmbeddingService
from msn_serve.errors import ModelMismatch, read_only_replica
from msn_serve.indexes.service import IndexService
from msn_serve.indexes.store import IndexStore
from msn_serve.metrics import Metrics
from msn_serve.snapshots import Snapshots
from msn_serve.work import WorkPool

log = logging.getLogger("msn_serve")


class Runtime:
    """One process's service: the bundle, the metrics, the three services, snapshots and background tasks.

    A writer locks its data directory and loads (quarantining what cannot be read) its indexes and classifiers; a
    read-only replica never writes to the (possibly read-only) volume and takes no lock, so N readers share it, and
    it serves the newest published snapshot.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.info: BundleInfo = load_bundle_info(settings.bundle, need=(ONNX_FILE,))
        self.api_key = settings.resolved_api_key()
        self.read_only = settings.reader
        if self.read_only:
            if not settings.data_dir.is_dir():
                raise OSError(f"read-only replica: data directory {settings.data_dir} does not exist")
            cache_dir = Path(tempfile.gettempdir()) / "msn-serve-cache"
        else:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = lock_data_dir(settings.data_dir, owner="msn-serve")
            cache_dir = settings.data_dir / "cache"
        engine, self.runtime_choice = self._engine(cache_dir)
        self.metrics.model_info.labels(self.info.model_id, engine.precision, engine.device, engine.runtime).set(1)
        for name, figures in self.runtime_choice.candidates.items():
            if "images_per_s" in figures:
                self.metrics.runtime_candidates.labels(name).set(figures["images_per_s"])
        index_store, classifier_store = self._open_stores()
        self.work = WorkPool()
        self.embedding = EmbeddingService(settings, self.info, engine, self.metrics)
        self.indexes = IndexService(settings, index_store, embedding=self.embedding, work=self.work,
                                    read_only=self.read_only)
        self.classifiers = ClassifierService(settings, classifier_store, embedding=self.embedding,
                                             indexes=self.indexes, work=self.work, metrics=self.metrics,
                                             read_only=self.read_only)
        self.snapshots = Snapshots(data_dir=settings.data_dir, model_id=self.info.model_id,
                                   embed_dim=self.info.embed_dim, device=settings.device, keep=settings.publish_keep,
                                   read_only=self.read_only, indexes=self.indexes, classifiers=self.classifiers,
                                   work=self.work)
        self.quarantined: list[str] = []
        if self.read_only:
            try:
                self.snapshots.load_current()
            except Exception as e:  # faiss/JSON errors come in many types; the CLI reports ValueError cleanly
                raise ValueError(f"cannot load the published snapshot: {e}") from e
        else:
            clean_temp_files(settings.data_dir)
            self.quarantined = classifier_store.load_all() + index_store.load_all()
            for what, found in (("index", index_store.mismatched()), ("classifier", classifier_store.mismatched())):
                for name, stored in found.items():  # kept on disk untouched; every call to it answers 409
                    log.warning("%s", ModelMismatch(what, name, stored, self.info.model_id).message)
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    def _engine(self, cache_dir: Path) -> tuple[InferenceEngine, RuntimeChoice]:
        """CUDA: ONNX Runtime's CUDA provider (its fp16 variant gated inside); CPU: the measured choice."""
        s = self.settings
        if s.device == "cuda":
            engine = Engine(self.info, device="cuda", intra_op_threads=s.intra_op_threads, fp16=s.fp16,
                            cache_dir=cache_dir, precision="fp32")
            how = "cuda" if engine.device == "cuda" else "cuda requested, no CUDA provider: ONNX Runtime on CPU"
            return engine, RuntimeChoice(engine.runtime, engine.precision, how, cpu_info().describe())
        request = Request(precision=s.precision, runtime=s.runtime, threads=s.intra_op_threads,
                          max_batch_size=s.max_batch_size)
        return choose_engine(self.info, request, cache_dir=cache_dir)

    def _open_stores(self) -> tuple[IndexStore, ClassifierStore]:
        """Empty stores: a writer's working files (loaded after the temp-file clean-up); a reader's stay empty until
        the first published version loads (a reader never reads the writer's working files)."""
        s, model_id = self.settings, self.info.model_id
        if self.read_only:
            return (IndexStore(s.data_dir, default_dim=self.info.embed_dim, model_id=model_id, read_only=True,
                               device=s.device),
                    ClassifierStore(s.data_dir, model_id, read_only=True))
        return (IndexStore(s.data_dir, default_dim=self.info.embed_dim, model_id=model_id,
                           compact_mb=s.wal_compact_mb, metadata_mb=s.max_index_metadata_mb, device=s.device),
                ClassifierStore(s.data_dir, model_id))

    @property
    def role(self) -> str:
        return "reader" if self.read_only else "writer"

    def require_writer(self) -> None:
        """403 on a read-only replica (checked before a write's body is read)."""
        if self.read_only:
            raise read_only_replica()

    async def start(self) -> None:
        self.embedding.start()
        loop = asyncio.get_running_loop()
        loop.create_task(self.embedding.warm_up(self.work.executor), name="msn-warmup")
        # SIGHUP = reload on a reader; on the writer it is logged and ignored (its default action would kill it).
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.snapshots.on_sighup()))
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (in-process test clients)
            log.info("SIGHUP handler not installed (event loop not in the main thread)")
        period = self.settings.reload_poll_s if self.read_only else self.settings.publish_interval_s
        if period > 0:
            self._spawn(self.snapshots.every(period))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.embedding.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.indexes.store.close)
        self.classifiers.close()
        self.work.shutdown(wait=True)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)`` for ``/readyz`` and the OIP health routes."""
        ready, detail = await self.embedding.readiness()
        detail["runtime_choice"] = self.runtime_choice.describe()
        return ready, detail
