"""The models one process serves: each a bundle with its own engine, batcher, readiness and metrics, by name.

Several models share one process (one data directory, one work pool, one set of stores) but nothing on their hot
path: each has the runtime measured for it (:func:`~msn_serve.embedding.choice.choose_engine`), its own
:class:`~msn_serve.embedding.service.EmbeddingService` (batcher and decoding threads) and its own series in
``/metrics``. Requests reach a model through :meth:`ServedModel.use`, which counts them, so a model that is replaced or
removed while serving stops only once the requests that already hold it are done: :meth:`ModelRegistry.put` loads,
gates and warms the new model before it takes traffic, swaps it in with one dictionary assignment on the event loop
(no request can see half of it), and retires the old one in the background.

Stores are bound to a model id, not a name (:mod:`msn_serve.errors`): the registry keeps :attr:`ModelRegistry.served`,
the ids of all models served, current for the stores to check against, and finds the model that embeds for a store
with :meth:`ModelRegistry.for_store`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msn_core.bundle import ONNX_FILE, BundleInfo, load_bundle_info
from msn_core.hardware import cpu_info
from msn_serve.config import ModelSpec, Settings
from msn_serve.embedding.choice import Request, RuntimeChoice, choose_engine
from msn_serve.embedding.engine import Engine, InferenceEngine
from msn_serve.embedding.service import EmbeddingService
from msn_serve.errors import ApiError, ModelMismatch, conflict, not_found, unprocessable
from msn_serve.metrics import Metrics, ModelMetrics

log = logging.getLogger("msn_serve")
DRAIN_TIMEOUT_S = 120.0  # a retired model is stopped after this even if a request still holds it
MSN_ALIAS = "msn"  # what OIP and /v1 clients may call the default model (as before several models were served)


@dataclass(eq=False)
class ServedModel:
    """One served model: its bundle, engine choice and embedding service, and the requests holding it now."""

    spec: ModelSpec
    info: BundleInfo
    choice: RuntimeChoice
    embedding: EmbeddingService
    metrics: ModelMetrics
    inflight: int = 0
    retired: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @contextlib.contextmanager
    def use(self) -> Iterator[ServedModel]:
        """Hold the model for one request's work (take it right after the lookup, with no ``await`` between)."""
        self.inflight += 1
        try:
            yield self
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def start(self, pool: ThreadPoolExecutor | None, *, wait: bool) -> None:
        """Start the batcher and warm up every (batch, tokens) bucket; in the background unless ``wait``."""
        self.embedding.start()
        warm = self.embedding.warm_up(pool)
        if wait:
            await warm
        else:
            asyncio.get_running_loop().create_task(warm, name=f"msn-warmup-{self.name}")

    async def retire(self) -> None:
        """Stop once no request holds the model (bounded by :data:`DRAIN_TIMEOUT_S`)."""
        self.retired = True
        if self.inflight:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
            except TimeoutError:
                log.warning("model %s: %d request(s) still running after %.0f s; stopping it anyway", self.name,
                            self.inflight, DRAIN_TIMEOUT_S)
        await self.embedding.stop()
        log.info("model %s (%s) stopped", self.name, self.info.model_id)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        ready, detail = await self.embedding.readiness()
        detail["runtime_choice"] = self.choice.describe()
        return ready, detail

    def card(self) -> dict[str, Any]:
        """What ``/info`` and the admin routes say about the model."""
        i, e = self.info, self.embedding.engine
        return {"name": self.name, "model_id": i.model_id, "bundle": str(self.spec.bundle), "source": self.spec.source,
                "dim": i.embed_dim, "image_size": i.image_size, "patch_size": i.patch_size, "grid": i.grid,
                "feature": i.feature, "runtime": e.runtime, "precision": e.precision, "device": e.device}


def build_engine(settings: Settings, info: BundleInfo, cache_dir: Path) -> tuple[InferenceEngine, RuntimeChoice]:
    """CUDA: ONNX Runtime's CUDA provider (its fp16 variant gated inside); CPU: the measured choice."""
    s = settings
    if s.device == "cuda":
        engine = Engine(info, device="cuda", intra_op_threads=s.intra_op_threads, fp16=s.fp16, cache_dir=cache_dir,
                        precision="fp32")
        return engine, RuntimeChoice(engine.runtime, engine.precision, "cuda", cpu_info().describe())
    request = Request(precision=s.precision, runtime=s.runtime, threads=s.intra_op_threads,
                      max_batch_size=s.max_batch_size)
    return choose_engine(info, request, cache_dir=cache_dir)


