"""``msn-index``: the command line of :mod:`.build` (``build``) and :mod:`.migrate` (``migrate``).

Kept apart from both so that each is a library its callers (``msn-embed --index``, the tests) use without the other,
and so that the console script's target names one small module.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from msn_core.corpus import CorpusError
from msn_serve.index_tools import migrate
from msn_serve.index_tools.build import BuildError, build


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="msn-index", description="Build FAISS indexes for msn-serve from msn-embed "
                                "output (parameters chosen for a memory budget and a target recall), or migrate "
                                "one to another model.")
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
    b.add_argument("--index-type", choices=["auto", "flat", "ivf", "ivfpq", "ivfpq-rerank", "hnsw"], default="auto",
                   help="auto: tune every candidate kind, keep the most queries/s at the target recall")
    b.add_argument("--candidates", nargs="+", choices=["ivf", "ivfpq", "hnsw"], default=["ivf", "ivfpq"],
                   help="kinds auto tries above --exact-below (ivfpq = re-ranked fast-scan IVF-PQ; hnsw builds "
                        "slowly and is not memory-mapped)")
    b.add_argument("--deletes", action="store_true", help="auto: only kinds that can delete vectors (flat, ivf)")
    b.add_argument("--exact-below", type=int, default=100_000, help="flat below this many vectors (auto)")
    b.add_argument("--queries", type=int, default=1000, help="held-out queries for tuning and timing")
    b.add_argument("--hnsw-m", type=int, default=32)
    b.add_argument("--ef-construction", type=int, default=80)
    b.add_argument("--store-paths", action="store_true", help="keep each image's path/label as search metadata "
                   "(Python objects in msn-serve: ~0.2-0.5 KB per vector)")
    b.add_argument("--threads", type=int, default=0, help="FAISS OpenMP threads (0 = all cores)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--overwrite", action="store_true", help="replace an existing index directory")
    migrate.add_parser(sub)
    args = p.parse_args(argv)
    if args.command == "migrate":
        return migrate.run(args)
    if not 0 < args.target_recall <= 1 or args.memory_budget_gb <= 0 or args.k < 1 or args.queries < 1:
        p.error("--target-recall must be in (0, 1], --memory-budget-gb > 0, --k and --queries >= 1")
    try:
        info = build(args)
    except (BuildError, CorpusError) as e:
        print(f"msn-index: error: {e}", file=sys.stderr)
        return 2
    plan = info["plan"]
    print(f"msn-index: {info['n']} x {info['dim']} -> {plan['type']} (nlist={plan['nlist']}, pq_m={plan['pq_m']}; "
          f"{plan['reason']}; {len(info['candidates'])} candidate(s) tuned), search param {info['search_param']}, "
          f"recall@{args.k} {info['recall_at_k']}, "
          f"{info['batch_ms_per_query']} ms/query batched, {info['single_ms_p50']} ms single (p50), "
          f"{info['index_file_bytes'] / 1e6:.1f} MB on disk -> {info['out']}", file=sys.stderr)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
