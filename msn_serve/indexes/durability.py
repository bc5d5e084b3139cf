"""When a FAISS index of the writer is written, so that after ``kill -9`` it holds exactly the acknowledged writes.

:class:`Durability` is the part of a :class:`~msn_serve.indexes.managed.ManagedIndex` that keeps it: a mutation is
appended to the WAL (fsync'd) before it is applied and acknowledged; IVF's first add, which trains it, is
snapshotted instead (k-means is not replayed bit-exactly); a WAL grown past ``compact_bytes`` is compacted into a
snapshot; at load the records newer than the snapshot are replayed, at close the last ones are snapshotted. What is
on disk and in which order each step writes it is :mod:`msn_serve.indexes.persist`'s; this module decides when.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Protocol

import faiss
import numpy as np

from msn_core.durable import remove_durably
from msn_serve.errors import read_only_replica
from msn_serve.indexes import persist
from msn_serve.indexes.config import IndexConfig, build_index
from msn_serve.indexes.files import decode_record, encode_record
from msn_serve.indexes.metadata import Metadata, Texts
from msn_serve.indexes.wal import WriteAheadLog

__all__ = ["Durability", "Kept"]

log = logging.getLogger("msn_serve.indexes")


class Kept(Protocol):
    """What :class:`Durability` reads and sets of the index it keeps (``wal`` is ``None`` on a read-only replica)."""

    path: Path
    cfg: IndexConfig
    index: faiss.Index
    ids: set[int]
    metadata: Metadata
    seq: int
    closed: bool
    compact_bytes: int
    wal: WriteAheadLog | None
    lock: threading.RLock

    def _apply(self, op: str, ids: np.ndarray, vecs: np.ndarray | None, texts: Texts | None) -> None:
        """Change the in-memory index only (the caller made it durable)."""


class Durability:
    """The WAL, snapshot and replay policy of one index. Every method but :meth:`snapshot` is called under the
    index's lock; a write that fails on disk raises before the index changes (the WAL rolls its bytes back)."""

    def __init__(self, kept: Kept):
        self.kept = kept

    def check_writable(self) -> None:
        if self.kept.wal is None:
            raise read_only_replica()

    def commit(self, op: str, ids: np.ndarray, vecs: np.ndarray | None, texts: Texts | None) -> None:
        """Log ``op`` (fsync'd), apply it, advance ``seq``; then compact a long WAL."""
        k = self.kept
        seq = k.seq + 1
        k.wal.append(seq, encode_record(op, ids, vecs, texts))  # raises (rolled back) on a full disk
        k._apply(op, ids, vecs, texts)
        k.seq = seq
        self._compact_if_long()

    def commit_trained(self, ids: np.ndarray, vecs: np.ndarray, texts: Texts | None) -> None:
        """Apply the add that trained an IVF index and snapshot it (not logged: replay would retrain it, and k-means
        is not bit-exact); a failed snapshot puts the untrained, empty index back."""
        k = self.kept
        seq = k.seq
        k._apply("add", ids, vecs, texts)
        k.seq = seq + 1
        try:
            self.snapshot()
        except BaseException:
            k.index, k.ids, k.metadata, k.seq = build_index(k.cfg), set(), Metadata(), seq
            raise

    def replay(self, records: list[tuple[int, bytes]]) -> int:
        """Apply the WAL records newer than the snapshot (at load); returns how many."""
        k, replayed = self.kept, 0
        for rseq, payload in records:
            if rseq <= k.seq:
                continue
            op, ids, vecs, meta_list = decode_record(payload)
            k._apply(op, ids, vecs, meta_list)
            k.seq = rseq
            replayed += 1
        return replayed

    def snapshot(self) -> None:
        """Replace ``snapshot.npz`` with the current state (:func:`~msn_serve.indexes.persist.write`), then empty
        the WAL."""
        k = self.kept
        with k.lock:
            persist.write(k.path, k.cfg, k.index, k.ids, k.metadata, k.seq)
            k.wal.truncate(0)  # records <= seq are in the snapshot; a crash before this only re-skips them

    def _compact_if_long(self) -> None:
        """Snapshot a long WAL. The write that triggered it is already durable, so a failure is only logged
        (the WAL still holds every record) and compaction is tried again after the next write."""
        if self.kept.wal.size() > self.kept.compact_bytes:
            try:
                self.snapshot()
            except OSError as e:
                log.warning("index %s: compaction failed (%s); the WAL keeps every record", self.kept.path.name, e)

    def close(self) -> None:
        """Snapshot what the WAL holds (a faster next start) and close it."""
        wal = self.kept.wal
        if wal is not None:
            if wal.size():
                self.snapshot()
            wal.close()

    def remove(self) -> None:
        """Remove the directory (renaming it away is the commit point): gone from its name, the index is closed,
        whatever a later fsync said."""
        k = self.kept
        try:
            remove_durably(k.path)
        finally:
            if not k.path.exists():
                if k.wal is not None:
                    k.wal.close()
                k.closed = True
