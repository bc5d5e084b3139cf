"""``msn-embed``: embed a folder, a file list or a glob of images with an exported bundle, resumably, without torch.

``msn-embed --bundle B --data DIR|LIST|'GLOB' --out OUT [--format parquet] [--index NAME --data-dir DATA]``

The corpus is listed as pretraining lists it (:mod:`msn_core.sources`); each image is preprocessed as ``/embed``
preprocesses an upload and embedded by the runtime ``msn-serve`` would choose on this machine (``--runtime``,
``--precision``: measured, like ``msn-serve --precision auto``; the choice is recorded in ``OUT/run.json``, so a
restart uses the same one). Output: :mod:`msn_core.corpus` shards (``.npy``) committed one by one, so a killed run
restarts where it stopped; ``manifest.json`` at the end; ``embeddings.parquet`` with ``--format parquet`` (needs
pyarrow); with ``--index NAME --data-dir DATA`` an index ``msn-serve --data-dir DATA`` loads as it is
(``msn-index build``, paths kept for ``msn-index migrate``).

``--backend torch`` (the bundle's ``encoder.safetensors``) and a start by torchrun with several ranks (WORLD_SIZE >
1) hand over to ``python -m training.bundle.embed`` (the training install), which writes the same layout; this
module itself never imports torch.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from msn_core.bundle import META_FILE, BundleError, load_bundle_info
from msn_core.corpus import (
    RunMismatch,
    bundle_fingerprint,
    check_run,
    corpus_items,
    listing_sha256,
    recorded_run,
    shard_dims,
    shard_slices,
    write_manifest,
)
from msn_core.gpu import CudaUnavailable
from msn_core.inference import available_cpus
from msn_core.optional import missing
from msn_core.sources import FILE_SOURCES, SourceError, list_images
from msn_serve.corpus.embed import embed_shards, pending_shards
from msn_serve.corpus.output import PARQUET_FILE, parquet_missing, write_parquet
from msn_serve.corpus.progress import Progress
from msn_serve.errors import NAME_RE

log = logging.getLogger("msn_serve.corpus")

MAX_IMAGE_PIXELS = 40_000_000  # msn-serve's default max_image_pixels
# Options of this driver only: refused (when changed from their defaults) where the torch driver takes over.
TORCH_ONLY = ("--format", "--index", "--data-dir", "--limit", "--runtime", "--precision", "--max-image-pixels",
              "--index-type", "--overwrite-index", "--index-backend", "--milvus-uri")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msn-embed", description="Embed a folder, a file list or a glob of images "
                                "with an exported bundle, resumably, without torch.")
    p.add_argument("--bundle", type=Path, required=True, help="msn-export bundle directory")
    p.add_argument("--data", required=True, help="a folder of images (flat, nested or root/<class>/...), a file "
                   "list (.txt/.csv) or a quoted glob pattern ('photos/**/*.jpg')")
    p.add_argument("--source", choices=list(FILE_SOURCES), default="auto",
                   help="how to read --data (msn_core/sources.py; auto: a file is a list, a folder is listed whole, "
                        "a pattern is a glob)")
    p.add_argument("--image-root", type=Path, help="where a file list's relative paths point (default: its folder)")
    p.add_argument("--out", type=Path, required=True, help="output directory for shards + manifest.json")
    p.add_argument("--backend", choices=["onnx", "torch"], default="onnx",
                   help="onnx = the graph msn-serve runs (default, no torch); torch = encoder.safetensors "
                        "(training install)")
    p.add_argument("--runtime", choices=["auto", "onnxruntime", "openvino"], default="auto",
                   help="as msn-serve --runtime; auto measures (default)")
    p.add_argument("--precision", choices=["auto", "fp32", "int8", "bf16"], default="auto",
                   help="as msn-serve --precision; auto measures the gated candidates (default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=10_000, help="images per shard (the restart granularity)")
    p.add_argument("--workers", type=int, default=None,
                   help="decoding threads (default: the CPUs this process may use)")
    p.add_argument("--threads", type=int, default=0, help="inference threads (0 = the CPUs this process may use)")
    p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help="larger images are skipped, as msn-serve refuses them (default 40e6)")
    p.add_argument("--limit", type=int, default=0, help="embed only the first N images of the listing (trying out)")
    p.add_argument("--format", choices=["npy", "parquet"], default="npy",
                   help=f"npy: the shards only; parquet: also {PARQUET_FILE} (id, path, label, embedding; pyarrow)")
    p.add_argument("--index", metavar="NAME", help="also build index NAME in --data-dir for msn-serve")
    p.add_argument("--data-dir", type=Path, help="msn-serve's data directory (with --index)")
    p.add_argument("--index-type", choices=["auto", "flat", "ivf", "ivfpq", "ivfpq-rerank", "hnsw"], default="auto",
                   help="as msn-index build --index-type")
    p.add_argument("--index-paths", action=argparse.BooleanOptionalAction, default=True,
                   help="keep each image's path as search metadata (msn-index migrate re-embeds from it)")
    p.add_argument("--overwrite-index", action="store_true", help="replace an existing index NAME")
    p.add_argument("--index-backend", choices=["faiss", "milvus"], default="faiss",
                   help="milvus: write the index into a Milvus collection instead (msn-serve's backend 'milvus'; "
                        "pip install 'msn[milvus]')")
    p.add_argument("--milvus-uri", help="with --index-backend milvus: Milvus Lite PATH.db or server URL (default "
                   "DATA_DIR/milvus.db, as msn-serve)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.shard_size < 1 or (args.workers or 0) < 0 or args.threads < 0 or args.limit < 0:
        p.error("--batch-size and --shard-size must be >= 1, --workers, --threads and --limit >= 0")
    if args.max_image_pixels < 1:
        p.error("--max-image-pixels must be >= 1")
    if not (args.bundle / META_FILE).is_file():
        p.error(f"--bundle {args.bundle}: not an msn-export bundle (no {META_FILE})")
    if (args.index is None) != (args.data_dir is None):
        p.error("--index NAME and --data-dir DIR go together")
    if args.index is not None:
        if not NAME_RE.fullmatch(args.index):
            p.error(f"--index {args.index!r} must match {NAME_RE.pattern} (msn-serve's rule for index names)")
        if args.index_backend == "faiss" and (args.data_dir / "indexes" / args.index).exists() and \
                not args.overwrite_index:
            p.error(f"index {args.index} exists in {args.data_dir}; pass --overwrite-index to replace it")
    if args.format == "parquet" and (why := parquet_missing()):
        p.error(why)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if args.backend == "torch" or world > 1:
        return _hand_over(p, args, argv, world)
    _check(p, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (SourceError, BundleError, RunMismatch, OSError, CudaUnavailable) as e:  # OSError: e.g. --out not writable
        sys.exit(f"msn-embed: {e}")


def _hand_over(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], world: int) -> int:
    """Replace this process by the torch driver (torchrun's rank environment is kept), with the options it has."""
    why = "--backend torch" if args.backend == "torch" else f"torchrun with {world} ranks"
    unsupported = [flag for flag in TORCH_ONLY if getattr(args, flag[2:].replace("-", "_")) != p.get_default(
        flag[2:].replace("-", "_"))]
    if unsupported:
        p.error(f"{', '.join(unsupported)}: not available with {why} (the torch driver); run msn-embed with one "
                "process and the default backend, or msn-index build on its output")
    problem = missing("torch", why) or missing("training", why)
    if problem:
        sys.exit(f"msn-embed: {problem}; the default backend needs no torch")
    command = [sys.executable, "-m", "training.bundle.embed", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return 1  # not reached


def _engine(args: argparse.Namespace, info, recorded: dict | None):
    """The engine msn-serve would run, and its name for ``run.json`` (a restart of the same bundle's run asks for the
    recorded one, so its vectors come from the same runtime)."""
    from msn_serve.embedding.choice import Request, choose_engine
    from msn_serve.embedding.engine import Engine

    if args.device == "cuda":
        engine = Engine(info, device="cuda", intra_op_threads=args.threads, cache_dir=args.out)
        return engine, f"{engine.runtime}/{engine.precision}@{engine.device}"
    runtime, precision = args.runtime, args.precision
    backend = recorded.get("backend", "") if recorded else ""
    if "/" in backend and "@" not in backend and runtime == "auto" and precision == "auto":
        runtime, precision = backend.split("/", 1)  # the runtime the run started with: same vectors
    request = Request(precision=precision, runtime=runtime, threads=args.threads, max_batch_size=args.batch_size)
    try:
        engine, choice = choose_engine(info, request, cache_dir=args.out)
    except ValueError as e:
        sys.exit(f"msn-embed: {e}")
    log.info("runtime %s/%s (%s)", choice.runtime, choice.precision, choice.how)
    return engine, f"{choice.runtime}/{choice.precision}"


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    listing = list_images(args.source, args.data, image_root=args.image_root)
    items = corpus_items(listing)
    if args.limit:
        items = items[:args.limit]
    info = load_bundle_info(args.bundle)
    args.out.mkdir(parents=True, exist_ok=True)
    fingerprint = bundle_fingerprint(args.bundle)
    recorded = recorded_run(args.out)
    if recorded is not None and recorded.get("bundle_sha256") != fingerprint:
        recorded = None  # another bundle's run: check_run below refuses it, naming what differs
    todo = pending_shards(args.out, len(items), args.shard_size)
    engine = None
    if todo or recorded is None:
        engine, backend = _engine(args, info, recorded)
    else:
        backend = recorded["backend"]  # every shard is committed: only the manifest (and outputs) are left
    run_record = {"model_id": info.model_id, "feature": info.feature, "bundle": str(args.bundle.resolve()),
                  "bundle_sha256": fingerprint, "backend": backend,
                  "source": os.path.abspath(args.data), "base": str(Path(listing.base).resolve()),
                  "num_files": len(items), "files_sha256": listing_sha256(items), "shard_size": args.shard_size,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    check_run(args.out, run_record)
    n_shards = len(shard_slices(len(items), args.shard_size))
    log.info("%s; %d of %d shards to embed with %s", listing.describe(), len(todo), n_shards, backend)
    if todo:
        slices = shard_slices(len(items), args.shard_size)
        progress = Progress(sum(slices[s][1] - slices[s][0] for s in todo))
        try:
            embed_shards(args.out, items, todo, engine, shard_size=args.shard_size, batch_size=args.batch_size,
                         workers=args.workers or available_cpus(), max_pixels=args.max_image_pixels,
                         progress=progress)
        finally:
            progress.close()
    dims = shard_dims(args.out, n_shards)
    if len(dims) != 1:
        sys.exit(f"msn-embed: no image of {args.data} could be embedded (see the warnings above)" if not dims else
                 f"msn-embed: shards disagree on the embedding size {sorted(dims)}")
    m = write_manifest(args.out, run_record, n_shards, dims.pop(), time.perf_counter() - t0)
    print(f"msn-embed: {m['count']} embeddings (dim {m['dim']}) in {n_shards} shards, {m['skipped']} unreadable "
          f"files skipped, {m['seconds']} s, {backend} -> {args.out / 'manifest.json'}", file=sys.stderr)
    if args.format == "parquet":
        path = write_parquet(args.out, m)
        print(f"msn-embed: wrote {path}", file=sys.stderr)
    if args.index is not None:
        return _build_index(args)
    return 0


def _build_index(args: argparse.Namespace) -> int:
    if args.index_backend == "milvus":
        return _milvus_index(args)
    from msn_serve.index_tools import cli as msn_index

    cmd = ["build", "--embeddings", str(args.out), "--data-dir", str(args.data_dir), "--name", args.index,
           "--index-type", args.index_type]
    cmd += ["--store-paths"] if args.index_paths else []
    cmd += ["--overwrite"] if args.overwrite_index else []
    rc = msn_index.main(cmd)
    if rc != 0:
        print(f"msn-embed: the embeddings in {args.out} are complete; build the index again with msn-index "
              + " ".join(cmd), file=sys.stderr)
    return rc


def _milvus_index(args: argparse.Namespace) -> int:
    import json

    from msn_serve.corpus.to_milvus import shards_to_milvus
    from msn_serve.index_tools.milvus_copy import CopyError

    try:
        out = shards_to_milvus(args.out, args.data_dir, args.index, args.milvus_uri or str(args.data_dir / "milvus.db"),
                               index_type=args.index_type, store_paths=args.index_paths, overwrite=args.overwrite_index)
    except (CopyError, ValueError) as e:  # MilvusUnavailable is a ValueError
        print(f"msn-embed: {e}; the embeddings in {args.out} are complete: run msn-embed again to retry the index",
              file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
