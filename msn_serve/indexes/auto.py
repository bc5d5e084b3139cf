"""Re-tuning of msn-serve's auto indexes (``"type": "auto"``): the same tuner as ``msn-index build``.

An auto index starts as exact ``flat`` search. When it holds ``exact_below`` vectors (100,000 by default), and again
each time it has grown ``retune_growth`` (2) times past its last tuning, :func:`retune` takes a copy of its vectors,
holds out up to 1,000 of them as queries, asks :func:`msn_serve.indexes.tuning.select` for the candidate with the
most queries per second at the index's ``target_recall`` (recall@10 against exact search over the other vectors),
then adds the held-out vectors too. With ``deletes`` (the default) only kinds that can delete are candidates
(IVF-Flat); ``"deletes": false`` also lets re-ranked IVF-PQ and HNSW compete. The live index keeps serving while
this runs: :class:`Retuning`, which a :class:`msn_serve.indexes.managed.ManagedIndex` owns, builds the new index in
a thread, replays onto it what changed meanwhile and swaps it in.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np
from faiss.contrib.inspect_tools import get_invlist

from msn_serve.indexes.config import IndexConfig, build_index
from msn_serve.indexes.gpu import GpuMirror
from msn_serve.indexes.tuning import nlist_for, plans, select
from msn_serve.indexes.wal import WriteAheadLog

__all__ = ["Retunable", "Retuning", "retune", "vectors_of"]

log = logging.getLogger("msn_serve.indexes")
QUERIES, K = 1000, 10


def vectors_of(index: faiss.Index, cfg: IndexConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, vectors)`` stored in ``index`` (copies): the raw vectors every kind an auto index holds keeps."""
    if cfg.type == "ivf":
        ivf = faiss.extract_index_ivf(index)
        parts = [get_invlist(ivf.invlists, lst) for lst in range(ivf.nlist) if ivf.invlists.list_size(lst)]
        if not parts:
            return np.zeros(0, np.int64), np.zeros((0, cfg.dim), np.float32)
        ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
        vecs = np.concatenate([p[1].view(np.float32).reshape(-1, cfg.dim) for p in parts])
        return ids, vecs
    if not isinstance(index, faiss.IndexIDMap2):
        raise TypeError(f"{cfg.type} index {type(index).__name__} does not keep raw vectors to re-tune from")
    inner = faiss.downcast_index(index.index)
    if cfg.type == "ivfpq":  # re-ranked: IndexRefineFlat keeps the raw vectors in its refine index
        inner = faiss.downcast_index(inner.refine_index)
    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    return ids, inner.reconstruct_n(0, inner.ntotal)