def load_model(spec: ModelSpec, settings: Settings, metrics: Metrics, cache_dir: Path) -> ServedModel:
    """Read the bundle and build its engine (blocking: the runtime choice may measure candidates)."""
    info = load_bundle_info(spec.bundle, need=(ONNX_FILE,))
    engine, choice = build_engine(settings, info, cache_dir)
    series = metrics.new_model_series()
    series.model_info.labels(info.model_id, engine.precision, engine.device, engine.runtime).set(1)
    for candidate, figures in choice.candidates.items():
        if "images_per_s" in figures:
            series.runtime_candidates.labels(candidate).set(figures["images_per_s"])
    return ServedModel(spec, info, choice, EmbeddingService(settings, info, engine, series), series)


class ModelLookups:
    """How a request names a model, over :attr:`models` (name -> an object with ``name`` and ``info``, in the order
    they were added; the first is the default): the registry's own models here, and the catalog an HTTP worker
    process keeps of them (:mod:`msn_serve.workers.link`), so both answer a name alike."""

    models: dict[str, Any]

    @property
    def default(self) -> Any:
        return next(iter(self.models.values()))

    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str | None) -> Any:
        """The model called ``name`` (the default for None); 404 naming the models served otherwise."""
        if name is None:
            return self.default
        model = self.models.get(name)
        if model is None:
            raise not_found(f"unknown model {str(name)[:80]!r}; this server serves {', '.join(map(repr, self.models))}"
                            " (GET /v1/models)")
        return model

    def resolve(self, alias: str) -> Any:
        """A model by name, by ``msn`` (the default) or by model id (the default first): what OIP and /v1 accept."""
        if alias in self.models:
            return self.models[alias]
        if alias == MSN_ALIAS:
            return self.default
        return self.for_model_id(alias)

    def for_model_id(self, model_id: str) -> Any:
        if self.default.info.model_id == model_id:
            return self.default
        return next((m for m in self.models.values() if m.info.model_id == model_id), None)


