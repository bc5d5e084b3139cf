"""Named FAISS indexes with external int64 ids, JSON metadata, and WAL + snapshot persistence.

Layout per index: ``indexes/<name>/config.json`` (fixed at create; an auto index rewrites it when it changes
kind), ``snapshot.npz`` (serialised FAISS index + metadata + last applied WAL sequence + config, replaced
atomically) and ``wal.log`` (add/remove records, fsync'd before a request is acknowledged). Start-up = snapshot +
replay of records newer than it. Types: ``flat`` (exact, ``IndexIDMap2(IndexFlat*)``), ``ivf`` (``IndexIVFFlat``
with its native ids, trained on its first add, which is then snapshotted rather than logged so replay never
retrains) and ``hnsw`` (no deletion: FAISS cannot remove from HNSW).
``ivfpq`` (``IndexIVFPQ``, native ids; re-ranked, it cannot delete) comes from ``msn-index build``, which writes the
mmap-able form of :mod:`msn_serve.index_files` instead of ``snapshot.npz``; the writer loads either, and read-only
replicas open published copies of that form memory-mapped, without a WAL. ``auto`` indexes re-tune themselves as
they grow (:mod:`msn_serve.index_auto`); with ``--device cuda``, kinds FAISS supports on GPUs also get a GPU copy
that answers searches (:mod:`msn_serve.index_gpu`).
"""
from __future__ import annotations

import io
import json
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.durable import atomic_write, fsync_path

from . import index_auto, index_gpu
from .errors import conflict, not_found, read_only_replica, unprocessable
from .index_config import IndexConfig, build_index, config_from_spec, search_params
from .index_files import (
    INDEX_FILE,
    IVF_TYPES,
    STATE_FILE,
    decode_record,
    encode_record,
    read_index_dir,
    write_index_dir,
)
from .storage import WriteAheadLog, quarantine, remove_durably

log = logging.getLogger("msn_serve.indexes")
MAX_ID = 2**63 - 1


