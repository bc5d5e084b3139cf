"""Named FAISS indexes with external int64 ids and JSON metadata, durable through a WAL and snapshots.

Types: ``flat`` (exact, ``IndexIDMap2(IndexFlat*)``), ``ivf`` (``IndexIVFFlat`` with its native ids, trained on its
first add, which is then snapshotted rather than logged so replay never retrains) and ``hnsw`` (no deletion: FAISS
cannot remove from HNSW). Adding an id that is already there replaces its vector and metadata (so a retried add never
duplicates an id); on ``hnsw`` only a re-add that changes nothing is accepted. A write that fails on disk changes
nothing (see :class:`~msn_serve.indexes.wal.WriteAheadLog`): the client gets a 507/503 and may retry.
``ivfpq`` (``IndexIVFPQ``, native ids; re-ranked, it can neither delete nor replace) comes from ``msn-index build``,
which writes the mmap-able form of :mod:`msn_serve.indexes.files` instead of ``snapshot.npz``; the writer loads either,
and read-only replicas open published copies of that form memory-mapped, without a WAL.

:class:`ManagedIndex` is what the store is: the live index, its ids and metadata, its lock, its mutations and
searches. It owns one collaborator per other concern, each in its own module: how it is kept durable
(:class:`~msn_serve.indexes.durability.Durability`: WAL, snapshots, replay; the files themselves are
:mod:`msn_serve.indexes.persist`'s), how it is tuned (:class:`~msn_serve.indexes.auto.Retuning`, the background
re-tune of ``auto`` indexes as they grow) and where its searches run (:class:`~msn_serve.indexes.gpu.GpuMirror`, the
GPU copy with ``--device cuda``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_serve.errors import conflict, not_found, persisting, too_large, unprocessable
from msn_serve.indexes import persist
from msn_serve.indexes.auto import Retuning, vectors_of
from msn_serve.indexes.base import check_add, check_ids, hit_lists, prepare_vectors, score_meaning
from msn_serve.indexes.config import IndexConfig, build_index, search_params
from msn_serve.indexes.durability import Durability
from msn_serve.indexes.files import IVF_TYPES, read_index_dir, write_index_dir
from msn_serve.indexes.gpu import GpuMirror
from msn_serve.indexes.metadata import Metadata, Texts
from msn_serve.indexes.wal import WriteAheadLog

log = logging.getLogger("msn_serve.indexes")
LOOP_KINDS = ("flat", "ivf", "hnsw")  # kinds that keep raw vectors to give back (the label loop, migration)


class ManagedIndex:
    """One FAISS index (a :class:`~msn_serve.indexes.base.VectorIndex`): all mutations and searches hold ``lock``
    (FAISS mutations are not thread-safe)."""

    backend = "faiss"

    compact_bytes = 64 * 2**20  # the store sets both from the settings
    metadata_limit: int | None = None

    def __init__(self, path: Path, cfg: IndexConfig, index: faiss.Index, metadata: Metadata | dict[int, Any],
                 seq: int, ids: set[int], *, read_only: bool = False, device: str = "cpu"):
        self.path, self.cfg, self.index, self.seq = path, cfg, index, seq
        self.metadata = Metadata.coerce(metadata)
        self.lock = threading.RLock()
        self.ids = ids
        self.closed = False
        self.created = time.time()
        self.wal = None if read_only else WriteAheadLog(path / persist.WAL)
        self.durability = Durability(self)
        self.gpu = GpuMirror(device)  # device: gpu.resolve_device'd
        self.tuning = Retuning(self)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    # ---- opening: created whole, loaded and replayed, or a published copy ---------------------------------------
    @classmethod
    def create(cls, path: Path, cfg: IndexConfig, device: str = "cpu") -> ManagedIndex:
        """A new, empty index, whose directory appears whole or not at all."""
        persist.create(path, cfg)
        return cls(path, cfg, build_index(cfg), Metadata(), 0, set(), device=device)

    @classmethod
    def load(cls, path: Path, data_dir: Path, device: str = "cpu") -> ManagedIndex:
        """Open from disk (:func:`~msn_serve.indexes.persist.load`) and replay the WAL records newer than the
        snapshot; an auto index whose re-tune a crash interrupted starts it again."""
        saved = persist.load(path, data_dir)
        obj = cls(path, saved.cfg, saved.index, saved.metadata, saved.seq, saved.ids, device=device)
        replayed = obj.durability.replay(saved.records)
        log.info("index %s: %d vectors (%d WAL records replayed)", path.name, obj.index.ntotal, replayed)
        with obj.lock:
            obj.tuning.maybe_start()  # e.g. a crash interrupted a re-tune
        return obj

    @classmethod
    def open_read_only(cls, path: Path, device: str = "cpu") -> ManagedIndex:
        """A published index, memory-mapped where FAISS allows, with no WAL: any failure raises."""
        config, index, ids, metadata, seq = read_index_dir(path, mmap=True)
        return cls(path, IndexConfig(**config), index, metadata, seq, set(ids.tolist()), read_only=True,
                   device=device)

    # ---- mutations (made durable by self.durability before they return) -----------------------------------------
    def _apply(self, op: str, ids: np.ndarray, vecs: np.ndarray | None, texts: Texts | None) -> None:
        """Change the in-memory state only: the live write, a WAL replay and the first IVF add all come here."""
        self.tuning.note(op, ids, vecs)  # a re-tune running meanwhile replays it onto its result
        if op == "add":  # an upsert: ids already present are replaced (add() filtered them out where FAISS can't)
            present = [i for i in ids.tolist() if i in self.ids]
            self.gpu.follow("replace" if present else op, self.index, ids, vecs)
            if present:
                self.index.remove_ids(np.asarray(present, dtype=np.int64))
            self.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
            self.ids.update(ids.tolist())
            for j, i in enumerate(ids.tolist()):
                self.metadata.put(i, None if texts is None else texts[j])
        elif op == "remove":
            self.gpu.follow(op, self.index, ids, vecs)
            self.index.remove_ids(ids)
            for i in ids.tolist():
                self.ids.discard(i)
                self.metadata.drop(i)
        else:  # pragma: no cover - only our own writer produces records
            raise ValueError(f"unknown WAL op {op!r}")

    def add(self, ids: Any, vecs: np.ndarray, metadata: list | None = None) -> dict[str, int]:
        """Add (or replace) vectors under ``ids``; durable (WAL fsync'd or snapshot written) before it returns."""
        arr, v, texts = check_add(self.cfg, ids, vecs, metadata)
        with self.lock, persisting(f"add to index {self.path.name!r}"):
            self.durability.check_writable()
            self._check_open()
            present = [j for j, i in enumerate(arr.tolist()) if i in self.ids]
            if present and not self.cfg.replaceable:
                arr, v, texts = _unchanged_dropped(self, present, arr, v, texts)
                present = []  # what is left is new
            if self.metadata_limit is not None and \
                    self.metadata.size_after(arr.tolist(), texts) > self.metadata_limit:
                raise too_large(f"index {self.path.name!r} would hold more than {self.metadata_limit} bytes of "
                                "metadata (max_index_metadata_mb)")
            if self.cfg.type in IVF_TYPES and not self.index.is_trained:
                if arr.size < self.cfg.nlist:
                    raise unprocessable(f"an ivf index trains on its first add: send at least nlist={self.cfg.nlist} "
                                        f"vectors (got {arr.size}) or create it with a smaller nlist")
                self.index.train(v)
                self.durability.commit_trained(arr, v, texts)
            elif arr.size:
                self.durability.commit("add", arr, v, texts)
                self.tuning.maybe_start()
        return {"added": int(arr.size) - len(present), "replaced": len(present)}

    def remove(self, ids: Any) -> dict[str, Any]:
        arr = check_ids(ids)
        if not self.cfg.replaceable:
            raise conflict(f"{self.cfg.why_immutable} (FAISS limitation); use a flat, ivf or auto index")
        with self.lock, persisting(f"delete from index {self.path.name!r}"):
            self.durability.check_writable()
            self._check_open()
            present = np.array([i for i in arr.tolist() if i in self.ids], dtype=np.int64)
            missing = sorted(set(arr.tolist()) - set(present.tolist()))
            if present.size:
                self.durability.commit("remove", present, None, None)
        return {"removed": int(present.size), "not_found": missing}

    # ---- queries ----------------------------------------------------------------------------------------------
    def query(self, vecs: np.ndarray, k: int, nprobe: int | None = None,
              ef_search: int | None = None) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """FAISS search: ``(scores (n, k'), ids (n, k'), {hit id: metadata JSON text})`` with ``k' = min(k,
        ntotal)`` (FAISS allocates n x k results, so k beyond the index size would only cost memory)."""
        q = prepare_vectors(self.cfg, vecs)
        with self.lock:
            self._check_open()
            k = min(int(k), int(self.index.ntotal))
            if k == 0:
                return np.zeros((q.shape[0], 0), np.float32), np.zeros((q.shape[0], 0), np.int64), {}
            params = search_params(self.cfg, k, nprobe=nprobe, ef_search=ef_search)
            scores, labels = self.gpu.searcher(self.index, self.cfg).search(q, k, params=params)
            texts = {i: t for i in np.unique(labels).tolist() if i >= 0 and (t := self.metadata.text(i)) is not None}
        return scores, labels, texts

    def search(self, vecs: np.ndarray, k: int, nprobe: int | None = None, ef_search: int | None = None) -> list:
        """:meth:`query` as ``[[{"id", "score", "metadata"?}, ...], ...]`` (for in-process callers)."""
        return hit_lists(*self.query(vecs, k, nprobe, ef_search))

    def stored_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored ``(ids, vectors)``: flat and hnsw through their flat storage, ivf from its inverted lists;
        ivfpq keeps compressed codes only (a 422)."""
        if self.cfg.type not in LOOP_KINDS:
            raise unprocessable(f"index {self.name!r} is {self.cfg.type}: its vectors are compressed codes and "
                                f"cannot be given back, so the label loop works on {', '.join(LOOP_KINDS)} indexes "
                                "only (build one of those for labelling)")
        with self.lock:
            self._check_open()
            return vectors_of(self.index, self.cfg)

    def metadata_texts(self, ids: list[int]) -> dict[int, str | None]:
        with self.lock:
            return {i: self.metadata.text(i) for i in ids}

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"name": self.path.name, "backend": self.backend, **asdict(self.cfg),
                    "ntotal": int(self.index.ntotal),
                    "device": self.gpu.device_for(self.cfg), "auto_tuning": self.tuning.stats(),
                    "trained": bool(self.index.is_trained), "with_metadata": len(self.metadata),
                    "metadata_bytes": self.metadata.nbytes,
                    "wal_bytes": self.wal.size() if self.wal else 0, "seq": self.seq,
                    "score": score_meaning(self.cfg)}

    # ---- whole-index writes and the end of its life --------------------------------------------------------------
    def export(self, dest: Path) -> None:
        """Write the current state in the mmap-able form (for publishing); consistent under ``lock``."""
        with self.lock:
            self._check_open()
            write_index_dir(dest, asdict(self.cfg), self.index, np.fromiter(self.ids, np.int64, len(self.ids)),
                            self.metadata, self.seq)

    def snapshot(self) -> None:
        """Replace ``snapshot.npz`` with the current state and empty the WAL (:meth:`Durability.snapshot`)."""
        self.durability.snapshot()

    def drop(self) -> None:
        """Remove the directory; gone from its name, the index is closed, whatever a later fsync said."""
        with self.lock:
            self.durability.remove()

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.durability.close()
                self.closed = True

    def _check_open(self) -> None:
        """Called under ``lock``: a request that waited while the index was dropped gets a 404, not a crash."""
        if self.closed:
            raise not_found(f"index {self.path.name!r} was deleted")


def _unchanged_dropped(idx: ManagedIndex, present: list[int], arr: np.ndarray, v: np.ndarray,
                       texts: Texts | None) -> tuple[np.ndarray, np.ndarray, Texts | None]:
    """The add without the ids already there. Kinds that cannot remove vectors (hnsw, re-ranked ivfpq, auto with
    deletes=false) only accept an id that is already there re-added unchanged (a retry): anything else is a 409."""
    for j in present:
        i = int(arr[j])
        try:
            stored = idx.index.reconstruct(i)
        except RuntimeError:  # IVF keeps no id -> vector map (an auto index with deletes=false tuned to ivf)
            stored = None
        same = stored is not None and np.array_equal(stored, v[j]) and \
            idx.metadata.text(i) == (None if texts is None else texts[j])
        if not same:
            raise conflict(f"id {i} is already in this index with another vector or metadata, and "
                           f"{idx.cfg.why_immutable} (FAISS limitation): use a flat, ivf or auto index")
    keep = np.setdiff1d(np.arange(arr.size), present)
    return arr[keep], v[keep], None if texts is None else Texts(texts[j] for j in keep.tolist())
