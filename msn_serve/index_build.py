"""``msn-index build``: turn ``msn-embed`` shards into an index that ``msn-serve`` loads (no torch here).

Index choice follows autofaiss' heuristics, simplified: exact ``flat`` while the corpus is below ``--exact-below``
(1e6) vectors and fits the memory budget; above, ``ivf`` (IVF-Flat) if the raw vectors fit, else ``ivfpq`` with the
largest PQ code (bytes per vector) that fits. ``nlist`` is the power of two nearest 4·sqrt(N) (16·sqrt(N) from 1e6
vectors), capped so every list gets >= 39 training points. ``hnsw`` only on request (``--index-type``): it cannot
delete and its graph is not memory-mapped. The search-time knob (``nprobe``; ``efSearch`` for HNSW) is tuned as the
smallest value whose recall@k against exact search reaches ``--target-recall`` on held-out queries (corpus vectors
not used to train the quantizer), and stored as the index's default. Chosen parameters, measured recall and query
times are printed and stored in ``build_info.json`` next to the index.

The output is the :mod:`msn_serve.index_files` form (``config.json`` + ``index.faiss`` + ``state.npz``) in
``<data-dir>/indexes/<name>/``, written in a hidden staging directory and renamed into place.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.durable import fsync_path

from .errors import NAME_RE
from .index_config import IndexConfig, build_index
from .index_files import IVF_TYPES, write_index_dir
from .storage import lock_data_dir, remove_durably

GB = 1e9
PQ_CHOICES = (64, 48, 32, 24, 16, 12, 8, 4)
IDMAP_BYTES = 8 + 40  # IndexIDMap2: id array + reverse hash map entry (estimate)


class BuildError(Exception):
    """Unusable input or options; reported as one line, exit status 2."""


# ------------------------------------------------------------------------------------------------ reading shards


@dataclass
class Corpus:
    root: Path
    manifest: dict[str, Any]
    shards: list[dict[str, Any]]
    n: int
    dim: int

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids, float32 vectors)`` per shard, memory-mapped from the ``.npy`` files."""
        for s in self.shards:
            vecs = np.load(self.root / s["embeddings"], mmap_mode="r")
            ids = np.load(self.root / s["ids"])
            yield ids, vecs

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Vectors at sorted global positions (shard order), gathered without loading everything."""
        out, start = [], 0
        for _, vecs in self.chunks():
            sel = positions[(positions >= start) & (positions < start + len(vecs))] - start
            if sel.size:
                out.append(np.asarray(vecs[sel], dtype=np.float32))
            start += len(vecs)
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


def load_corpus(root: Path) -> Corpus:
    path = root / "manifest.json"
    if not path.is_file():
        raise BuildError(f"{root}: no manifest.json (run msn-embed to completion first)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "msn-embeddings":
        raise BuildError(f"{path}: not an msn-embed manifest")
    dim, shards, seen = int(manifest["dim"]), [s for s in manifest["shards"] if s["count"] > 0], []
    for s in shards:
        vecs = np.load(root / s["embeddings"], mmap_mode="r")
        ids = np.load(root / s["ids"])
        if vecs.ndim != 2 or vecs.shape != (s["count"], dim) or ids.shape != (s["count"],):
            raise BuildError(f"{root / s['embeddings']}: shape {vecs.shape} / ids {ids.shape}, manifest says "
                             f"({s['count']}, {dim})")
        if not np.isfinite(vecs).all():
            raise BuildError(f"{root / s['embeddings']}: contains NaN or infinity")
        seen.append(ids)
    all_ids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    if all_ids.size == 0:
        raise BuildError(f"{root}: no embeddings to index")
    if all_ids.min() < 0 or np.unique(all_ids).size != all_ids.size:
        raise BuildError(f"{root}: ids must be unique and non-negative")
    return Corpus(root, manifest, shards, int(all_ids.size), dim)


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class Plan:
    type: str
    nlist: int = 0
    pq_m: int = 0
    hnsw_m: int = 32
    bytes_estimate: int = 0
    reason: str = ""


def pow2_near(x: float) -> int:
    return 1 << max(0, round(math.log2(max(1.0, x))))


def estimate_bytes(kind: str, n: int, d: int, *, nlist: int = 0, pq_m: int = 0, hnsw_m: int = 32) -> int:
    """Resident bytes of the FAISS structure (codes + ids + coarse/PQ tables), as in docs/deploy.md's table."""
    if kind == "flat":
        return n * (4 * d + IDMAP_BYTES)
    if kind == "hnsw":
        return n * (4 * d + 8 * hnsw_m + IDMAP_BYTES)
    coarse = 4 * d * nlist
    if kind == "ivf":
        return n * (4 * d + 8) + coarse
    return n * (pq_m + 8) + coarse + 4 * d * 256  # ivfpq: code + id per vector, 8-bit codebooks