class ManagedIndex:
    """One index: all mutations and searches hold ``lock`` (FAISS mutations are not thread-safe)."""

    def __init__(self, path: Path, cfg: IndexConfig, index: faiss.Index, metadata: dict[int, Any], seq: int,
                 ids: set[int], *, read_only: bool = False, device: str = "cpu"):
        self.path, self.cfg, self.index, self.metadata, self.seq = path, cfg, index, metadata, seq
        self.lock = threading.RLock()
        self.ids = ids
        self.closed = False
        self.wal = None if read_only else WriteAheadLog(path / "wal.log")
        self.created = time.time()
        self.device = device  # where searches run when the kind allows it (index_gpu.resolve_device'd)
        self.gpu_index: faiss.Index | None = None  # GPU copy, rebuilt lazily after changes it cannot follow
        self.retuning = False  # auto: a background re-tune is running
        self._pending: list[tuple] | None = None  # mutations applied while it runs, replayed on its result
        self.last_tuning: dict[str, Any] | None = None

    # ---- persistence ------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, cfg: IndexConfig, device: str = "cpu") -> ManagedIndex:
        path.mkdir(parents=True, exist_ok=False)
        atomic_write(path / "config.json", json.dumps(asdict(cfg), indent=1).encode())
        obj = cls(path, cfg, build_index(cfg), {}, 0, set(), device=device)  # creates wal.log
        fsync_path(path)
        fsync_path(path.parent)  # the new index directory itself must survive a crash
        return obj

    @classmethod
    def load(cls, path: Path, data_dir: Path, device: str = "cpu") -> ManagedIndex:
        """Open from disk; a corrupt config/snapshot raises, a corrupt WAL record is quarantined and the valid
        prefix replayed (a torn tail is an unacknowledged write and is dropped)."""
        cfg = IndexConfig(**json.loads((path / "config.json").read_text()))
        snap = path / "snapshot.npz"
        index, metadata, seq, ids = build_index(cfg), {}, 0, set()
        if snap.exists():
            with np.load(snap, allow_pickle=False) as z:
                index = faiss.deserialize_index(np.ascontiguousarray(z["index"]))
                meta = json.loads(bytes(z["meta"]).decode())
                ids = set(np.asarray(z["ids"], dtype=np.int64).tolist())
            if len(ids) != index.ntotal:
                raise ValueError(f"snapshot has {index.ntotal} vectors but {len(ids)} ids")
            metadata = {int(k): v for k, v in meta["metadata"].items()}
            seq = int(meta["seq"])
            if "config" in meta:  # an auto index's current kind and tuning, as of this snapshot
                cfg = IndexConfig(**meta["config"])
            if index.d != cfg.dim:
                raise ValueError(f"snapshot dim {index.d} != config dim {cfg.dim}")
        elif (path / INDEX_FILE).exists():  # built by msn-index: loaded into memory, since the writer mutates it
            _, index, id_arr, metadata, seq = read_index_dir(path, mmap=False)
            ids = set(id_arr.tolist())
        records, valid_len, problem = WriteAheadLog.read(path / "wal.log")
        if problem is not None:
            if problem.startswith("torn tail"):
                log.warning("%s: WAL %s; dropping the unacknowledged tail", path.name, problem)
            else:
                quarantine(data_dir, _copy(path / "wal.log"), f"WAL {problem}; replaying the valid prefix")
            with open(path / "wal.log", "r+b") as f:
                f.truncate(valid_len)
        obj = cls(path, cfg, index, metadata, seq, ids, device=device)
        replayed = 0
        for rseq, payload in records:
            if rseq <= obj.seq:
                continue
            op, ids, vecs, meta_list = decode_record(payload)
            obj._apply(op, ids, vecs, meta_list)
            obj.seq = rseq
            replayed += 1
        log.info("index %s: %d vectors (%d WAL records replayed)", path.name, obj.index.ntotal, replayed)
        with obj.lock:
            obj._maybe_retune()  # e.g. a crash interrupted a re-tune
        return obj

    @classmethod
    def open_read_only(cls, path: Path, device: str = "cpu") -> ManagedIndex:
        """A published index, memory-mapped where FAISS allows, with no WAL: any failure raises."""
        config, index, ids, metadata, seq = read_index_dir(path, mmap=True)
        return cls(path, IndexConfig(**config), index, metadata, seq, set(ids.tolist()), read_only=True,
                   device=device)

    def export(self, dest: Path) -> None:
        """Write the current state in the mmap-able form (for publishing); consistent under ``lock``."""
        with self.lock:
            self._check_open()
            write_index_dir(dest, asdict(self.cfg), self.index, np.fromiter(self.ids, np.int64, len(self.ids)),
                            self.metadata, self.seq)

    def snapshot(self) -> None:
        with self.lock:
            meta = json.dumps({"seq": self.seq, "metadata": {str(k): v for k, v in self.metadata.items()},
                               "config": asdict(self.cfg)})
            buf = io.BytesIO()
            np.savez(buf, index=faiss.serialize_index(self.index), meta=np.frombuffer(meta.encode(), np.uint8),
                     ids=np.fromiter(self.ids, dtype=np.int64, count=len(self.ids)))
            atomic_write(self.path / "snapshot.npz", buf.getvalue())
            if self.cfg.auto:  # its kind changes; the snapshot (written first) is what load() trusts
                atomic_write(self.path / "config.json", json.dumps(asdict(self.cfg), indent=1).encode())
            for stale in (INDEX_FILE, STATE_FILE):  # a built index's files are superseded by the snapshot
                if (self.path / stale).exists():
                    remove_durably(self.path / stale)
            self.wal.truncate(0)  # records <= seq are in the snapshot; a crash before this only re-skips them

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            if self.wal is None:
                self.closed = True
                return
            if self.wal.size():
                self.snapshot()
            self.wal.close()
            self.closed = True

    def _check_writable(self) -> None:
        if self.wal is None:
            raise read_only_replica()

    def _check_open(self) -> None:
        """Called under ``lock``: a request that waited while the index was dropped gets a 404, not a crash."""
        if self.closed:
            raise not_found(f"index {self.path.name!r} was deleted")

    # ---- mutations --------------------------------------------------------------------------------------------
    def _prepare(self, vecs: np.ndarray) -> np.ndarray:
        v = np.ascontiguousarray(vecs, dtype=np.float32)
        if v.ndim != 2 or v.shape[1] != self.cfg.dim:
            raise unprocessable(f"vectors must have shape (n, {self.cfg.dim}), got {tuple(v.shape)}")
        if not np.isfinite(v).all():
            raise unprocessable("vectors contain NaN or infinity")
        if self.cfg.normalize:
            v = v.copy()
            norms = np.linalg.norm(v, axis=1)
            if (norms == 0).any():
                raise unprocessable("cannot normalise an all-zero vector (index was created with normalize)")
            faiss.normalize_L2(v)
        return v

    def _apply(self, op: str, ids: np.ndarray, vecs: np.ndarray | None, meta_list: list | None) -> None:
        if self._pending is not None:
            self._pending.append((op, ids, vecs))
        self._sync_gpu(op, ids, vecs)
        if op == "add":
            self.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
            self.ids.update(ids.tolist())
            if meta_list is not None:
                for i, m in zip(ids.tolist(), meta_list, strict=True):
                    if m is not None:
                        self.metadata[i] = m
        elif op == "remove":
            self.index.remove_ids(ids)
            for i in ids.tolist():
                self.ids.discard(i)
                self.metadata.pop(i, None)
        else:  # pragma: no cover - only our own writer produces records
            raise ValueError(f"unknown WAL op {op!r}")

    def add(self, ids: list[int], vecs: np.ndarray, metadata: list | None) -> int:
        arr = _check_ids(ids)
        v = self._prepare(vecs)
        if v.shape[0] != arr.size:
            raise unprocessable(f"{arr.size} ids but {v.shape[0]} vectors/images")
        if metadata is not None and (not isinstance(metadata, list) or len(metadata) != arr.size):
            raise unprocessable("metadata must be a JSON list with one entry (or null) per id")
        with self.lock:
            self._check_writable()
            self._check_open()
            dup = sorted(set(arr.tolist()) & self.ids)
            if dup:
                raise conflict(f"ids already in the index (delete them first): {dup[:10]}")
            if self.cfg.type in IVF_TYPES and not self.index.is_trained:
                if arr.size < self.cfg.nlist:
                    raise unprocessable(f"an ivf index trains on its first add: send at least nlist="
                                        f"{self.cfg.nlist} vectors (got {arr.size}) or create it with a smaller nlist")
                self.index.train(v)
                self._apply("add", arr, v, metadata)
                self.seq += 1
                self.snapshot()  # training is not replayed bit-exactly, so persist its result directly
                return arr.size
            self.seq += 1
            self.wal.append(self.seq, encode_record("add", arr, v, metadata))
            self._apply("add", arr, v, metadata)
            self._maybe_compact()
            self._maybe_retune()
        return arr.size

    def remove(self, ids: list[int]) -> dict[str, Any]:
        arr = _check_ids(ids)
        if not self.cfg.can_delete or (self.cfg.auto and not self.cfg.deletes):
            what = "this auto index was created with deletes=false" if self.cfg.auto else \
                f"{self.cfg.type}{' (re-ranked)' if self.cfg.k_factor else ''} indexes cannot delete vectors"
            raise conflict(f"{what} (FAISS limitation); use a flat, ivf or auto index")
        with self.lock:
            self._check_writable()
            self._check_open()
            present = np.array([i for i in arr.tolist() if i in self.ids], dtype=np.int64)
            missing = sorted(set(arr.tolist()) - set(present.tolist()))
            if present.size:
                self.seq += 1
                self.wal.append(self.seq, encode_record("remove", present, None, None))
                self._apply("remove", present, None, None)
                self._maybe_compact()
        return {"removed": int(present.size), "not_found": missing}

    def _maybe_compact(self) -> None:
        if self.wal.size() > self.compact_bytes:
            self.snapshot()

    compact_bytes = 64 * 2**20

    # ---- GPU copy and auto re-tuning (both under ``lock``) -----------------------------------------------------
    @property
    def search_device(self) -> str:
        return "cuda" if self.device == "cuda" and index_gpu.supported(self.cfg) else "cpu"

    def _searcher(self) -> faiss.Index:
        if self.search_device == "cpu":
            return self.index
        if self.gpu_index is None:
            self.gpu_index = index_gpu.to_gpu(self.index)
        return self.gpu_index

    def _sync_gpu(self, op: str, ids: np.ndarray, vecs: np.ndarray | None) -> None:
        """Adds go to the GPU copy too; anything else drops it (rebuilt from the CPU index at the next search)."""
        if self.gpu_index is None:
            return
        if op == "add" and self.index.is_trained:
            self.gpu_index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
        else:
            self.gpu_index = None

    def _maybe_retune(self) -> None:
        index_auto.maybe_retune(self)

    # ---- queries ----------------------------------------------------------------------------------------------
    def search(self, vecs: np.ndarray, k: int, nprobe: int | None = None, ef_search: int | None = None) -> list:
        q = self._prepare(vecs)
        with self.lock:
            self._check_open()
            if self.index.ntotal == 0:
                return [[] for _ in range(q.shape[0])]
            params = search_params(self.cfg, int(k), nprobe=nprobe, ef_search=ef_search)
            dist, labels = self._searcher().search(q, int(k), params=params)
            out = []
            for drow, lrow in zip(dist.tolist(), labels.tolist(), strict=True):
                hits = []
                for d, i in zip(drow, lrow, strict=True):
                    if i < 0:
                        continue
                    hit: dict[str, Any] = {"id": int(i), "score": float(d)}
                    if i in self.metadata:
                        hit["metadata"] = self.metadata[i]
                    hits.append(hit)
                out.append(hits)
        return out

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            auto = {"next_tuning": self.cfg.next_tuning(), "retuning": self.retuning,
                    "last_tuning": self.last_tuning} if self.cfg.auto else None
            return {"name": self.path.name, **asdict(self.cfg), "ntotal": int(self.index.ntotal),
                    "device": self.search_device, "auto_tuning": auto,
                    "trained": bool(self.index.is_trained), "with_metadata": len(self.metadata),
                    "wal_bytes": self.wal.size() if self.wal else 0, "seq": self.seq,
                    "score": "inner product (higher is closer)" if self.cfg.metric == "ip"
                    else "squared L2 distance (lower is closer)"}


