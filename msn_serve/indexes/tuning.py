"""Choosing and tuning an index for a set of vectors: one tuner for ``msn-index build`` and msn-serve's auto indexes.

1. :func:`plans` lists the candidates for N vectors of dimension D within a memory budget: exact ``flat`` below
   ``exact_below`` vectors; above, IVF-Flat and, where the index need not delete (FAISS cannot remove from them),
   IVF-PQ with exact re-ranking and HNSW; plain IVF-PQ (no raw vectors kept) only when the raw vectors do not fit.
2. :func:`evaluate` builds one candidate (its quantizer trained on vectors that exclude the held-out queries), then
   tunes its search knob on the held-out queries: the smallest ``nprobe`` (``efSearch`` for HNSW; for re-ranked
   IVF-PQ, ``nprobe`` at each re-ranking factor) whose recall@k against exact search reaches the target, and
   measures batched queries per second there.
3. :func:`select` keeps the candidate with the most queries per second among those reaching the target recall (the
   best recall if none does) and reports every candidate's figures and memory.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import faiss
import numpy as np

from msn_serve.indexes.config import IndexConfig, build_index, search_params

__all__ = ["IndexChoice", "Tuned", "choose", "estimate_bytes", "evaluate", "index_bytes", "nlist_for", "plans",
           "recall", "select", "tune_knob"]

GB = 1e9
PQ_CHOICES = (64, 48, 32, 24, 16, 12, 8, 4)
IDMAP_BYTES = 8 + 40  # IndexIDMap2: id array + reverse hash map entry (estimate)
K_FACTORS = (2, 4, 8, 16, 32)  # re-ranked IVF-PQ: candidates re-ranked per result


@dataclass
class IndexChoice:
    """One candidate index: its FAISS kind and sizes, estimated memory and why it is a candidate. Not called a
    plan (the project's word for a pretraining recipe); reports and ``build_info.json`` keep the key ``plan`` for it."""

    type: str
    nlist: int = 0
    pq_m: int = 0
    hnsw_m: int = 32
    k_factor: int = 0
    fastscan: bool = False
    bytes_estimate: int = 0
    reason: str = ""


def pow2_near(x: float) -> int:
    return 1 << max(0, round(math.log2(max(1.0, x))))


def nlist_for(n: int) -> int:
    """4*sqrt(N) as a power of two, with >= 39 training points per list. (autofaiss goes to 16*sqrt(N) from 1e6
    vectors; on a few CPU cores the 4x larger coarse quantizer cost more per query than the shorter lists saved.)"""
    cap = 1 << int(math.log2(max(1, n // 39)))
    return min(pow2_near(4 * math.sqrt(n)), cap, 1 << 18)


def fastscan_m(d: int) -> int:
    """4-bit fast-scan PQ: about 2 dimensions per sub-quantizer, a multiple of 2 dividing D (fast-scan packs
    codes in pairs)."""
    for m in range(max(2, d // 2), 1, -1):
        if d % m == 0 and m % 2 == 0:
            return m
    return 2


def estimate_bytes(kind: str, n: int, d: int, *, nlist: int = 0, pq_m: int = 0, hnsw_m: int = 32,
                   k_factor: int = 0, fastscan: bool = False) -> int:
    """Resident bytes of the FAISS structure (codes + ids + coarse/PQ tables), as in docs/deploy.md's table."""
    if kind == "flat":
        return n * (4 * d + IDMAP_BYTES)
    if kind == "hnsw":
        return n * (4 * d + 8 * hnsw_m + IDMAP_BYTES)
    coarse = 4 * d * nlist
    if kind == "ivf":
        return n * (4 * d + 8) + coarse
    code = pq_m / 2 if fastscan else pq_m
    books = 4 * d * (16 if fastscan else 256)
    if k_factor:  # IndexRefineFlat keeps the raw vectors, IDMap2 the ids
        return int(n * (code + 8 + 4 * d + IDMAP_BYTES) + coarse + books)
    return int(n * (code + 8) + coarse + books)


def plans(n: int, d: int, budget: float, *, exact_below: int, deletes: bool = True,
          kinds: Sequence[str] = ("ivf", "ivfpq", "hnsw"), hnsw_m: int = 32) -> list[IndexChoice]:
    """Candidates for N x D vectors within ``budget`` bytes (see the module docstring)."""
    flat = estimate_bytes("flat", n, d)
    if n < exact_below and flat <= budget:
        return [IndexChoice("flat", bytes_estimate=flat, reason=f"N={n} < {exact_below}: exact search")]
    nlist, out = nlist_for(n), []
    if "ivf" in kinds and (b := estimate_bytes("ivf", n, d, nlist=nlist)) <= budget:
        out.append(IndexChoice("ivf", nlist, bytes_estimate=b, reason="IVF-Flat"))
    if not deletes:
        m = fastscan_m(d)
        if "ivfpq" in kinds and (b := estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m, k_factor=1,
                                                     fastscan=True)) <= budget:
            out.append(IndexChoice("ivfpq", nlist, m, k_factor=1, fastscan=True, bytes_estimate=b,
                            reason=f"IVF-PQ{m}x4 fast-scan, re-ranked exactly"))
        if "hnsw" in kinds and (b := estimate_bytes("hnsw", n, d, hnsw_m=hnsw_m)) <= budget:
            out.append(IndexChoice("hnsw", hnsw_m=hnsw_m, bytes_estimate=b, reason=f"HNSW{hnsw_m}"))
    if not out:
        for m in (m for m in PQ_CHOICES if d % m == 0 and m <= d):
            if (b := estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m)) <= budget:
                return [IndexChoice("ivfpq", nlist, m, bytes_estimate=b,
                             reason=f"raw vectors exceed {budget / GB:g} GB: largest PQ code that fits")]
        raise ValueError(f"{n} x {d} vectors do not fit {budget / GB:g} GB even as the smallest PQ code")
    return out


def choose(n: int, d: int, budget: float, *, exact_below: int, kind: str = "auto", hnsw_m: int = 32) -> IndexChoice:
    """One candidate: ``auto`` -> the first of :func:`plans` (what memory alone decides); else ``kind``."""
    if kind == "auto":
        return plans(n, d, budget, exact_below=exact_below, hnsw_m=hnsw_m)[0]
    nlist = nlist_for(n)
    if kind == "ivfpq":
        pq = [m for m in PQ_CHOICES if d % m == 0 and m <= d]
        if not pq:
            raise ValueError(f"no PQ code size in {PQ_CHOICES} divides dim {d}")
        m = next((m for m in pq if estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m) <= budget), pq[-1])
        return IndexChoice("ivfpq", nlist, m, bytes_estimate=estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m),
                    reason="requested")
    if kind == "ivfpq-rerank":
        m = fastscan_m(d)
        return IndexChoice("ivfpq", nlist, m, k_factor=1, fastscan=True, reason="requested",
                           bytes_estimate=estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m, k_factor=1, fastscan=True))
    return IndexChoice(kind, nlist if kind == "ivf" else 0, hnsw_m=hnsw_m, reason="requested",
                bytes_estimate=estimate_bytes(kind, n, d, nlist=nlist, hnsw_m=hnsw_m))


def config_for(choice: IndexChoice, base: IndexConfig) -> IndexConfig:
    return replace(base, type=choice.type, nlist=max(1, choice.nlist or base.nlist), pq_m=choice.pq_m,
                   m=choice.hnsw_m, k_factor=choice.k_factor, fastscan=choice.fastscan)


# ------------------------------------------------------------------------------------------------ measuring


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(found.tolist(), truth.tolist(), strict=True)]))


