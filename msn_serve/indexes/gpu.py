"""GPU copies of FAISS indexes for ``msn-serve --device cuda`` (``faiss-gpu-cuvs``: ``pip install '.[gpu]'``).

Flat and IVF indexes (IVF-Flat, plain IVF-PQ) get a GPU copy that answers searches (:class:`GpuMirror`); the CPU
index stays the one that is persisted, published and replayed (``index_gpu_to_cpu`` is never needed), as without a
GPU. HNSW and the re-ranked IVF-PQ have no FAISS GPU implementation and stay on the CPU. FAISS GPU indexes are not
thread-safe even for searches, which is why every use happens under the owning index's lock. Without a GPU build of
faiss or a visible GPU ``--device cuda`` is refused (:mod:`msn_serve.device`), never quietly served from the CPU.
"""
from __future__ import annotations

import logging
import threading

import faiss
import numpy as np

from msn_core.gpu import CudaUnavailable
from msn_core.optional import GPU_INSTALL
from msn_serve.indexes.config import IndexConfig

log = logging.getLogger("msn_serve.indexes.gpu")
_resources: faiss.StandardGpuResources | None = None
_lock = threading.Lock()


def gpu_count() -> int:
    """GPUs FAISS can use: 0 with faiss-cpu, or with a GPU build and no visible device."""
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return int(get()) if get is not None else 0
    except RuntimeError:  # a GPU build on a machine whose driver cannot be loaded
        return 0


def resolve_device(requested: str) -> str:
    """``cuda`` if asked for and FAISS can use a GPU, else ``cpu``; :class:`CudaUnavailable` when ``cuda`` is asked
    for and this faiss has no GPU support or sees no GPU (``msn_serve.device`` refuses that before; this guards the
    stores opened on their own)."""
    if requested != "cuda":
        return "cpu"
    if gpu_count() > 0:
        return "cuda"
    why = (f"faiss-gpu-cuvs (this faiss {faiss.__version__} is the CPU build): {GPU_INSTALL}"
           if not hasattr(faiss, "StandardGpuResources") else "a GPU faiss can see (faiss.get_num_gpus() is 0)")
    raise CudaUnavailable(f"--device cuda needs {why}")


def supported(cfg: IndexConfig) -> bool:
    """Kinds FAISS can copy to a GPU (flat, IVF-Flat, plain IVF-PQ)."""
    return cfg.type in ("flat", "ivf") or (cfg.type == "ivfpq" and not cfg.k_factor and not cfg.fastscan)


def to_gpu(index: faiss.Index) -> faiss.Index:
    """A GPU copy of ``index`` on device 0 (IndexIDMap2 wrappers stay on the CPU around a GPU flat index)."""
    global _resources
    with _lock:
        if _resources is None:
            _resources = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    options.useFloat16 = False  # exact scores, as on the CPU
    if hasattr(options, "use_cuvs"):
        # faiss-gpu-cuvs clones to cuVS kernels by default, with limits of their own (nprobe, k); the classic FAISS
        # GPU kernels it also carries are the ones these index kinds were written and tested against.
        options.use_cuvs = False
    return faiss.index_cpu_to_gpu(_resources, 0, index, options)


class GpuMirror:
    """The GPU copy that answers one index's searches (``--device cuda``, kinds :func:`supported`).

    The CPU index stays the one that is persisted and replayed; this copy only follows it. Plain adds are applied to
    both; any other change (a removal, a replacement, a re-tune) drops the copy, and the next search rebuilds it from
    the CPU index, since FAISS GPU indexes cannot follow those in place. The owner calls it under its lock (FAISS GPU
    indexes are not thread-safe even for searches).
    """

    def __init__(self, device: str = "cpu"):
        self.device = device  # resolve_device'd: "cuda" only where FAISS sees a GPU
        self.copy: faiss.Index | None = None  # built lazily, at the first search that needs it

    def device_for(self, cfg: IndexConfig) -> str:
        """Where searches of an index with this config run."""
        return "cuda" if self.device == "cuda" and supported(cfg) else "cpu"

    def searcher(self, index: faiss.Index, cfg: IndexConfig) -> faiss.Index:
        """The index a search goes to: ``index`` itself, or its GPU copy."""
        if self.device_for(cfg) == "cpu":
            return index
        if self.copy is None:
            self.copy = to_gpu(index)
        return self.copy

    def follow(self, op: str, index: faiss.Index, ids: np.ndarray, vecs: np.ndarray | None) -> None:
        """Called before ``op`` changes ``index``: an add to a trained index goes to the copy too, anything else
        drops it."""
        if self.copy is None:
            return
        if op == "add" and index.is_trained:
            self.copy.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
        else:
            self.copy = None

    def drop(self) -> None:
        """Forget the copy (the CPU index was replaced): the next search copies the new one."""
        self.copy = None