def retune(cfg: IndexConfig, ids: np.ndarray, vecs: np.ndarray, *, seed: int = 0) -> tuple[IndexConfig, faiss.Index,
                                                                                          dict[str, Any]]:
    """The tuned index for these vectors (already normalised as ``cfg`` says) and a report of the choice."""
    t0 = time.perf_counter()
    n, d = vecs.shape
    kinds = ("ivf",) if cfg.deletes else ("ivf", "ivfpq", "hnsw")
    candidates = plans(n, d, float("inf"), exact_below=cfg.exact_below, deletes=cfg.deletes, kinds=kinds)
    if candidates[0].type == "flat":
        flat = replace(cfg, type="flat", tuned_at=n)
        index = build_index(flat)
        index.add_with_ids(vecs, ids)
        return flat, index, {"chosen": "flat", "n": n, "seconds": round(time.perf_counter() - t0, 2)}
    perm = np.random.default_rng(seed).permutation(n)
    nq = min(QUERIES, n // 10)
    held, rest = perm[:nq], perm[nq:]
    q = np.ascontiguousarray(vecs[held])
    metric = faiss.METRIC_INNER_PRODUCT if cfg.metric == "ip" else faiss.METRIC_L2
    _, pos = faiss.knn(q, np.ascontiguousarray(vecs[rest]), K, metric=metric)
    truth = ids[rest][pos]
    ntrain = min(len(rest), 64 * nlist_for(n))
    train = np.ascontiguousarray(vecs[rest[:ntrain]])

    def fill(index: faiss.Index) -> None:
        for lo in range(0, len(rest), 65536):
            part = rest[lo:lo + 65536]
            index.add_with_ids(np.ascontiguousarray(vecs[part]), ids[part])

    best, reports = select(candidates, cfg, train, fill, q, truth, cfg.target_recall)
    best.index.add_with_ids(q, ids[held])  # the held-out vectors belong to the index too
    report = {"chosen": best.config.type, "n": n, "queries": nq, "target_recall": cfg.target_recall,
              "candidates": [{k: v for k, v in r.items() if k != "tuning"} for r in reports],
              "seconds": round(time.perf_counter() - t0, 2)}
    return replace(best.config, tuned_at=n), best.index, report


class Retunable(Protocol):
    """What :class:`Retuning` reads and swaps of the index it re-tunes (a ManagedIndex)."""

    path: Path
    cfg: IndexConfig
    index: faiss.Index
    closed: bool
    lock: threading.RLock
    gpu: GpuMirror
    wal: WriteAheadLog | None  # None on a read-only replica, which never re-tunes

    @property
    def ntotal(self) -> int: ...

    def snapshot(self) -> None: ...


class Retuning:
    """An auto index's re-tuning, kept under its owner's lock: whether a re-tune runs, the mutations applied to the
    live index meanwhile (replayed onto its result before the swap) and the last report (``stats()`` shows it)."""

    def __init__(self, owner: Retunable):
        self.owner = owner
        self.running = False
        self.pending: list[tuple[str, np.ndarray, np.ndarray | None]] | None = None
        self.last: dict[str, Any] | None = None

    def note(self, op: str, ids: np.ndarray, vecs: np.ndarray | None) -> None:
        """Record a mutation while a re-tune runs, so that its result misses none."""
        if self.pending is not None:
            self.pending.append((op, ids, vecs))

    def stats(self) -> dict[str, Any] | None:
        """``stats()["auto_tuning"]``: ``None`` for an index that is not ``auto``."""
        cfg = self.owner.cfg
        return {"next_tuning": cfg.next_tuning(), "retuning": self.running, "last_tuning": self.last} \
            if cfg.auto else None

    def maybe_start(self) -> None:
        """Called under the owner's lock after adds (and at load): start a background re-tune when an auto index of
        the writer reached its next tuning size."""
        idx = self.owner
        threshold = idx.cfg.next_tuning()
        if threshold is None or self.running or idx.wal is None or idx.ntotal < threshold:
            return
        ids, vecs = vectors_of(idx.index, idx.cfg)
        self.running, self.pending = True, []
        threading.Thread(target=self._run, args=(ids, vecs), name=f"msn-retune-{idx.path.name}", daemon=True).start()

    def _run(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Build the tuned index off the lock, then replay what changed meanwhile, swap it in and snapshot."""
        idx = self.owner
        try:
            cfg, index, report = retune(idx.cfg, ids, vecs)
        except Exception:
            log.exception("index %s: re-tuning failed; still %s", idx.path.name, idx.cfg.type)
            with idx.lock:
                self.running, self.pending = False, None
            return
        with idx.lock:
            if idx.closed:
                return
            for op, op_ids, op_vecs in self.pending or []:
                if op == "remove" or cfg.can_delete:  # an add replaces ids already there (with deletes=false the
                    index.remove_ids(op_ids)  # live index refused re-adds that change anything)
                if op == "add":
                    index.add_with_ids(np.ascontiguousarray(op_vecs, dtype=np.float32), op_ids)
            idx.index, idx.cfg = index, cfg
            idx.gpu.drop()
            self.running, self.pending, self.last = False, None, report
            try:
                idx.snapshot()
            except OSError as e:  # the WAL still holds every record: a restart replays them and re-tunes again
                log.warning("index %s: snapshot after re-tuning failed (%s)", idx.path.name, e)
            log.info("index %s re-tuned at %d vectors: %s in %.1fs", idx.path.name, cfg.tuned_at, cfg.type,
                     report["seconds"])