def tune_knob(measure: Callable[[int], float], target: float, lo: int, hi: int) -> tuple[int, float, dict[int, float]]:
    """Smallest value in [lo, hi] whose ``measure`` (recall) reaches ``target``: doubling, then bisection; the
    largest value if none does. Returns (value, recall, every measurement)."""
    tried: dict[int, float] = {}

    def at(v: int) -> float:
        if v not in tried:
            tried[v] = measure(v)
        return tried[v]

    v = lo
    while at(v) < target and v < hi:
        v = min(2 * v, hi)
    if tried[v] >= target:
        lo_v = max([u for u in tried if u < v and tried[u] < target], default=lo - 1) + 1
        hi_v = v
        while lo_v < hi_v:
            mid = (lo_v + hi_v) // 2
            if at(mid) >= target:
                hi_v = mid
            else:
                lo_v = mid + 1
        v = hi_v
    return v, tried[v], tried


def qps(index: faiss.Index, q: np.ndarray, k: int, params: faiss.SearchParameters | None) -> float:
    """Batched queries per second over all of ``q`` (after a short warm-up)."""
    index.search(q[: min(len(q), 32)], k, params=params)
    t0 = time.perf_counter()
    index.search(q, k, params=params)
    return len(q) / max(time.perf_counter() - t0, 1e-9)


