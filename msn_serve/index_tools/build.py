"""``msn-index build``: turn ``msn-embed`` shards into an index that ``msn-serve`` loads (no torch here).

The index is chosen by :mod:`msn_serve.indexes.tuning`, the tuner msn-serve's auto indexes use: exact ``flat`` while
the corpus is below ``--exact-below`` (1e5) vectors and fits the memory budget; above, every candidate of
``--candidates`` that fits (IVF-Flat; fast-scan IVF-PQ re-ranked exactly, unless ``--deletes``; HNSW if asked for)
is built, its search knob tuned on held-out queries (corpus vectors not used to train the quantizer) to
``--target-recall`` recall@k against exact search, and timed; the most queries per second at the target wins.
Plain IVF-PQ with the largest code that fits is the fallback when raw vectors exceed the budget. Every candidate's
figures, the chosen parameters and query times are printed and stored in ``build_info.json`` next to the index.

The output is the :mod:`msn_serve.indexes.files` form (``config.json`` + ``index.faiss`` + ``state.npz``) in
``<data-dir>/indexes/<name>/``, written in a staging directory and swapped in (:func:`msn_core.durable.replace_dir`):
``kill -9`` at any moment leaves the old index or the new one there, never a mix (the next ``msn-index`` or
``msn-serve`` finishes an interrupted swap before it reads the folder). The corpus is read by
:func:`msn_core.corpus.load_corpus`; the command line is :mod:`msn_serve.index_tools.cli`'s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.corpus import Corpus, load_corpus
from msn_core.durable import lock_data_dir, recover_dir, replace_dir
from msn_serve.errors import NAME_RE
from msn_serve.indexes.config import IndexConfig, search_params
from msn_serve.indexes.files import write_index_dir
from msn_serve.indexes.tuning import GB, IndexChoice, choose, plans, select


class BuildError(Exception):
    """Unusable input or options; reported as one line, exit status 2."""


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


def timing(index: faiss.Index, cfg: IndexConfig, q: np.ndarray, k: int) -> dict[str, float]:
    """Batched ms/query over all queries, and single-query p50/p99 over up to 200 of them."""
    params = search_params(cfg, k)
    t0 = time.perf_counter()
    index.search(q, k, params=params)
    batch = (time.perf_counter() - t0) * 1e3 / len(q)
    single = []
    for row in q[:200]:
        t0 = time.perf_counter()
        index.search(row[None], k, params=params)
        single.append((time.perf_counter() - t0) * 1e3)
    return {"batch_ms_per_query": round(batch, 4), "single_ms_p50": round(float(np.percentile(single, 50)), 4),
            "single_ms_p99": round(float(np.percentile(single, 99)), 4)}


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
            raise BuildError(f"--data-dir needs --name matching {NAME_RE.pattern} (msn-serve's rule), "
                             f"got {args.name!r}")
        out, data_dir = args.data_dir / "indexes" / args.name, args.data_dir
    if not NAME_RE.fullmatch(out.name):
        raise BuildError(f"index name {out.name!r} must match {NAME_RE.pattern} (msn-serve's rule)")
    return out, data_dir


def build(args: argparse.Namespace) -> dict[str, Any]:
    out, data_dir = _target(args)
    recover_dir(out)  # an earlier build or migrate killed mid-swap: its index is the one there is
    if out.exists() and not args.overwrite:
        raise BuildError(f"{out} exists; pass --overwrite to replace it")
    lock = None
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        try:  # the writer holds this lock: it would neither see the new index nor expect its files to change
            lock = lock_data_dir(data_dir, owner="msn-serve")
        except OSError as e:
            raise BuildError(f"{e}: stop the writer first, then start it again to load the index") from None
    try:
        return _build_index(args, out)
    finally:
        if lock is not None:
            os.close(lock)


def _candidates(args: argparse.Namespace, n: int, d: int) -> list[IndexChoice]:
    budget = args.memory_budget_gb * GB
    try:
        if args.index_type == "auto":
            return plans(n, d, budget, exact_below=args.exact_below, deletes=args.deletes, kinds=args.candidates,
                         hnsw_m=args.hnsw_m)
        return [choose(n, d, budget, exact_below=args.exact_below, kind=args.index_type, hnsw_m=args.hnsw_m)]
    except ValueError as e:
        raise BuildError(str(e)) from None


def _build_index(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    corpus = load_corpus(args.embeddings)
    n, d, k = corpus.n, corpus.dim, args.k
    normalize = args.metric == "ip"
    candidates = _candidates(args, n, d)
    if any(p.type == "ivfpq" for p in candidates) and n < 256:
        raise BuildError(f"ivfpq needs at least 256 vectors to train its codebooks, the corpus has {n}")
    base = IndexConfig(dim=d, metric=args.metric, normalize=normalize, ef_construction=args.ef_construction,
                       model_id=str(corpus.manifest.get("model_id") or ""), target_recall=args.target_recall)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(n)
    nq = min(args.queries, n)
    queries = prepare(corpus.rows(np.sort(perm[:nq])), normalize)
    info: dict[str, Any] = {"n": n, "dim": d, "metric": args.metric, "queries": nq, "k": k,
                            "target_recall": args.target_recall, "memory_budget_gb": args.memory_budget_gb,
                            "faiss": faiss.__version__, "threads": faiss.omp_get_max_threads()}
    nlist = max(p.nlist for p in candidates)
    need = max(39 * nlist, 39 * 256 if any(p.type == "ivfpq" for p in candidates) else 0)
    held_out = n - nq >= max(nlist, 256 if any(p.type == "ivfpq" for p in candidates) else 1)
    pool = perm[nq:] if held_out else perm  # else too few vectors to train on without the queries
    # ~64 points per list (autofaiss uses ~100), the transient sample capped at max(budget / 4, 1 GB)
    ntrain = min(len(pool), max(need, 64 * nlist), int(max(args.memory_budget_gb * GB / 4, GB) // (4 * d)))
    train = prepare(corpus.rows(np.sort(pool[:ntrain])), normalize) if nlist else np.zeros((0, d), np.float32)
    info.update(train_vectors=len(train), queries_held_out=held_out)
    truth = exact_neighbours(corpus, queries, min(k, n), args.metric, normalize)
    ids = np.concatenate([shard_ids for shard_ids, _ in corpus.chunks()])

    def fill(index: faiss.Index) -> None:
        for shard_ids, vecs in corpus.chunks():
            for lo in range(0, len(vecs), 65536):
                index.add_with_ids(prepare(vecs[lo:lo + 65536], normalize), shard_ids[lo:lo + 65536])

    best, reports = select(candidates, base, train, fill, queries, truth, args.target_recall)
    index, cfg, rec = best.index, replace(best.config, tuned_at=n), best.recall
    chosen = reports[0]
    info.update(plan=chosen["plan"], candidates=reports, tuning=chosen["tuning"], recall_at_k=round(rec, 4),
                search_param=cfg.ef_search if cfg.type == "hnsw" else cfg.nprobe if cfg.type != "flat" else 0,
                build_s=chosen["build_s"], **timing(index, cfg, queries, truth.shape[1]))
    if rec < args.target_recall:
        print(f"msn-index: warning: recall@{k} {rec:.3f} < target {args.target_recall} even at the largest "
              f"setting; consider a larger budget or --index-type ivf/flat", file=sys.stderr)
    if not cfg.can_delete:
        print(f"msn-index: note: a {cfg.type}{' (re-ranked)' if cfg.k_factor else ''} index cannot delete vectors "
              "(pass --deletes to choose among kinds that can)", file=sys.stderr)
    metadata: dict[int, Any] = {}
    if args.store_paths:
        for row in corpus.paths():
            metadata[int(row["id"])] = {key: row[key] for key in ("path", "label") if row.get(key) is not None}
        info["image_base"] = corpus.manifest.get("base")  # where the paths point (msn-index migrate re-embeds them)
    info.update(config=asdict(cfg), total_s=round(time.perf_counter() - t_start, 3))
    with replace_dir(out) as staging:  # the old index stays at ``out`` until the new one replaces it
        write_index_dir(staging, asdict(cfg), index, ids, metadata, 0,
                        extra={"build_info.json": json.dumps(info, indent=1).encode()})
    info["index_file_bytes"] = (out / "index.faiss").stat().st_size
    info["out"] = str(out)
    return info
