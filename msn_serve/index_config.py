"""Index options: the typed configuration of one FAISS index, its validation from a request, and the FAISS object
it describes. Shared by the live indexes (:mod:`msn_serve.indexes`) and the offline builder (``msn-index``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import faiss

from .errors import unprocessable

__all__ = ["IndexConfig", "build_index", "config_from_spec", "recommended_nlist"]


@dataclass(frozen=True)
class IndexConfig:
    dim: int
    metric: Literal["ip", "l2"] = "ip"
    type: Literal["flat", "ivf", "ivfpq", "hnsw"] = "flat"
    normalize: bool = True
    nlist: int = 256
    nprobe: int = 16
    m: int = 32
    ef_construction: int = 80
    ef_search: int = 64
    model_id: str = ""
    pq_m: int = 0  # ivfpq: bytes per code (8-bit sub-quantizers)


def build_index(cfg: IndexConfig) -> faiss.Index:
    """An empty FAISS index for ``cfg`` (ids: IndexIDMap2 for flat/hnsw, native for the IVF types)."""
    metric = faiss.METRIC_INNER_PRODUCT if cfg.metric == "ip" else faiss.METRIC_L2
    if cfg.type == "flat":
        inner = faiss.IndexFlatIP(cfg.dim) if cfg.metric == "ip" else faiss.IndexFlatL2(cfg.dim)
    elif cfg.type == "ivf":
        quant = faiss.IndexFlatIP(cfg.dim) if cfg.metric == "ip" else faiss.IndexFlatL2(cfg.dim)
        # IVF stores external ids in its inverted lists natively. It must NOT sit inside an IndexIDMap: IVF's
        # remove_ids does not renumber internal ids the way IDMap's bookkeeping assumes, so ids would scramble.
        return faiss.IndexIVFFlat(quant, cfg.dim, cfg.nlist, metric)  # the wrapper keeps `quant` alive
    elif cfg.type == "ivfpq":
        quant = faiss.IndexFlatIP(cfg.dim) if cfg.metric == "ip" else faiss.IndexFlatL2(cfg.dim)
        return faiss.IndexIVFPQ(quant, cfg.dim, cfg.nlist, cfg.pq_m, 8, metric)
    else:
        inner = faiss.IndexHNSWFlat(cfg.dim, cfg.m, metric)
        inner.hnsw.efConstruction = cfg.ef_construction
    return faiss.IndexIDMap2(inner)  # faiss' Python wrapper keeps a reference to `inner`


def config_from_spec(spec: dict[str, Any], default_dim: int, model_id: str) -> IndexConfig:
    """The options of ``POST /index/{name}``, checked (422 naming the option); ivfpq only comes from msn-index."""
    allowed = {"dim", "metric", "type", "normalize", "nlist", "nprobe", "m", "ef_construction", "ef_search"}
    bad = sorted(set(spec) - allowed)
    if bad:
        raise unprocessable(f"unknown index option(s) {bad}; allowed: {sorted(allowed)}")
    metric = spec.get("metric", "ip")
    kind = spec.get("type", "flat")
    if metric not in ("ip", "l2"):
        raise unprocessable(f"metric must be 'ip' or 'l2', got {metric!r}")
    if kind not in ("flat", "ivf", "hnsw"):
        raise unprocessable(f"type must be 'flat', 'ivf' or 'hnsw', got {kind!r}")
    ints = {}
    for key, default, lo, hi in (("dim", default_dim, 1, 65536), ("nlist", 256, 1, 1 << 20),
                                 ("nprobe", 16, 1, 1 << 20), ("m", 32, 2, 256),
                                 ("ef_construction", 80, 1, 4096), ("ef_search", 64, 1, 4096)):
        v = spec.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise unprocessable(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
        ints[key] = v
    normalize = spec.get("normalize", metric == "ip")
    if not isinstance(normalize, bool):
        raise unprocessable(f"normalize must be true or false, got {normalize!r}")
    if kind == "ivf" and ints["nprobe"] > ints["nlist"]:
        ints["nprobe"] = ints["nlist"]
    return IndexConfig(metric=metric, type=kind, normalize=normalize, model_id=model_id, **ints)


def recommended_nlist(n: int) -> int:
    """4*sqrt(n) rounded to a power of two (the autofaiss rule of thumb), for docs and benchmarks."""
    return 1 << max(0, round(math.log2(max(1.0, 4 * math.sqrt(n)))))