def index_bytes(index: faiss.Index) -> int:
    """Serialized size of the FAISS structure: what it occupies in memory, give or take the id hash map."""
    return int(faiss.serialize_index(index).size)


@dataclass
class Tuned:
    config: IndexConfig
    index: faiss.Index
    recall: float
    qps: float
    curve: list[dict[str, Any]] = field(default_factory=list)
    build_s: float = 0.0

    def report(self, choice: IndexChoice) -> dict[str, Any]:
        c = self.config
        knobs = {"ef_search": c.ef_search} if c.type == "hnsw" else {"nprobe": c.nprobe} if c.type != "flat" else {}
        if c.k_factor:
            knobs["k_factor"] = c.k_factor
        return {"plan": asdict(choice), **knobs, "recall": round(self.recall, 4), "qps": round(self.qps, 1),
                "memory_bytes": index_bytes(self.index), "build_s": round(self.build_s, 2), "tuning": self.curve}


def evaluate(choice: IndexChoice, base: IndexConfig, train: np.ndarray, fill: Callable[[faiss.Index], None],
             q: np.ndarray, truth: np.ndarray, target: float) -> Tuned:
    """Build ``choice`` (train on ``train``, ``fill`` adds every vector), tune it on ``q`` against ``truth``."""
    k = truth.shape[1]
    cfg = config_for(choice, base)
    t0 = time.perf_counter()
    index = build_index(cfg)
    if choice.type not in ("flat", "hnsw"):
        index.train(train)
    fill(index)
    build_s = time.perf_counter() - t0
    if choice.type == "flat":
        found = index.search(q, k)[1]
        return Tuned(cfg, index, recall(found, truth), qps(index, q, k, None), [], build_s)
    best: Tuned | None = None
    for kf in (K_FACTORS if choice.k_factor else (0,)):
        trial = replace(cfg, k_factor=kf)
        knob = "ef_search" if choice.type == "hnsw" else "nprobe"

        def measure(v: int, trial: IndexConfig = trial, knob: str = knob) -> float:
            return recall(index.search(q, k, params=search_params(replace(trial, **{knob: v}), k))[1], truth)

        lo, hi = (k, 4096) if choice.type == "hnsw" else (1, cfg.nlist)
        value, rec, tried = tune_knob(measure, target, lo, hi)
        tuned = replace(trial, **{knob: value})
        speed = qps(index, q, k, search_params(tuned, k))
        curve = [{knob: v, **({"k_factor": kf} if kf else {}), "recall": round(r, 4)} for v, r in sorted(tried.items())]
        candidate = Tuned(tuned, index, rec, speed, curve, build_s)
        if best is None or _better(candidate, best, target):
            best = candidate
    assert best is not None
    return best


def _better(a: Tuned, b: Tuned, target: float) -> bool:
    """More queries per second among those reaching the target; otherwise the better recall."""
    if (a.recall >= target) != (b.recall >= target):
        return a.recall >= target
    return a.qps > b.qps if a.recall >= target else a.recall > b.recall


def select(candidates: Sequence[IndexChoice], base: IndexConfig, train: np.ndarray, fill: Callable[[faiss.Index], None],
           q: np.ndarray, truth: np.ndarray, target: float) -> tuple[Tuned, list[dict[str, Any]]]:
    """Evaluate every candidate; return the best and every candidate's report (best first)."""
    best, best_choice, reports = None, None, []
    for choice in candidates:
        tuned = evaluate(choice, base, train, fill, q, truth, target)
        reports.append(tuned.report(choice))
        if best is None or _better(tuned, best, target):
            best, best_choice = tuned, choice
        else:
            del tuned  # keep one built candidate in memory at a time
    assert best is not None and best_choice is not None
    reports.sort(key=lambda r: r["plan"] != asdict(best_choice))
    return best, reports
