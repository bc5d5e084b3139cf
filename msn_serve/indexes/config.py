"""Index options: the typed configuration of one FAISS index, its validation from a request, and the FAISS object
it describes. Shared by the live indexes (:mod:`msn_serve.indexes.managed`) and the offline builder (``msn-index``).

Kinds: ``flat`` (exact), ``ivf`` (IVF-Flat), ``ivfpq`` (IVF-PQ; with ``k_factor > 0`` the PQ codes only shortlist
``k_factor * k`` candidates that are re-ranked exactly against the raw vectors, FAISS' ``IndexRefineFlat``, and
``fastscan`` selects 4-bit SIMD PQ codes) and ``hnsw``. An ``auto`` index (``"type": "auto"`` at creation) holds
one of these at a time, chosen and re-tuned by :mod:`msn_serve.indexes.tuning` as it grows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import faiss

from msn_serve.errors import unprocessable

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
    pq_m: int = 0  # ivfpq: sub-quantizers (8-bit: bytes per code; fastscan: 4 bits each)
    k_factor: int = 0  # ivfpq: > 0 re-ranks k_factor * k PQ candidates exactly (needs the raw vectors)
    fastscan: bool = False  # ivfpq: 4-bit fast-scan codes (SIMD lookups)
    # auto indexes: re-tuned by msn_serve.indexes.tuning when they grow
    auto: bool = False
    deletes: bool = True  # auto: only kinds that can delete (flat, ivf); false also allows re-ranked ivfpq, hnsw
    target_recall: float = 0.95
    exact_below: int = 100_000  # auto: exact flat search below this many vectors
    retune_growth: float = 2.0  # auto: re-tune when the index holds this many times the vectors of the last tuning
    tuned_at: int = 0  # auto: vectors at the last tuning (0 = never tuned)

    @property
    def can_delete(self) -> bool:
        """FAISS cannot remove from HNSW graphs or from the re-ranking store of IndexRefine."""
        return self.type in ("flat", "ivf") or (self.type == "ivfpq" and not self.k_factor)

    @property
    def replaceable(self) -> bool:
        """Whether stored vectors may be removed (deleted or replaced); an auto index follows its ``deletes``."""
        return self.can_delete and not (self.auto and not self.deletes)

    @property
    def why_immutable(self) -> str:
        if self.auto:
            return "this auto index was created with deletes=false"
        return f"{self.type}{' (re-ranked)' if self.k_factor else ''} indexes cannot remove vectors"

    def next_tuning(self) -> int | None:
        """Vector count at which an auto index re-tunes (None for fixed indexes)."""
        if not self.auto:
            return None
        return max(self.exact_below, int(self.tuned_at * self.retune_growth)) if self.tuned_at else self.exact_below


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
        # fast-scan codes encode residuals to the list centroid ("fsr"): on anisotropic embeddings the plain form
        # shortlisted too few true neighbours for re-ranking to recover (recall 0.36 vs 0.57 at k_factor 1)
        codes = f"PQ{cfg.pq_m}x4fsr" if cfg.fastscan else f"PQ{cfg.pq_m}"
        if not cfg.k_factor:
            return _without_polysemous_training(
                faiss.index_factory(cfg.dim, f"IVF{cfg.nlist},{codes}", metric))  # native ids
        # IndexRefine takes no external ids: the IDMap2 wrapper gives them (and cannot remove, see can_delete)
        refine = faiss.index_factory(cfg.dim, f"IVF{cfg.nlist},{codes},RFlat", metric)
        _without_polysemous_training(faiss.downcast_index(refine.base_index))
        return faiss.IndexIDMap2(refine)
    else:
        inner = faiss.IndexHNSWFlat(cfg.dim, cfg.m, metric)
        inner.hnsw.efConstruction = cfg.ef_construction
    return faiss.IndexIDMap2(inner)  # faiss' Python wrapper keeps a reference to `inner`


def _without_polysemous_training(index: faiss.Index) -> faiss.Index:
    """IndexIVFPQ trains a polysemous code ordering by default, used only by polysemous search (``polysemous_ht``),
    which we never enable: on 12k x 16 vectors it was 25 of the 29 s of training, for identical results."""
    ivfpq = faiss.downcast_index(index)
    if isinstance(ivfpq, faiss.IndexIVFPQ):
        ivfpq.do_polysemous_training = False
    return index


def config_from_spec(spec: dict[str, Any], default_dim: int, model_id: str) -> IndexConfig:
    """The options of ``POST /index/{name}``, checked (422 naming the option); ivfpq only comes from msn-index.

    ``"type": "auto"`` starts exact and lets :mod:`msn_serve.indexes.auto` choose and re-tune the kind as the index
    grows (options ``deletes``, ``target_recall``, ``exact_below``, ``retune_growth``)."""
    allowed = {"dim", "metric", "type", "normalize", "nlist", "nprobe", "m", "ef_construction", "ef_search",
               "deletes", "target_recall", "exact_below", "retune_growth"}
    bad = sorted(set(spec) - allowed)
    if bad:
        raise unprocessable(f"unknown index option(s) {bad}; allowed: {sorted(allowed)}")
    metric = spec.get("metric", "ip")
    kind = spec.get("type", "flat")
    if metric not in ("ip", "l2"):
        raise unprocessable(f"metric must be 'ip' or 'l2', got {metric!r}")
    if kind not in ("flat", "ivf", "hnsw", "auto"):
        raise unprocessable(f"type must be 'flat', 'ivf', 'hnsw' or 'auto', got {kind!r}")
    auto_only = sorted({"deletes", "target_recall", "exact_below", "retune_growth"} & set(spec))
    if auto_only and kind != "auto":
        raise unprocessable(f"{auto_only} only apply to type 'auto'")
    ints = {}
    for key, default, lo, hi in (("dim", default_dim, 1, 65536), ("nlist", 256, 1, 1 << 20),
                                 ("nprobe", 16, 1, 1 << 20), ("m", 32, 2, 256),
                                 ("ef_construction", 80, 1, 4096), ("ef_search", 64, 1, 4096),
                                 ("exact_below", 100_000, 1, 1 << 40)):
        v = spec.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise unprocessable(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
        ints[key] = v
    floats = {}
    for key, default, lo, hi in (("target_recall", 0.95, 0.0, 1.0), ("retune_growth", 2.0, 1.1, 100.0)):
        v = spec.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo < v <= hi:
            raise unprocessable(f"{key} must be a number in ({lo}, {hi}], got {v!r}")
        floats[key] = float(v)
    normalize, deletes = spec.get("normalize", metric == "ip"), spec.get("deletes", True)
    for key, v in (("normalize", normalize), ("deletes", deletes)):
        if not isinstance(v, bool):
            raise unprocessable(f"{key} must be true or false, got {v!r}")
    if kind == "ivf" and ints["nprobe"] > ints["nlist"]:
        ints["nprobe"] = ints["nlist"]
    auto = kind == "auto"
    return IndexConfig(metric=metric, type="flat" if auto else kind, normalize=normalize, model_id=model_id,
                       auto=auto, deletes=deletes, **ints, **floats)


def recommended_nlist(n: int) -> int:
    """4*sqrt(n) rounded to a power of two (the autofaiss rule of thumb), for docs and benchmarks."""
    return 1 << max(0, round(math.log2(max(1.0, 4 * math.sqrt(n)))))


def search_params(cfg: IndexConfig, k: int, *, nprobe: int | None = None, ef_search: int | None = None,
                  k_factor: int | None = None) -> faiss.SearchParameters | None:
    """Per-call FAISS search parameters (thread-safe, unlike setting ``nprobe`` on the index) for ``cfg``'s kind,
    the config's tuned values unless overridden."""
    if cfg.type in ("ivf", "ivfpq"):
        ivf = faiss.SearchParametersIVF(nprobe=int(min(nprobe or cfg.nprobe, cfg.nlist)))
        kf = int(k_factor or cfg.k_factor)
        if cfg.type == "ivfpq" and cfg.k_factor:
            return faiss.IndexRefineSearchParameters(k_factor=float(kf), base_index_params=ivf)
        return ivf
    if cfg.type == "hnsw":
        return faiss.SearchParametersHNSW(efSearch=int(max(ef_search or cfg.ef_search, k)))
    return None