def _check_ids(ids: Any) -> np.ndarray:
    if not isinstance(ids, list) or not ids:
        raise unprocessable("ids must be a non-empty JSON list of integers")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID for i in ids):
        raise unprocessable(f"ids must be integers in [0, {MAX_ID}]")
    if len(set(ids)) != len(ids):
        raise unprocessable("ids contain duplicates")
    return np.asarray(ids, dtype=np.int64)


def _copy(path: Path) -> Path:
    dest = path.with_name(path.name + ".corrupt-copy")
    dest.write_bytes(path.read_bytes())
    return dest


class IndexStore:
    """All indexes under ``<data-dir>/indexes``; create/drop are serialised by one lock."""

    def __init__(self, data_dir: Path, *, default_dim: int, model_id: str, compact_mb: float = 64.0,
                 root: Path | None = None, read_only: bool = False, device: str = "cpu"):
        self.data_dir, self.read_only = data_dir, read_only
        self.device = index_gpu.resolve_device(device)
        self.root = root or data_dir / "indexes"
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.default_dim, self.model_id = default_dim, model_id
        self.compact_bytes = int(compact_mb * 2**20)
        self._lock = threading.Lock()
        self.indexes: dict[str, ManagedIndex] = {}

    def load_all(self) -> list[str]:
        problems = []
        for p in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not p.is_dir() or p.name.startswith("."):
                continue
            if self.read_only:  # a published snapshot is all or nothing: the caller keeps the previous one
                self.indexes[p.name] = ManagedIndex.open_read_only(p, self.device)
                continue
            try:
                idx = ManagedIndex.load(p, self.data_dir, self.device)
                idx.compact_bytes = self.compact_bytes
                self.indexes[p.name] = idx
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

    def describe(self) -> list[dict[str, Any]]:
        return [idx.stats() for idx in list(self.indexes.values())]

    def create(self, name: str, spec: dict[str, Any], *, exist_ok: bool = False) -> ManagedIndex:
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            if name in self.indexes:
                if exist_ok:
                    return self.indexes[name]
                raise conflict(f"index {name!r} already exists")
            cfg = config_from_spec(spec, self.default_dim, self.model_id)
            idx = ManagedIndex.create(self.root / name, cfg, self.device)
            idx.compact_bytes = self.compact_bytes
            self.indexes[name] = idx
            return idx

    def drop(self, name: str) -> None:
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            idx = self.get(name)
            with idx.lock:
                idx.wal.close()
                idx.closed = True
                remove_durably(idx.path)
            del self.indexes[name]

    def close(self) -> None:
        for idx in self.indexes.values():
            try:
                idx.close()
            except Exception:
                log.exception("closing index %s", idx.path.name)
