"""Milvus Lite against FAISS in-process, through the index classes msn-serve itself uses.

Each engine holds the same N x D float32 vectors (default 10^6 x 384): a seeded Gaussian mixture (N/1000 unit-normal
centres, 0.5 noise per dimension), L2-normalised, searched by inner product; queries are corpus points perturbed by
0.1 per dimension. Both go through :class:`msn_serve.indexes.managed.ManagedIndex` (FAISS, with its fsync'd WAL)
and :class:`msn_serve.indexes.milvus.MilvusIndex` (a Milvus Lite file), so the figures are what msn-serve gets.

For each engine and kind (``hnsw``: M 32, efConstruction 80; ``ivf``: nlist 4*sqrt(N) as msn-index picks it):

- ingest: vectors/s of ``add`` in batches of 10,000 (FAISS builds HNSW and fills IVF lists while adding);
- build: the seconds after the last add until searches use the finished index (Milvus: flush, then until the
  recall at the smallest knob stops changing, see :func:`settle`; FAISS: 0, its adds are the build);
- the search knob (ef / nprobe) swept upwards on tuning queries until recall@10 against exact search reaches 0.95,
  then at that knob, on different evaluation queries: recall, batched queries/s (all in one call) and queries/s
  with one query per call;
- memory: resident set (VmRSS) of the process and of its children after ingest, and its peak (VmHWM).

Every engine/kind runs in its own process, so memory figures do not mix. The JSON goes to
``benchmarks/results/milvus_vs_faiss.json`` with the machine record.

    python -m benchmarks.serving.milvus_vs_faiss [--n 1000000] [--kinds hnsw ivf] [--engines faiss milvus]
    python -m benchmarks.serving.milvus_vs_faiss --n 20000          # a quick check
    python -m benchmarks.serving.milvus_vs_faiss --dry-run          # the plan, nothing run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, save_json

K, BATCH, TARGET = 10, 10_000, 0.95
EF = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
NPROBE = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
OUT = RESULTS / "milvus_vs_faiss.json"


def corpus(n: int, dim: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``faiss_bench.clustered``'s Gaussian-mixture vectors and perturbed-corpus queries, L2-normalised."""
    from benchmarks.serving.faiss_bench import clustered

    data, q = clustered(n, dim, queries, seed)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return data, q


def memory() -> dict[str, int]:
    """MiB resident now and at peak of this process, and now of its direct children (Milvus Lite's server, if any)."""
    def field(pid: int | str, name: str) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) // 1024
        return 0

    children = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                    children += field(p.name, "VmRSS")
            except (OSError, ValueError, IndexError):
                continue
    return {"rss_mib": field("self", "VmRSS"), "peak_rss_mib": field("self", "VmHWM"), "children_rss_mib": children}


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f[f >= 0]) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def open_index(engine: str, kind: str, dim: int, nlist: int, workdir: Path,
               compact_mb: float = 64.0) -> tuple[Any, Any]:
    """A fresh index of ``kind`` on ``engine`` (and the Milvus connection to close, or None); FAISS snapshots its
    WAL past ``compact_mb`` as msn-serve does (``--wal-compact-mb``, 64 by default)."""
    from msn_serve.indexes.config import IndexConfig

    cfg = IndexConfig(dim=dim, type=kind, metric="ip", normalize=True, nlist=nlist, m=32, ef_construction=80)
    if engine == "faiss":
        from msn_serve.indexes.managed import ManagedIndex

        idx = ManagedIndex.create(workdir / "index", cfg)
        idx.compact_bytes = int(compact_mb * 2**20)
        return idx, None
    from msn_serve.indexes.milvus import MilvusIndex
    from msn_serve.indexes.milvus_conn import MilvusConnection

    conn = MilvusConnection(str(workdir / "milvus.db"))
    return MilvusIndex.create(conn, "bench", cfg), conn


def settle(idx: Any, q: np.ndarray, truth: np.ndarray, knob: str, value: int, quiet_s: float,
           timeout: float = 3600) -> dict[str, Any]:
    """Milvus: flush, then wait until searches use the built index. Milvus Lite's ``describe_index`` says every row
    is indexed at once, yet its searches switch from exact to the index later (seen at N=20,000: IVF recall at
    nprobe 1 went from 1.0 to 0.4 after the flush): poll the recall at the smallest knob until it has not changed
    for ``quiet_s``; the index is taken as built at its last change."""
    t0 = time.perf_counter()
    idx.flush()
    last, changed = None, time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        r = recall(idx.query(q, K, **{knob: value})[1], truth)
        if r != last:
            last, changed = r, time.perf_counter()
        elif time.perf_counter() - changed >= quiet_s:
            break
        time.sleep(0.25)
    info = idx.client.describe_index(idx.collection, "vector") or {}
    return {"build_s": round(changed - t0, 2), "settled_recall_at_first_knob": round(last or 0.0, 4),
            "quiet_s": quiet_s, **{k: info[k] for k in ("index_type", "indexed_rows", "state") if k in info}}