class ModelRegistry(ModelLookups):
    """Models by name, in the order they were added; the first is the default (what a request without a model
    uses). Changes run one at a time (:attr:`_changing`) on the event loop."""

    def __init__(self, settings: Settings, metrics: Metrics, cache_dir: Path,
                 on_change: Callable[[], None] = lambda: None):
        self.settings, self.metrics, self.cache_dir = settings, metrics, cache_dir
        self.models: dict[str, ServedModel] = {}
        self.served: list[str] = []  # model ids of the models served, default first (a live list the stores read)
        self.on_change = on_change
        # Asked before a model loaded by put() is started: each may refuse it with an ApiError (the HTTP worker
        # processes refuse one whose input does not fit their shared-memory slots).
        self.admission: list[Callable[[str, BundleInfo], None]] = []
        self._changing = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()

    # ---- lookups (and ModelLookups') -----------------------------------------------------------------------------
    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    def get(self, name: str | None) -> ServedModel:
        return super().get(name)

    def resolve(self, alias: str) -> ServedModel | None:
        return super().resolve(alias)

    def for_model_id(self, model_id: str) -> ServedModel | None:
        return super().for_model_id(model_id)

    def for_store(self, what: str, name: str, stored: str | None) -> ServedModel:
        """The model that embeds for a store made with ``stored`` (the default for a store that recorded none);
        409 when no model served has that id."""
        if not stored:
            return self.default
        model = self.for_model_id(stored)
        if model is None:
            raise ModelMismatch(what, name, stored, self.served)
        return model

    # ---- changes -------------------------------------------------------------------------------------------------
    def install(self, model: ServedModel) -> ServedModel | None:
        """Serve ``model`` under its name from now on (one assignment); the model it replaces, if any."""
        old = self.models.get(model.name)
        self.models[model.name] = model
        self.metrics.publish(model.name, model.metrics)
        self._changed()
        return old

    def _changed(self) -> None:
        self.served[:] = list(dict.fromkeys(m.info.model_id for m in self.models.values()))
        self.on_change()

    async def put(self, spec: ModelSpec, pool: ThreadPoolExecutor | None) -> dict[str, Any]:
        """Add or replace a model: loaded, gated and warmed before it takes traffic; the old one finishes its
        requests and stops. 4xx (the old model still serving) when the bundle cannot be served."""
        async with self._changing:
            t0 = time.perf_counter()
            try:
                model = await asyncio.to_thread(load_model, spec, self.settings, self.metrics, self.cache_dir)
            except (OSError, ValueError) as e:  # a BundleError is a ValueError
                raise unprocessable(f"model {spec.name!r}: cannot load bundle {str(spec.bundle)!r}: {e}") from None
            for admit in self.admission:
                admit(spec.name, model.info)
            await model.start(pool, wait=True)
            ready, detail = await model.readiness()
            if not ready:
                await model.embedding.stop()
                raise unprocessable(f"model {spec.name!r}: bundle {str(spec.bundle)!r} failed its warm-up: "
                                    f"{detail.get('error', 'not ready')}")
            old = self.install(model)
            if old is not None:
                self._retire(old)
            log.info("model %s: %s %s from %s (%s/%s)", spec.name, "replaced" if old else "added",
                     model.info.model_id, spec.bundle, model.choice.runtime, model.choice.precision)
            return {**model.card(), "replaced": old is not None,
                    "previous_model_id": old.info.model_id if old else None, "default": self.default.name,
                    "seconds": round(time.perf_counter() - t0, 3)}

    async def remove(self, name: str) -> dict[str, Any]:
        """Stop serving model ``name`` (409 for the last one); the first remaining model becomes the default."""
        async with self._changing:
            model = self.get(name)
            if len(self.models) == 1:
                raise conflict(f"model {name!r} is the only model served; replace it (PUT /admin/models/{name}) "
                               "instead of removing it")
            del self.models[name]
            self.metrics.withdraw(name)
            self._changed()
            self._retire(model)
            log.info("model %s (%s) removed; default model: %s", name, model.info.model_id, self.default.name)
            return {"removed": name, "model_id": model.info.model_id, "default": self.default.name}

    def _retire(self, model: ServedModel) -> None:
        task = asyncio.get_running_loop().create_task(model.retire(), name=f"msn-retire-{model.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def rescan(self, directory: Path, pool: ThreadPoolExecutor | None) -> dict[str, Any]:
        """SIGHUP with ``--models-dir``: add new subfolders, replace those whose ``msn.json`` changed, remove the
        models that came from a folder now gone. Each failure is logged; the others still apply."""
        from msn_serve.config import models_in

        try:
            found = {s.name: s for s in models_in(directory)}
        except ValueError as e:
            log.error("models directory not re-read: %s", e)
            return {"error": str(e)}
        done: dict[str, Any] = {"added": [], "replaced": [], "removed": [], "failed": {}}
        for name, spec in found.items():
            current = self.models.get(name)
            if current is not None and current.spec.source != "dir":
                continue  # given on the command line or by an admin call: the folder does not override it
            if current is not None and not _folder_changed(current, spec):
                continue
            try:
                await self.put(spec, pool)
                done["replaced" if current else "added"].append(name)
            except ApiError as e:
                log.error("models directory: %s", e.message)
                done["failed"][name] = e.message
        for name in [n for n, m in self.models.items() if m.spec.source == "dir" and n not in found]:
            try:
                await self.remove(name)
                done["removed"].append(name)
            except ApiError as e:
                log.error("models directory: %s", e.message)
                done["failed"][name] = e.message
        log.info("models directory %s re-read: %s", directory, done)
        return done

    async def stop(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for model in list(self.models.values()):
            await model.embedding.stop()

    async def readiness(self, name: str | None = None) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``: one model's (``name``), or all: the default model's detail at the top (as with one
        model), each model's under ``models``; ready when every model is."""
        if name is not None:
            model = self.get(name)
            ready, detail = await model.readiness()
            return ready, {"model": model.name, **detail}
        per: dict[str, Any] = {}
        all_ready, first_error = True, None
        for model in list(self.models.values()):
            ready, detail = await model.readiness()
            per[model.name] = {"ready": ready, **detail}
            all_ready = all_ready and ready
            if not ready and first_error is None:
                first_error = f"model {model.name!r}: {detail.get('error', 'warming up')}"
        top = {k: v for k, v in per[self.default.name].items() if k != "ready"}
        if not all_ready and "error" not in top and first_error is not None and len(per) > 1:
            top["error"] = first_error
        return all_ready, {**top, "model": self.default.name, "models": per}


def _folder_changed(model: ServedModel, spec: ModelSpec) -> bool:
    """Whether the folder ``spec`` names now holds another bundle than the one ``model`` serves."""
    if model.spec.bundle.resolve() != spec.bundle.resolve():
        return True
    try:
        return load_bundle_info(spec.bundle).model_id != model.info.model_id
    except (OSError, ValueError):
        return True  # let put() report why it cannot be loaded
