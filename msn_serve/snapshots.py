"""Replica consistency as the running service sees it: the writer publishes, read-only replicas reload.

The file format and the atomic publish/load are :mod:`msn_serve.publish`'s; this object adds the service's rules: only
the writer publishes and only readers reload (409 otherwise), one admin operation at a time, a periodic publish is
skipped when nothing changed, and a reload swaps the index and classifier stores of the services in two reference
assignments, so requests that already looked up an index or classifier finish on the old objects.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msn_core.bundle import BundleInfo
from msn_serve.classifiers.service import ClassifierService
from msn_serve.errors import ApiError, conflict
from msn_serve.indexes.service import IndexService
from msn_serve.publish import current_version, load_version, publish, state_signature
from msn_serve.work import WorkPool

log = logging.getLogger("msn_serve")


class Snapshots:
    """Publish (writer) and reload (reader) of versioned snapshots under ``<data-dir>/published``."""

    def __init__(self, *, data_dir: Path, model: Callable[[], BundleInfo], device: str, keep: int, read_only: bool,
                 indexes: IndexService, classifiers: ClassifierService, work: WorkPool):
        """``model``: the default model's bundle facts now (a writer's default model can be replaced while it
        serves; a version is published under the id of the default model of the moment)."""
        self.data_dir, self.model, self.device = data_dir, model, device
        self.keep, self.read_only = keep, read_only
        self.indexes, self.classifiers, self.work = indexes, classifiers, work
        self.version: str | None = None  # reader: the published version it serves
        self._published_signature: tuple | None = None
        self._lock = asyncio.Lock()

    def _signature(self) -> tuple:
        return state_signature(self.indexes.store, self.classifiers.store)

    async def publish(self) -> dict[str, Any]:
        """Writer: publish every index and classifier as a new version; its manifest."""
        if self.read_only:
            raise conflict("read-only replicas do not publish; POST /admin/snapshot on the writer")
        async with self._lock:
            signature = self._signature()
            manifest = await self.work.run(lambda: publish(
                self.data_dir, self.indexes.store, self.classifiers.store, model_id=self.model().model_id,
                keep=self.keep))
            self._published_signature = signature
            return manifest

    async def reload(self) -> dict[str, Any]:
        """Reader: switch to the newest published version; requests in flight finish on the old objects."""
        if not self.read_only:
            raise conflict("the writer serves its live state; POST /admin/reload is for read-only replicas")
        async with self._lock:
            try:
                return await self.work.run(self.load_current)
            except Exception as e:
                log.exception("reload failed; still serving version %s", self.version)
                raise ApiError(500, f"reload failed, still serving version {self.version}: {e}") from e

    def load_current(self) -> dict[str, Any]:
        """Load the version ``CURRENT`` names unless it is the one served (blocking; raises when it is corrupt)."""
        version, previous = current_version(self.data_dir), self.version
        if version is None or version == previous:
            if version is None:
                log.warning("no published snapshot under %s/published yet: serving no indexes or classifiers",
                            self.data_dir)
            return {"changed": False, "version": previous}
        t0 = time.perf_counter()
        info = self.model()
        indexes, classifiers, _ = load_version(self.data_dir, version, model_id=info.model_id, device=self.device,
                                               default_dim=info.embed_dim)
        # Two reference swaps; a request that already looked up an index or classifier keeps using that object.
        self.indexes.store, self.classifiers.store, self.version = indexes, classifiers, version
        seconds = round(time.perf_counter() - t0, 3)
        log.info("serving published version %s (was %s): %d indexes, %d classifiers, loaded in %.3fs", version,
                 previous, len(indexes.indexes), len(classifiers.items), seconds)
        return {"changed": True, "version": version, "previous": previous, "indexes": sorted(indexes.indexes),
                "classifiers": sorted(classifiers.items), "seconds": seconds}

    async def status(self) -> dict[str, Any]:
        return {"role": "reader" if self.read_only else "writer", "serving": self.version,
                "current": await self.work.run(current_version, self.data_dir)}

    async def on_sighup(self) -> None:
        if not self.read_only:
            log.warning("SIGHUP ignored: the writer has nothing to reload (POST /admin/snapshot publishes)")
            return
        with contextlib.suppress(ApiError):  # a failed reload was logged; the previous version keeps serving
            await self.reload()

    async def every(self, period: float) -> None:
        """Reader: poll ``published/CURRENT``; writer: publish when the state changed since the last publish."""
        while True:
            await asyncio.sleep(period)
            try:
                if self.read_only:
                    if current_version(self.data_dir) != self.version:
                        await self.reload()
                elif self._signature() != self._published_signature:
                    await self.publish()
            except Exception:
                log.exception("periodic %s failed", "reload" if self.read_only else "publish")