def choose(n: int, d: int, budget: float, *, exact_below: int, kind: str = "auto", hnsw_m: int = 32) -> Plan:
    cap = 1 << int(math.log2(max(1, n // 39)))  # >= 39 training points per list, still a power of two
    nlist = min(pow2_near((4 if n < 1_000_000 else 16) * math.sqrt(n)), cap, 1 << 18)
    pq = [m for m in PQ_CHOICES if d % m == 0 and m <= d]
    if kind == "auto":
        flat = estimate_bytes("flat", n, d)
        if n < exact_below and flat <= budget:
            return Plan("flat", bytes_estimate=flat, reason=f"N={n} < {exact_below} and fits the budget")
        ivf = estimate_bytes("ivf", n, d, nlist=nlist)
        if ivf <= budget:
            return Plan("ivf", nlist, bytes_estimate=ivf, reason="raw vectors fit the budget: IVF-Flat")
        for m in pq:
            b = estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m)
            if b <= budget:
                return Plan("ivfpq", nlist, m, bytes_estimate=b, reason=f"largest PQ code fitting {budget / GB:g} GB")
        raise BuildError(f"{n} x {d} vectors do not fit {budget / GB:g} GB even as PQ{pq[-1] if pq else '?'} codes")
    if kind == "ivfpq":
        if not pq:
            raise BuildError(f"no PQ code size in {PQ_CHOICES} divides dim {d}")
        fitting = [m for m in pq if estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m) <= budget] or [pq[-1]]
        m = fitting[0]
        return Plan("ivfpq", nlist, m, bytes_estimate=estimate_bytes("ivfpq", n, d, nlist=nlist, pq_m=m),
                    reason="requested")
    return Plan(kind, nlist if kind == "ivf" else 0, hnsw_m=hnsw_m, reason="requested",
                bytes_estimate=estimate_bytes(kind, n, d, nlist=nlist, hnsw_m=hnsw_m))


# ------------------------------------------------------------------------------------------------ measuring


def prepare(x: np.ndarray, normalize: bool) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if normalize:
        x = x.copy()
        if (np.linalg.norm(x, axis=1) == 0).any():
            raise BuildError("an embedding is all zeros and cannot be normalised (use --metric l2)")
        faiss.normalize_L2(x)
    return x


def exact_neighbours(corpus: Corpus, q: np.ndarray, k: int, metric: str, normalize: bool) -> np.ndarray:
    """Exact top-k ids by streaming every shard through brute force (memory: one shard at a time)."""
    heap = faiss.ResultHeap(len(q), k, keep_max=metric == "ip")
    fmetric = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    for ids, vecs in corpus.chunks():
        kk = min(k, len(vecs))
        dist, pos = faiss.knn(q, prepare(vecs, normalize), kk, metric=fmetric)
        heap.add_result(dist, ids[pos])
    heap.finalize()
    return heap.I


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(found.tolist(), truth.tolist(), strict=True)]))


def _params(kind: str, value: int):
    if kind in IVF_TYPES:
        return faiss.SearchParametersIVF(nprobe=value)
    if kind == "hnsw":
        return faiss.SearchParametersHNSW(efSearch=value)
    return None


def timing(index: faiss.Index, kind: str, value: int, q: np.ndarray, k: int) -> dict[str, float]:
    """Batched ms/query over all queries, and single-query p50/p99 over up to 200 of them."""
    t0 = time.perf_counter()
    index.search(q, k, params=_params(kind, value))
    batch = (time.perf_counter() - t0) * 1e3 / len(q)
    single = []
    for row in q[:200]:
        t0 = time.perf_counter()
        index.search(row[None], k, params=_params(kind, value))
        single.append((time.perf_counter() - t0) * 1e3)
    return {"batch_ms_per_query": round(batch, 4), "single_ms_p50": round(float(np.percentile(single, 50)), 4),
            "single_ms_p99": round(float(np.percentile(single, 99)), 4)}