def run_one(engine: str, kind: str, n: int, dim: int, tune_q: int, eval_q: int, single_q: int,
            compact_mb: float = 64.0) -> dict[str, Any]:
    """One engine and kind, in this process: ingest, build, tune the knob, measure."""
    import faiss

    from msn_serve.indexes.tuning import nlist_for

    data, q = corpus(n, dim, tune_q + eval_q)
    _, truth = faiss.knn(q, data, K, metric=faiss.METRIC_INNER_PRODUCT)
    tq, tt, eq, et = q[:tune_q], truth[:tune_q], q[tune_q:], truth[tune_q:]
    nlist = nlist_for(n)
    before = memory()
    with tempfile.TemporaryDirectory(prefix=f"msn-{engine}-") as tmp:
        idx, conn = open_index(engine, kind, dim, nlist, Path(tmp), compact_mb)
        try:
            ids = np.arange(n, dtype=np.int64)
            first = max(BATCH, 64 * nlist) if kind == "ivf" else BATCH  # FAISS trains IVF on its first add
            t0 = time.perf_counter()
            for lo, hi in [(0, min(n, first))] + [(s, min(n, s + BATCH)) for s in range(min(n, first), n, BATCH)]:
                idx.add(ids[lo:hi].tolist(), data[lo:hi])
            ingest_s = time.perf_counter() - t0
            knob = "ef_search" if kind == "hnsw" else "nprobe"
            knobs = [v for v in (EF if kind == "hnsw" else NPROBE) if kind == "hnsw" or v <= nlist]
            built = settle(idx, tq[:100], tt[:100], knob, knobs[0], max(3.0, n / 100_000)) \
                if engine == "milvus" else {}
            build_s = built.get("build_s", 0.0)
            after = memory()
            sweep = []
            for value in knobs:
                r = recall(idx.query(tq, K, **{knob: value})[1], tt)
                sweep.append({knob: value, "recall": round(r, 4)})
                if r >= TARGET:
                    break
            value = sweep[-1][knob]
            t0 = time.perf_counter()
            found = idx.query(eq, K, **{knob: value})[1]
            batched_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for row in eq[:single_q]:
                idx.query(row[None], K, **{knob: value})
            single_s = time.perf_counter() - t0
        finally:
            idx.close()
            if conn is not None:
                conn.close()
    return {"engine": engine, "kind": kind, "n": n, "dim": dim, "nlist": nlist if kind == "ivf" else None,
            "ingest_s": round(ingest_s, 2), "ingest_vectors_per_s": round(n / ingest_s, 1),
            "build_s": round(build_s, 2), "milvus_index": built or None, "sweep": sweep, knob: value,
            "reached_target": sweep[-1]["recall"] >= TARGET, "recall": round(recall(found, et), 4),
            "batched_qps": round(len(eq) / batched_s, 1), "single_qps": round(single_q / single_s, 1),
            "memory_before_mib": before, "memory_after_ingest_mib": after,
            "data_mib": round(data.nbytes / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--kinds", nargs="+", default=["hnsw", "ivf"], choices=["hnsw", "ivf"])
    ap.add_argument("--engines", nargs="+", default=["faiss", "milvus"], choices=["faiss", "milvus"])
    ap.add_argument("--tune-queries", type=int, default=500)
    ap.add_argument("--eval-queries", type=int, default=1000)
    ap.add_argument("--single-queries", type=int, default=200, help="queries timed one per call")
    ap.add_argument("--wal-compact-mb", type=float, default=64.0, help="FAISS: msn-serve's --wal-compact-mb")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="", help="how the machine was shared (recorded in the JSON)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # engine:kind, run in this process (the parent's child)
    a = ap.parse_args(argv)
    if a.one:
        engine, kind = a.one.split(":")
        row = run_one(engine, kind, a.n, a.dim, a.tune_queries, a.eval_queries, a.single_queries, a.wal_compact_mb)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    runs = [(e, k) for k in a.kinds for e in a.engines]
    print(f"milvus_vs_faiss: {a.n} x {a.dim}, recall@{K} >= {TARGET}; runs {runs}; -> {a.out}", flush=True)
    if a.dry_run:
        return 0
    started, rows = time.strftime("%Y-%m-%dT%H:%M:%S"), []
    for engine, kind in runs:
        cmd = [sys.executable, "-m", "benchmarks.serving.milvus_vs_faiss", "--one", f"{engine}:{kind}",
               "--n", str(a.n), "--dim", str(a.dim), "--tune-queries", str(a.tune_queries),
               "--eval-queries", str(a.eval_queries), "--single-queries", str(a.single_queries),
               "--wal-compact-mb", str(a.wal_compact_mb)]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[2])
        found = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not found:
            raise SystemExit(f"{engine}:{kind} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        rows.append(json.loads(found[0]))
        r = rows[-1]
        print(f"{engine:6} {kind:4}: ingest {r['ingest_vectors_per_s']:.0f} vec/s, build {r['build_s']} s, "
              f"recall {r['recall']} at {r['sweep'][-1]}, {r['batched_qps']:.0f} q/s batched, "
              f"{r['single_qps']:.0f} q/s single, RSS {r['memory_after_ingest_mib']}", flush=True)
        _save(a, started, rows)  # after every run: an interrupted sweep keeps what it measured
    return 0


def _save(a: argparse.Namespace, started: str, rows: list[dict[str, Any]]) -> None:
    import pymilvus

    save_json(a.out, {"note": a.note, "started": started, "n": a.n, "dim": a.dim, "k": K, "target_recall": TARGET,
                      "data": "Gaussian mixture, N/1000 centres, noise 0.5/dim, L2-normalised; queries: corpus "
                              "points + 0.1/dim noise", "through": "msn_serve ManagedIndex / MilvusIndex",
                      "wal_compact_mb": a.wal_compact_mb, "pymilvus": pymilvus.__version__,
                      "milvus_lite": _milvus_lite_version(), "runs": rows})


def _milvus_lite_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("milvus-lite")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
