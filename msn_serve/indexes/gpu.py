"""GPU copies of FAISS indexes for ``msn-serve --device cuda`` (``faiss-gpu``: ``pip install '.[gpu]'``).

Flat and IVF indexes (IVF-Flat, plain IVF-PQ) get a GPU copy that answers searches; the CPU index stays the one
that is persisted, published and replayed (``index_gpu_to_cpu`` is never needed), as without a GPU. HNSW and the
re-ranked IVF-PQ have no FAISS GPU implementation and stay on the CPU. FAISS GPU indexes are not thread-safe even
for searches, which is why every use happens under the owning index's lock. Without a GPU build of faiss or a
visible GPU the service logs one warning and keeps every index on the CPU.
"""
from __future__ import annotations

import logging
import threading

import faiss

from msn_serve.indexes.config import IndexConfig

log = logging.getLogger("msn_serve.indexes.gpu")
_resources: faiss.StandardGpuResources | None = None
_lock = threading.Lock()
_warned = False


def gpu_count() -> int:
    """GPUs FAISS can use: 0 with faiss-cpu, or with faiss-gpu and no visible device."""
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return int(get()) if get is not None else 0
    except RuntimeError:  # a GPU build on a machine whose driver cannot be loaded
        return 0


def resolve_device(requested: str) -> str:
    """``cuda`` if asked for and FAISS can use a GPU, else ``cpu`` (warning once why)."""
    global _warned
    if requested != "cuda":
        return "cpu"
    if gpu_count() > 0:
        return "cuda"
    if not _warned:
        why = ("this faiss build has no GPU support (install the gpu extra: faiss-gpu)"
               if not hasattr(faiss, "StandardGpuResources") else "no GPU is visible to faiss")
        log.warning("--device cuda: %s; FAISS indexes stay on the CPU", why)
        _warned = True
    return "cpu"


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
    return faiss.index_cpu_to_gpu(_resources, 0, index, options)