def tune(index: faiss.Index, kind: str, q: np.ndarray, truth: np.ndarray, target: float,
         hi: int) -> tuple[int, float, list[dict[str, Any]]]:
    """Smallest knob value in [lo, hi] reaching ``target`` recall (doubling, then bisection); the largest if
    none does. Returns (value, recall, every measurement)."""
    k = truth.shape[1]
    lo = k if kind == "hnsw" else 1
    tried: dict[int, float] = {}

    def measure(v: int) -> float:
        if v not in tried:
            tried[v] = recall(index.search(q, k, params=_params(kind, v))[1], truth)
        return tried[v]

    v = lo
    while measure(v) < target and v < hi:
        v = min(2 * v, hi)
    if tried[v] >= target:
        below = max([u for u in tried if u < v and tried[u] < target], default=lo - 1)
        lo_v, hi_v = below + 1, v
        while lo_v < hi_v:
            mid = (lo_v + hi_v) // 2
            if measure(mid) >= target:
                hi_v = mid
            else:
                lo_v = mid + 1
        v = hi_v
    return v, tried[v], [{"value": u, "recall": round(r, 4)} for u, r in sorted(tried.items())]


# ------------------------------------------------------------------------------------------------ building


def _target(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(index directory, data directory or None) from ``--out`` or ``--data-dir`` + ``--name``."""
    if (args.out is None) == (args.data_dir is None):
        raise BuildError("give either --out DATA_DIR/indexes/NAME or --data-dir DATA_DIR --name NAME")
    if args.out is not None:
        out = args.out
        data_dir = out.parent.parent if out.parent.name == "indexes" else None
        if data_dir is None:
            print(f"msn-index: note: msn-serve loads indexes from DATA_DIR/indexes/NAME; {out} is not such a path",
                  file=sys.stderr)
    else:
        if not args.name or not NAME_RE.fullmatch(args.name):
            raise BuildError(f"--data-dir needs --name matching {NAME_RE.pattern} (msn-serve's rule), got {args.name!r}")
        out, data_dir = args.data_dir / "indexes" / args.name, args.data_dir
    if not NAME_RE.fullmatch(out.name):
        raise BuildError(f"index name {out.name!r} must match {NAME_RE.pattern} (msn-serve's rule)")
    return out, data_dir


def build(args: argparse.Namespace) -> dict[str, Any]:
    out, data_dir = _target(args)
    if out.exists() and not args.overwrite:
        raise BuildError(f"{out} exists; pass --overwrite to replace it")
    lock = None
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        try:  # the writer holds this lock: it would neither see the new index nor expect its files to change
            lock = lock_data_dir(data_dir)
        except OSError as e:
            raise BuildError(f"{e}: stop the writer first, then start it again to load the index") from None
    try:
        return _build_index(args, out)
    finally:
        if lock is not None:
            os.close(lock)


def _build_index(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    corpus = load_corpus(args.embeddings)
    n, d, k = corpus.n, corpus.dim, args.k
    normalize = args.metric == "ip"
    plan = choose(n, d, args.memory_budget_gb * GB, exact_below=args.exact_below, kind=args.index_type,
                  hnsw_m=args.hnsw_m)
    if plan.type == "ivfpq" and n < 256:
        raise BuildError(f"ivfpq needs at least 256 vectors to train its codebooks, the corpus has {n}")
    cfg = IndexConfig(dim=d, metric=args.metric, type=plan.type, normalize=normalize, nlist=max(1, plan.nlist),
                      m=plan.hnsw_m, ef_construction=args.ef_construction,
                      model_id=str(corpus.manifest.get("model_id") or ""), pq_m=plan.pq_m)
    index = build_index(cfg)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(n)
    nq = min(args.queries, n)
    queries = prepare(corpus.rows(np.sort(perm[:nq])), normalize)
    info: dict[str, Any] = {"n": n, "dim": d, "metric": args.metric, "plan": asdict(plan), "queries": nq, "k": k,
                            "target_recall": args.target_recall, "memory_budget_gb": args.memory_budget_gb,
                            "faiss": faiss.__version__, "threads": faiss.omp_get_max_threads()}
    if plan.type in IVF_TYPES:
        need = max(39 * plan.nlist, 39 * 256 if plan.type == "ivfpq" else 0)
        held_out = n - nq >= max(plan.nlist, 256 if plan.type == "ivfpq" else 1)  # else too few to train on
        pool = perm[nq:] if held_out else perm
        # ~64 points per list (autofaiss uses ~100), the transient sample capped at max(budget / 4, 1 GB)
        ntrain = min(len(pool), max(need, 64 * plan.nlist), int(max(args.memory_budget_gb * GB / 4, GB) // (4 * d)))
        t0 = time.perf_counter()
        index.train(prepare(corpus.rows(np.sort(pool[:ntrain])), normalize))
        info.update(train_vectors=ntrain, queries_held_out=held_out, train_s=round(time.perf_counter() - t0, 3))
    t0 = time.perf_counter()
    ids = []
    for shard_ids, vecs in corpus.chunks():
        for lo in range(0, len(vecs), 65536):
            index.add_with_ids(prepare(vecs[lo:lo + 65536], normalize), shard_ids[lo:lo + 65536])
        ids.append(shard_ids)
    info["add_s"] = round(time.perf_counter() - t0, 3)
    truth = exact_neighbours(corpus, queries, min(k, n), args.metric, normalize)
    if plan.type == "flat":
        value, rec = 0, recall(index.search(queries, truth.shape[1])[1], truth)
    else:
        value, rec, curve = tune(index, plan.type, queries, truth, args.target_recall,
                                 hi=plan.nlist if plan.type in IVF_TYPES else 4096)
        info["tuning"] = curve
        cfg = IndexConfig(**{**asdict(cfg), **({"nprobe": value} if plan.type in IVF_TYPES else {"ef_search": value})})
    info.update(recall_at_k=round(rec, 4), search_param=value, **timing(index, plan.type, value, queries, truth.shape[1]))
    if rec < args.target_recall:
        print(f"msn-index: warning: recall@{k} {rec:.3f} < target {args.target_recall} even at the largest "
              f"setting ({value}); consider a larger budget or --index-type ivf/flat", file=sys.stderr)
    metadata: dict[int, Any] = {}
    if args.store_paths:
        for s in corpus.shards:
            for line in (corpus.root / s["paths"]).read_text().splitlines():
                row = json.loads(line)
                metadata[int(row["id"])] = {key: row[key] for key in ("path", "label") if row.get(key) is not None}
    info.update(config=asdict(cfg), total_s=round(time.perf_counter() - t_start, 3))
    staging = out.parent / f".{out.name}.{time.time_ns()}.tmp"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_index_dir(staging, asdict(cfg), index, np.concatenate(ids), metadata, 0,
                        extra={"build_info.json": json.dumps(info, indent=1).encode()})
        if out.exists():
            remove_durably(out)
        os.rename(staging, out)
        fsync_path(out.parent)
    except BaseException:
        if staging.exists():
            remove_durably(staging)
        raise
    info["index_file_bytes"] = (out / "index.faiss").stat().st_size
    info["out"] = str(out)
    return info


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="msn-index", description="Build FAISS indexes for msn-serve from msn-embed "
                                "output (parameters chosen for a memory budget and a target recall).")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="train, fill and write an index")
    b.add_argument("--embeddings", type=Path, required=True, help="msn-embed output directory (manifest.json)")
    b.add_argument("--out", type=Path, help="DATA_DIR/indexes/NAME")
    b.add_argument("--data-dir", type=Path, help="msn-serve data directory (with --name)")
    b.add_argument("--name", help="index name (with --data-dir)")
    b.add_argument("--memory-budget-gb", type=float, default=16.0, help="RAM the index may use (default 16)")
    b.add_argument("--target-recall", type=float, default=0.95, help="recall@k to reach vs exact search")
    b.add_argument("--k", type=int, default=10, help="k for the recall measurement")
    b.add_argument("--metric", choices=["ip", "l2"], default="ip", help="ip = cosine on normalised vectors")
    b.add_argument("--index-type", choices=["auto", "flat", "ivf", "ivfpq", "hnsw"], default="auto")
    b.add_argument("--exact-below", type=int, default=1_000_000, help="flat below this many vectors (auto)")
    b.add_argument("--queries", type=int, default=1000, help="held-out queries for tuning and timing")
    b.add_argument("--hnsw-m", type=int, default=32)
    b.add_argument("--ef-construction", type=int, default=80)
    b.add_argument("--store-paths", action="store_true", help="keep each image's path/label as search metadata "
                   "(Python objects in msn-serve: ~0.2-0.5 KB per vector)")
    b.add_argument("--threads", type=int, default=0, help="FAISS OpenMP threads (0 = all cores)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--overwrite", action="store_true", help="replace an existing index directory")
    args = p.parse_args(argv)
    if not 0 < args.target_recall <= 1 or args.memory_budget_gb <= 0 or args.k < 1 or args.queries < 1:
        p.error("--target-recall must be in (0, 1], --memory-budget-gb > 0, --k and --queries >= 1")
    try:
        info = build(args)
    except BuildError as e:
        print(f"msn-index: error: {e}", file=sys.stderr)
        return 2
    plan = info["plan"]
    print(f"msn-index: {info['n']} x {info['dim']} -> {plan['type']} (nlist={plan['nlist']}, pq_m={plan['pq_m']}; "
          f"{plan['reason']}), search param {info['search_param']}, recall@{args.k} {info['recall_at_k']}, "
          f"{info['batch_ms_per_query']} ms/query batched, {info['single_ms_p50']} ms single (p50), "
          f"{info['index_file_bytes'] / 1e6:.1f} MB on disk -> {info['out']}", file=sys.stderr)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
