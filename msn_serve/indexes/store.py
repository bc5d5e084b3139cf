"""The set of indexes: loading (quarantining what cannot be read), create and drop, on FAISS or Milvus.

A FAISS index (the default) lives under ``<data-dir>/indexes/<name>``
(:class:`~msn_serve.indexes.managed.ManagedIndex`); a Milvus one in a collection
(:class:`~msn_serve.indexes.milvus.MilvusIndex`), created with ``"backend": "milvus"`` or on a server started with
``--index-backend milvus``. Both are :class:`~msn_serve.indexes.base.VectorIndex`: nothing above this module asks which
one it holds. Milvus is connected when it is used: at start-up when ``--milvus-uri`` is given, the default backend is
Milvus or ``<data-dir>/milvus.db`` exists, else at its first create. Create and drop are serialised by one lock; each
index serialises its own writes and searches. The per-index limits (WAL compaction size, metadata bytes) come from the
settings and are handed to every index here.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msn_core.durable import quarantine, recover_dirs
from msn_serve.errors import (
    ApiError,
    check_model,
    conflict,
    model_matches,
    not_found,
    persisting,
    read_only_replica,
    unprocessable,
)
from msn_serve.indexes import gpu as index_gpu
from msn_serve.indexes.base import BACKENDS, VectorIndex
from msn_serve.indexes.config import config_from_spec
from msn_serve.indexes.managed import ManagedIndex

if TYPE_CHECKING:
    from msn_serve.indexes.milvus_conn import MilvusConnection

log = logging.getLogger("msn_serve.indexes")


class IndexStore:
    """All indexes under ``<data-dir>/indexes``; create/drop are serialised by one lock."""

    def __init__(self, data_dir: Path, *, default_dim: int, model_id: str, compact_mb: float = 64.0,
                 metadata_mb: float | None = None, root: Path | None = None, read_only: bool = False,
                 device: str = "cpu", backend: str = "faiss", milvus_uri: str | None = None):
        self.data_dir, self.read_only = data_dir, read_only
        self.backend = backend  # where an index goes when its create names no backend
        self.milvus_uri = milvus_uri or str(data_dir / "milvus.db")  # Milvus Lite in the data directory by default
        self._milvus_given = milvus_uri is not None
        self._milvus: MilvusConnection | None = None
        self.device = index_gpu.resolve_device(device)  # "cpu" with a warning when faiss sees no GPU
        self.root = root or data_dir / "indexes"
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.default_dim, self.model_id = default_dim, model_id
        # Every model id the server runs (a live set the model registry keeps current; this one model otherwise).
        self.served: Collection[str] = (model_id,)
        self.compact_bytes = int(compact_mb * 2**20)
        self.metadata_limit = None if metadata_mb is None else int(metadata_mb * 2**20)
        self._lock = threading.RLock()  # _discover may run inside create or drop
        self.indexes: dict[str, VectorIndex] = {}

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
        if not self.read_only and (self._milvus_given or self.backend == "milvus" or Path(self.milvus_uri).exists()):
            problems += self._load_milvus()
        return problems

    def milvus(self) -> MilvusConnection:
        """The Milvus connection, opened on first use (``MilvusUnavailable``, a ValueError, when it cannot be)."""
        if self._milvus is None:
            from msn_serve.indexes.milvus_conn import MilvusConnection

            self._milvus = MilvusConnection(self.milvus_uri)
        return self._milvus

    def _load_milvus(self) -> list[str]:
        """Open every msn-serve collection; a name also on FAISS keeps the FAISS index (an interrupted
        ``msn-index migrate --to milvus`` left its copy, which the next migrate replaces)."""
        from msn_serve.indexes.milvus import MilvusIndex

        conn, problems = self.milvus(), []
        for name in sorted(conn.collections()):
            if name in self.indexes:
                log.warning("index %s is on FAISS and in %s; serving the FAISS one (an interrupted msn-index "
                            "migrate --to milvus? run it again)", name, conn.describe())
                continue
            try:
                self.indexes[name] = self._configure(MilvusIndex.open(conn, name))
            except Exception as e:  # noqa: BLE001 - one unreadable collection must not stop the others
                log.error("index %s: cannot open its Milvus collection (%r); not served", name, e)
                problems.append(name)
        return problems

    def find(self, name: str) -> VectorIndex | None:
        return self.indexes.get(name) or self._discover(name)

    def get(self, name: str) -> VectorIndex:
        idx = self.find(name)
        if idx is None:
            raise not_found(f"no index named {name!r}")
        return idx

    def _shared_milvus(self) -> MilvusConnection | None:
        """The Milvus server this store shares with other msn-serve processes (None: none, or Milvus Lite, whose
        file only this process opens)."""
        return self._milvus if self._milvus is not None and not self._milvus.lite else None

    def _discover(self, name: str) -> VectorIndex | None:
        """An index another msn-serve created on the shared Milvus server since this one started (None if none)."""
        conn = self._shared_milvus()
        if conn is None or self.read_only:
            return None
        from msn_serve.indexes.milvus import MilvusIndex
        from msn_serve.indexes.milvus_conn import collection_name, milvus_errors

        with self._lock:
            if name in self.indexes:
                return self.indexes[name]
            with milvus_errors(f"look up index {name!r}"):
                if not conn.client.has_collection(collection_name(name)):
                    return None
                idx = self.indexes[name] = self._configure(MilvusIndex.open(conn, name))
            return idx

    def bound(self, name: str) -> VectorIndex:
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
        if (conn := self._shared_milvus()) is not None and not self.read_only:
            for name in sorted(set(conn.collections()) - set(self.indexes)):  # made by another msn-serve
                self._discover(name)
        return [{**idx.stats(), "model_matches": model_matches(idx.cfg.model_id, self.served)}
                for idx in list(self.indexes.values())]

    def create(self, name: str, spec: dict[str, Any], *, exist_ok: bool = False, model_id: str | None = None,
               default_dim: int | None = None, feature: str = "") -> VectorIndex:
        """A new index bound to ``model_id`` (default: the store's model; ``feature``: its bundle's), ``default_dim``
        wide unless ``spec`` says otherwise, on ``spec["backend"]`` (default: the store's)."""
        if self.read_only:
            raise read_only_replica()
        spec = dict(spec)
        backend = spec.pop("backend", self.backend)
        if backend not in BACKENDS:
            raise unprocessable(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        with self._lock:
            if name in self.indexes:
                if exist_ok:
                    return self.indexes[name]
                raise conflict(f"index {name!r} already exists")
            if backend == "milvus":
                return self._create_milvus(name, spec, model_id, default_dim, feature)
            cfg = config_from_spec(spec, default_dim or self.default_dim, model_id or self.model_id)
            with persisting(f"create index {name!r}"):
                idx = self._configure(ManagedIndex.create(self.root / name, cfg, self.device))
            self.indexes[name] = idx
            return idx

    def _create_milvus(self, name: str, spec: dict[str, Any], model_id: str | None, default_dim: int | None,
                       feature: str) -> VectorIndex:
        from msn_serve.indexes.milvus import MilvusIndex
        from msn_serve.indexes.milvus_conn import MilvusUnavailable
        from msn_serve.indexes.milvus_tuning import check_spec

        check_spec(spec)
        cfg = config_from_spec(spec, default_dim or self.default_dim, model_id or self.model_id)
        try:
            conn = self.milvus()
        except MilvusUnavailable as e:
            raise ApiError(503, str(e)) from None
        idx = self._configure(MilvusIndex.create(conn, name, cfg, feature=feature))
        self.indexes[name] = idx
        return idx

    def _configure(self, idx: VectorIndex) -> VectorIndex:
        idx.compact_bytes, idx.metadata_limit = self.compact_bytes, self.metadata_limit
        return idx

    def drop(self, name: str) -> None:
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            idx = self.get(name)
            try:
                with persisting(f"delete index {name!r}"):
                    idx.drop()
            finally:
                if idx.closed:  # gone from its name: dropped, whatever a later fsync said
                    self.indexes.pop(name, None)

    def close(self) -> None:
        foreign = self.mismatched()
        for idx in self.indexes.values():
            try:
                if idx.name in foreign:  # another model's index: left byte for byte
                    with idx.lock:
                        if getattr(idx, "wal", None) is not None:
                            idx.wal.close()
                        idx.closed = True
                    continue
                idx.close()
            except Exception:
                log.exception("closing index %s", idx.name)
        if self._milvus is not None:
            self._milvus.close()
