"""The running service: builds the services from the settings and the models, and owns their lifecycle.

:class:`Runtime` is what the HTTP edge holds (``app.state.runtime``): start/stop, warm-up, readiness, the SIGHUP and
periodic publish/reload tasks, and the read-only replica rule. It is the process-level part (settings, the data
directory's lock, the work pool, the index and classifier stores, snapshots); the per-model part (bundle, engine,
runtime choice, batcher) lives in :mod:`msn_serve.embedding.models`, one
:class:`~msn_serve.embedding.models.ServedModel` per name in :attr:`Runtime.models`. It holds no request policy
itself; those live in :class:`~msn_serve.embedding.service.EmbeddingService`,
:class:`~msn_serve.classifiers.service.ClassifierService`, :class:`~msn_serve.indexes.service.IndexService` and
:class:`~msn_serve.snapshots.Snapshots`.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from msn_core.bundle import BundleInfo
from msn_core.durable import clean_temp_files, lock_data_dir
from msn_serve.classifiers.fewshot import ClassifierStore
from msn_serve.classifiers.service import ClassifierService
from msn_serve.config import ModelSpec, Settings, check_model_name
from msn_serve.device import resolve_device
from msn_serve.embedding.choice import RuntimeChoice
from msn_serve.embedding.models import ModelRegistry, load_model
from msn_serve.embedding.service import EmbeddingService
from msn_serve.errors import ModelMismatch, read_only_replica, unprocessable
from msn_serve.indexes.service import IndexService
from msn_serve.indexes.store import IndexStore
from msn_serve.metrics import Metrics
from msn_serve.snapshots import Snapshots
from msn_serve.work import WorkPool

log = logging.getLogger("msn_serve")


class Runtime:
    """One process's service: the models, the metrics, the services, snapshots and background tasks.

    A writer locks its data directory and loads (quarantining what cannot be read) its indexes and classifiers; a
    read-only replica never writes to the (possibly read-only) volume and takes no lock, so N readers share it, and
    it serves the newest published snapshot with one model (the published manifest names one model).
    """

    def __init__(self, settings: Settings):
        # --device auto becomes cpu or cuda here, once, before anything is loaded; cuda that cannot work is refused
        # (DeviceUnavailable, a ValueError) rather than served on the CPU.
        self.device = resolve_device(settings.device, precision=settings.precision, runtime=settings.runtime)
        if self.device.requested == "auto":
            log.info("--device auto: %s (%s)", self.device.device, self.device.reason)
        settings = settings.model_copy(update={"device": self.device.device})
        self.settings = settings
        self.metrics = Metrics()
        specs = settings.model_specs()
        self.api_key = settings.resolved_api_key()
        self.read_only = settings.reader
        if self.read_only:
            if len(specs) > 1 or settings.models_dir is not None:
                raise ValueError("a read-only replica serves one model (the one its writer publishes with); "
                                 "give one --bundle and no --models-dir")
            if not settings.data_dir.is_dir():
                raise OSError(f"read-only replica: data directory {settings.data_dir} does not exist")
            cache_dir = Path(tempfile.gettempdir()) / "msn-serve-cache"
        else:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = lock_data_dir(settings.data_dir, owner="msn-serve")
            cache_dir = settings.data_dir / "cache"
        self.model_listeners: list[Callable[[], None]] = []  # told after every model change (the HTTP processes)
        # What /readyz says of the HTTP front end (msn_serve.workers sets it when HTTP worker processes serve).
        self.front_end: Callable[[], dict[str, Any]] = lambda: {"http_workers": 0}
        self.models = ModelRegistry(settings, self.metrics, cache_dir, on_change=self._models_changed)
        for spec in specs:  # one at a time: each may measure its runtime candidates
            self.models.install(load_model(spec, settings, self.metrics, cache_dir))
        index_store, classifier_store = self._open_stores()
        self.work = WorkPool()
        self.indexes = IndexService(settings, index_store, models=self.models, work=self.work,
                                    read_only=self.read_only)
        self.classifiers = ClassifierService(settings, classifier_store, models=self.models, indexes=self.indexes,
                                             work=self.work, metrics=self.metrics, read_only=self.read_only)
        self._bind_stores()
        self.snapshots = Snapshots(data_dir=settings.data_dir, model=lambda: self.info, device=settings.device,
                                   keep=settings.publish_keep, read_only=self.read_only, indexes=self.indexes,
                                   classifiers=self.classifiers, work=self.work)
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
                    log.warning("%s", ModelMismatch(what, name, stored, self.models.served).message)
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    # ---- the default model (what a request naming none uses; the one model of a one-bundle server) -------------
    @property
    def info(self) -> BundleInfo:
        return self.models.default.info

    @property
    def embedding(self) -> EmbeddingService:
        return self.models.default.embedding

    @property
    def runtime_choice(self) -> RuntimeChoice:
        return self.models.default.choice

    def _open_stores(self) -> tuple[IndexStore, ClassifierStore]:
        """Empty stores: a writer's working files (loaded after the temp-file clean-up); a reader's stay empty until
        the first published version loads (a reader never reads the writer's working files)."""
        s, model_id, dim = self.settings, self.info.model_id, self.info.embed_dim
        if self.read_only:
            return (IndexStore(s.data_dir, default_dim=dim, model_id=model_id, read_only=True, device=s.device),
                    ClassifierStore(s.data_dir, model_id, read_only=True))
        return (IndexStore(s.data_dir, default_dim=dim, model_id=model_id, compact_mb=s.wal_compact_mb,
                           metadata_mb=s.max_index_metadata_mb, device=s.device, backend=s.index_backend,
                           milvus_uri=s.milvus_uri),
                ClassifierStore(s.data_dir, model_id))

    def _models_changed(self) -> None:
        self._bind_stores()
        for listener in self.model_listeners:
            listener()

    def _bind_stores(self) -> None:
        """Point the stores at the models served now: the ids they accept, and the default for new stores."""
        if not hasattr(self, "classifiers"):
            return  # still starting: the stores are bound once they exist
        default = self.models.default.info
        for store in (self.indexes.store, self.classifiers.store):
            store.served, store.model_id = self.models.served, default.model_id
        self.indexes.store.default_dim = default.embed_dim

    @property
    def role(self) -> str:
        return "reader" if self.read_only else "writer"

    def require_writer(self) -> None:
        """403 on a read-only replica (checked before a write's body is read)."""
        if self.read_only:
            raise read_only_replica()

    async def start(self) -> None:
        for model in self.models.models.values():
            await model.start(self.work.executor, wait=False)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.on_sighup()))
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (in-process test clients)
            log.info("SIGHUP handler not installed (event loop not in the main thread)")
        period = self.settings.reload_poll_s if self.read_only else self.settings.publish_interval_s
        if period > 0:
            self._spawn(self.snapshots.every(period))

    async def on_sighup(self) -> None:
        """A reader reloads the published snapshot; a writer re-reads ``--models-dir`` when it has one."""
        if not self.read_only and self.settings.models_dir is not None:
            await self.models.rescan(self.settings.models_dir, None)
            return
        await self.snapshots.on_sighup()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.models.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.indexes.store.close)
        self.classifiers.close()
        self.work.shutdown(wait=True)

    async def readiness(self, model: str | None = None) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)`` for ``/readyz`` and the OIP health routes: every model, or the one named."""
        ready, detail = await self.models.readiness(model)
        return ready, {**detail, "device_requested": self.device.requested, "device_reason": self.device.reason,
                       "front_end": self.front_end()}

    # ---- model management (PUT/DELETE /admin/models/{name}) ------------------------------------------------------
    async def put_model(self, name: str, bundle: Any) -> dict[str, Any]:
        """Add or replace model ``name`` with the bundle at ``bundle`` (a path on the server)."""
        self.require_writer()
        try:
            check_model_name(name)
        except ValueError as e:
            raise unprocessable(str(e)) from None
        if not isinstance(bundle, str) or not bundle.strip():
            raise unprocessable('send {"bundle": "/path/to/bundle"}: the bundle directory on the server')
        # Warmed on the loop's default threads, not the work pool: searches and store writes keep their two threads.
        return await self.models.put(ModelSpec(name, Path(bundle).expanduser(), "admin"), None)

    async def remove_model(self, name: str) -> dict[str, Any]:
        self.require_writer()
        return await self.models.remove(name)

