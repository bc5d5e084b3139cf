"""The set of indexes under ``<data-dir>/indexes``: loading (quarantining what cannot be read), create and drop.

Create and drop are serialised by one lock; each index serialises its own writes and searches
(:class:`~msn_serve.indexes.managed.ManagedIndex`). The per-index limits (WAL compaction size, metadata bytes) come from the
settings and are handed to every index here.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any

from msn_core.durable import quarantine, recover_dirs, remove_durably
from msn_serve.errors import check_model, conflict, model_matches, not_found, persisting, read_only_replica
from msn_serve.indexes import gpu as index_gpu
from msn_serve.indexes.config import config_from_spec
from msn_serve.indexes.managed import ManagedIndex

log = logging.getLogger("msn_serve.indexes")


class IndexStore:
    """All indexes under ``<data-dir>/indexes``; create/drop are serialised by one lock."""

    def __init__(self, data_dir: Path, *, default_dim: int, model_id: str, compact_mb: float = 64.0,
                 metadata_mb: float | None = None, root: Path | None = None, read_only: bool = False,
                 device: str = "cpu"):
        self.data_dir, self.read_only = data_dir, read_only
        self.device = index_gpu.resolve_device(device)  # "cpu" with a warning when faiss sees no GPU
        self.root = root or data_dir / "indexes"
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.default_dim, self.model_id = default_dim, model_id
        # Every model id the server runs (a live set the model registry keeps current; this one model otherwise).
        self.served: Collection[str] = (model_id,)
        self.compact_bytes = int(compact_mb * 2**20)
        self.metadata_limit = None if metadata_mb is None else int(metadata_mb * 2**20)
        self._lock = threading.Lock()
        self.indexes: dict[str, ManagedIndex] = {}

    def load_all(self) -> list[str]:
        problems = []
        if not self.read_only:
            recover_dirs(self.root)  # an index whose msn-index swap was killed between its renames is absent
        for p in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not p.is_dir() or p.name.startswith("."):
                continue
            if self.read_only:  # a published snapshot is all or nothing: the caller keeps the previous one
                self.indexes[p.name] = ManagedIndex.open_read_only(p, self.device)
                continue
            try:
                self.indexes[p.name] = self._configure(ManagedIndex.load(p, self.data_dir, self.device))
            except Exception as e:  # noqa: BLE001 - any parse failure means: quarantine, keep serving the rest
                quarantine(self.data_dir, p, f"cannot load index: {e!r}")
                problems.append(p.name)
        return problems

    def find(self, name: str) -> ManagedIndex | None:
        return self.indexes.get(name)

    def get(self, name: str) -> ManagedIndex:
        idx = self.indexes.get(name)
        if idx is None:
            raise not_found(f"no index named {name!r}")
        return idx

    def bound(self, name: str) -> ManagedIndex:
        """The index named ``name`` for a search, a write or the label loop: 404 when there is none, 409
        (:class:`~msn_serve.errors.ModelMismatch`) when another model made it. Stats and drop use :meth:`get`."""
        idx = self.get(name)
        check_model("index", name, idx.cfg.model_id, self.served)
        return idx

    def mismatched(self) -> dict[str, str]:
        """``{name: model_id}`` of the indexes another model made (refused until migrated or dropped)."""
        return {name: idx.cfg.model_id for name, idx in self.indexes.items()
                if not model_matches(idx.cfg.model_id, self.served)}

    def describe(self) -> list[dict[str, Any]]:
        return [{**idx.stats(), "model_matches": model_matches(idx.cfg.model_id, self.served)}
                for idx in list(self.indexes.values())]

    def create(self, name: str, spec: dict[str, Any], *, exist_ok: bool = False, model_id: str | None = None,
               default_dim: int | None = None) -> ManagedIndex:
        """A new index bound to ``model_id`` (default: the store's model), ``default_dim`` wide unless ``spec``
        says otherwise."""
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            if name in self.indexes:
                if exist_ok:
                    return self.indexes[name]
                raise conflict(f"index {name!r} already exists")
            cfg = config_from_spec(spec, default_dim or self.default_dim, model_id or self.model_id)
            with persisting(f"create index {name!r}"):
                idx = self._configure(ManagedIndex.create(self.root / name, cfg, self.device))
            self.indexes[name] = idx
            return idx

    def _configure(self, idx: ManagedIndex) -> ManagedIndex:
        idx.compact_bytes, idx.metadata_limit = self.compact_bytes, self.metadata_limit
        return idx

    def drop(self, name: str) -> None:
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            idx = self.get(name)
            with idx.lock:
                try:
                    with persisting(f"delete index {name!r}"):
                        remove_durably(idx.path)  # renaming the directory away is the commit point
                finally:
                    if not idx.path.exists():  # gone from its name: dropped, whatever a later fsync said
                        idx.wal.close()
                        idx.closed = True
                        self.indexes.pop(name, None)

    def close(self) -> None:
        foreign = self.mismatched()
        for idx in self.indexes.values():
            try:
                if idx.path.name in foreign and idx.wal is not None:  # another model's index: left byte for byte
                    with idx.lock:
                        idx.wal.close()
                        idx.closed = True
                    continue
                idx.close()
            except Exception:
                log.exception("closing index %s", idx.path.name)
