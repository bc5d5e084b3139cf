"""The one interface of an index, whichever engine holds it, and the input checks every engine shares.

The routes (:mod:`msn_serve.indexes.service`), the label loop (:mod:`msn_serve.classifiers.label_loop`) and the
publisher only use :class:`VectorIndex`: FAISS (:class:`~msn_serve.indexes.managed.ManagedIndex`, the default, files
under ``<data-dir>/indexes``) and Milvus (:class:`~msn_serve.indexes.milvus.MilvusIndex`, a collection) are
interchangeable behind it. Ids, vectors and their limits are checked here, once, so a bad request gets the same 4xx
from both, and a search's answer is written out once (:func:`hit_lists`).
"""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from msn_serve.errors import unprocessable
from msn_serve.indexes.config import IndexConfig
from msn_serve.indexes.metadata import to_texts

__all__ = ["BACKENDS", "MAX_ID", "Backend", "VectorIndex", "check_add", "check_ids", "hit_lists", "prepare_vectors",
           "score_meaning"]

Backend = Literal["faiss", "milvus"]
BACKENDS: tuple[str, ...] = ("faiss", "milvus")
MAX_ID = 2**63 - 1
F32_MAX = float(np.finfo(np.float32).max)


@runtime_checkable
class VectorIndex(Protocol):
    """One named index: upserts under int64 ids with JSON metadata, k-NN search, and its stored vectors back.

    Writes are durable and visible to searches when they return. ``seq`` grows with every write made through this
    object (caches of the stored vectors key on it); ``lock`` serialises writes and reads that must see one state.
    """

    backend: str
    cfg: IndexConfig
    lock: threading.RLock
    seq: int
    created: float
    closed: bool

    @property
    def name(self) -> str: ...

    @property
    def ntotal(self) -> int: ...

    def add(self, ids: Any, vecs: np.ndarray, metadata: list | None = None) -> dict[str, int]:
        """``{"added", "replaced"}``; an id already there is replaced (vector and metadata)."""

    def remove(self, ids: Any) -> dict[str, Any]:
        """``{"removed", "not_found"}``."""

    def query(self, vecs: np.ndarray, k: int, nprobe: int | None = None,
              ef_search: int | None = None) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """``(scores (n, k'), ids (n, k'), {hit id: metadata JSON text})``; ``-1`` ids pad short rows."""

    def search(self, vecs: np.ndarray, k: int, nprobe: int | None = None, ef_search: int | None = None) -> list:
        """:meth:`query` as ``[[{"id", "score", "metadata"?}, ...], ...]`` (in-process callers)."""

    def stored_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, float32 vectors)`` of every item, as stored (normalised when the index normalises); 422 when
        the kind keeps no raw vectors."""

    def metadata_texts(self, ids: list[int]) -> dict[int, str | None]:
        """Stored metadata JSON text of each id (``None`` when it has none)."""

    def stats(self) -> dict[str, Any]: ...

    def export(self, dest: Path) -> None:
        """Write the current state in the published (mmap-able FAISS) form, for read-only replicas."""

    def drop(self) -> None:
        """Delete the index and everything it stores (the commit point is durable when it returns)."""

    def close(self) -> None: ...


def check_ids(ids: Any) -> np.ndarray:
    """A non-empty list of distinct ints in ``[0, MAX_ID]`` as int64 (422 otherwise)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1 and ids.size:
        ids = ids.tolist()  # from the request model (already checked); checked again for in-process callers
    if not isinstance(ids, list) or not ids:
        raise unprocessable("ids must be a non-empty JSON list of integers")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID for i in ids):
        raise unprocessable(f"ids must be integers in [0, {MAX_ID}]")
    if len(set(ids)) != len(ids):
        raise unprocessable("ids contain duplicates")
    return np.asarray(ids, dtype=np.int64)


def prepare_vectors(cfg: IndexConfig, vecs: np.ndarray) -> np.ndarray:
    """float32 (n, dim), finite; L2-normalised (in float64, so huge values cannot overflow) if the index
    normalises, else small enough that squared distances and inner products stay finite in float32."""
    v = np.asarray(vecs)
    if v.ndim != 2 or v.shape[1] != cfg.dim:
        raise unprocessable(f"vectors must have shape (n, {cfg.dim}), got {tuple(v.shape)}")
    v = v.astype(np.float64)
    if not np.isfinite(v).all():
        raise unprocessable("vectors contain NaN or infinity")
    if cfg.normalize:
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        if (norms == 0).any():
            raise unprocessable("cannot normalise an all-zero vector (index was created with normalize)")
        return np.ascontiguousarray(v / norms, dtype=np.float32)
    bound = math.sqrt(F32_MAX / (4 * cfg.dim))
    if v.size and np.abs(v).max() > bound:
        raise unprocessable(f"vector components must be within ±{bound:.3g} in an index without normalisation "
                            f"(distances must stay finite in float32)")
    return np.ascontiguousarray(v, dtype=np.float32)


def check_add(cfg: IndexConfig, ids: Any, vecs: np.ndarray,
              metadata: list | None) -> tuple[np.ndarray, np.ndarray, list[str | None] | None]:
    """An add's ``(ids, vectors, metadata JSON texts)``, checked as every engine checks them (422 otherwise)."""
    arr = check_ids(ids)
    v = prepare_vectors(cfg, vecs)
    if v.shape[0] != arr.size:
        raise unprocessable(f"{arr.size} ids but {v.shape[0]} vectors/images")
    try:
        texts = to_texts(metadata, arr.size)
    except ValueError as e:
        raise unprocessable(str(e)) from None
    return arr, v, texts


def hit_lists(scores: np.ndarray, labels: np.ndarray, texts: dict[int, str]) -> list:
    """A :meth:`VectorIndex.query` answer as :meth:`VectorIndex.search` gives it: ``-1`` padding left out."""
    return [[{"id": i, "score": s, **({"metadata": json.loads(texts[i])} if i in texts else {})}
             for s, i in zip(srow, lrow, strict=True) if i >= 0]
            for srow, lrow in zip(scores.tolist(), labels.tolist(), strict=True)]


def score_meaning(cfg: IndexConfig) -> str:
    """What a score is, for ``stats()``."""
    return "inner product (higher is closer)" if cfg.metric == "ip" else "squared L2 distance (lower is closer)"
