"""Embed a whole image corpus with torch, sharded over torchrun ranks.

``torchrun --nproc_per_node=N -m training.bundle.embed --bundle B --data DIR|LIST --out OUT`` (plain ``python -m`` = one
process). ``msn-embed`` runs the torch-free driver (:mod:`msn_serve.corpus`, the serving engine) and hands over to
this module only for ``--backend torch`` or when torchrun starts it with several ranks. The corpus is any source of
:mod:`msn_core.sources`, as pretraining reads it; image *i* of that listing gets id *i*, so ids do not depend on the
number of ranks or on restarts. The list is cut into shards of ``--shard-size`` consecutive images and shard *s* goes
to rank ``s % world_size``; the files, their commit records, ``run.json`` and ``manifest.json`` (what ``msn-index
build`` reads) are :mod:`msn_core.corpus`'s layout, the same as the torch-free driver writes. A killed job loses at
most one shard per rank; unreadable images are skipped (no embedding, no id) and listed in the shard's JSON.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from msn_core.bundle import META_FILE, load_bundle_info
from msn_core.corpus import (
    FORMAT,
    FORMAT_VERSION,
    RunMismatch,
    bundle_fingerprint,
    check_run,
    corpus_items,
    listing_sha256,
    shard_dims,
    shard_done,
    write_manifest,
    write_shard,
)
from msn_core.sources import FILE_SOURCES, SourceError, SourceListing, list_images
from training.data import load_image, pil_to_tensor
from training.distributed import barrier, cleanup, init_distributed
from training.evaluation.features import OnnxEmbedder, TorchEmbedder
from training.views import eval_transform

log = logging.getLogger("msn.embed")
__all__ = ["FORMAT", "FORMAT_VERSION", "corpus_items", "embed_shard", "list_corpus", "main"]


# ------------------------------------------------------------------------------------------------ the corpus


def list_corpus(data: Path, source: str = "auto", image_root: Path | None = None) -> SourceListing:
    """The corpus in id order (``msn_core.sources.list_images``: the same listing pretraining reads)."""
    return list_images(source, data, image_root=image_root)


class _Images(Dataset):
    """Decodes one file to uint8 (3, S, S); a failure is returned (not raised) so the shard can count it."""

    def __init__(self, paths: list[Path], first_id: int, size: int):
        self.paths, self.first_id, self.size = paths, first_id, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str | None]:
        try:
            return self.first_id + i, pil_to_tensor(load_image(self.paths[i], self.size)), None
        except Exception as e:  # noqa: BLE001 - any undecodable file is skipped and reported, never fatal
            return self.first_id + i, None, f"{type(e).__name__}: {e}"


def _collate(batch: list) -> tuple[list[int], torch.Tensor | None, list[tuple[int, str]]]:
    good = [(i, img) for i, img, err in batch if err is None]
    bad = [(i, err) for i, _, err in batch if err is not None]
    images = torch.stack([img for _, img in good]) if good else None
    return [i for i, _ in good], images, bad


# ------------------------------------------------------------------------------------------------ embedding


def _embedder(bundle: Path, backend: str, device: str, threads: int):
    if backend == "torch":
        torch.set_num_threads(threads)
        return TorchEmbedder.from_bundle(bundle, device=device)
    return OnnxEmbedder(bundle, device=device, intra_op_threads=threads)


def embed_shard(out: Path, s: int, items: list[tuple[str, str | None, str]], first_id: int, embedder, pre: dict,
                args: argparse.Namespace, bar) -> dict:
    """Embed one shard and commit it; returns the shard record written to ``shard-SSSSS.json``."""
    crop, num_patches = int(pre["crop"]), (int(pre["crop"]) // embedder.patch_size) ** 2
    ds = _Images([Path(file) for _, _, file in items], first_id, int(pre["resize"]))
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, collate_fn=_collate)
    chunks, ids, skipped = [], [], []
    for batch_ids, images, bad in loader:
        skipped += [{"id": i, "path": items[i - first_id][0], "error": err} for i, err in bad]
        if images is not None:
            pixels = eval_transform(images, resize=int(pre["resize"]), crop=crop, mean=pre["mean"],
                                    std=pre["std"]).numpy()
            keep = np.broadcast_to(np.arange(num_patches, dtype=np.int64), (len(pixels), num_patches))
            chunks.append(np.asarray(embedder(pixels, np.ascontiguousarray(keep)), dtype=np.float32))
            ids += batch_ids
        if bar is not None:
            bar.update(len(batch_ids) + len(bad))
            bar.set_postfix(skipped=bar.skipped + len(skipped))
    for err in skipped:
        log.warning("skipping unreadable image %s (%s)", err["path"], err["error"])
    emb = np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)
    return write_shard(out, s, items, first_id, ids, emb, skipped)


# ------------------------------------------------------------------------------------------------ CLI


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="msn-embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="msn-export bundle directory")
    p.add_argument("--data", type=Path, required=True,
                   help="a folder of images (flat, nested or root/<class>/...) or a file list (.txt/.csv)")
    p.add_argument("--source", choices=list(FILE_SOURCES), default="auto",
                   help="how to read --data (msn_core/sources.py; auto: a file is a list, a folder is listed whole)")
    p.add_argument("--image-root", type=Path, help="where a file list's relative paths point (default: its folder)")
    p.add_argument("--out", type=Path, required=True, help="output directory for shards + manifest.json")
    p.add_argument("--backend", choices=["onnx", "torch"], default="onnx",
                   help="onnx = the graph msn-serve runs (default); torch = encoder.safetensors")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank via LOCAL_RANK)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=10_000, help="images per shard (the restart granularity)")
    p.add_argument("--workers", type=int, default=2, help="decoding DataLoader workers per rank")
    p.add_argument("--threads", type=int, default=0, help="inference threads per rank (0 = cores / local ranks)")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.shard_size < 1 or args.workers < 0 or args.threads < 0:
        p.error("--batch-size and --shard-size must be >= 1, --workers and --threads >= 0")
    if args.device not in ("cpu", "cuda"):
        p.error("--device must be cpu or cuda")
    if not (args.bundle / META_FILE).is_file():
        p.error(f"--bundle {args.bundle}: not an msn-export bundle (no {META_FILE})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist = init_distributed("cuda" if args.device == "cuda" else "cpu")
    try:
        return _run(args, dist)
    except RunMismatch as e:
        raise SystemExit(f"msn-embed: {e}") from None
    finally:
        cleanup()


def _run(args: argparse.Namespace, dist) -> int:
    t0 = time.perf_counter()
    try:
        listing = list_corpus(args.data, args.source, args.image_root)
    except SourceError as e:
        raise SystemExit(f"msn-embed: {e}") from None
    items = corpus_items(listing)
    info = load_bundle_info(args.bundle)
    pre = info.preprocessing.to_dict()
    run = {"model_id": info.model_id, "feature": info.feature,
           "bundle": str(args.bundle.resolve()), "bundle_sha256": bundle_fingerprint(args.bundle),
           "backend": args.backend, "source": str(args.data.resolve()), "base": str(Path(listing.base).resolve()),
           "num_files": len(items), "files_sha256": listing_sha256(items),
           "shard_size": args.shard_size,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if dist.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        check_run(args.out, run)
    barrier()
    if dist.rank != 0:
        check_run(args.out, run)  # rank 0 wrote run.json; every rank verifies it runs the same job
    n_shards = -(-len(items) // args.shard_size)
    mine = [s for s in range(n_shards) if s % dist.world_size == dist.rank]
    todo = [s for s in mine if shard_done(args.out, s, len(items[s * args.shard_size:(s + 1) * args.shard_size]))
            is None]
    log.info("rank %d/%d: %d of its %d shards to embed (%d images in total, %d shards)", dist.rank,
             dist.world_size, len(todo), len(mine), len(items), n_shards)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    bar = None
    if dist.rank == 0 and todo:
        from tqdm.auto import tqdm

        total = sum(len(items[s * args.shard_size:(s + 1) * args.shard_size]) for s in todo)
        bar = tqdm(total=total, desc=f"msn-embed rank 0/{dist.world_size}", unit="img", file=sys.stderr)
        bar.skipped = 0
    if todo:
        embedder = _embedder(args.bundle, args.backend, args.device, threads)
        for s in todo:
            lo = s * args.shard_size
            rec = embed_shard(args.out, s, items[lo:lo + args.shard_size], lo, embedder, pre, args, bar)
            if bar is not None:
                bar.skipped += len(rec["skipped"])
    if bar is not None:
        bar.close()
    barrier()
    if dist.rank == 0:
        dims = shard_dims(args.out, n_shards)
        if len(dims) != 1:
            raise SystemExit(f"msn-embed: shards disagree on the embedding size {sorted(dims)} (or none embedded)")
        m = write_manifest(args.out, run, n_shards, dims.pop(), time.perf_counter() - t0)
        print(f"msn-embed: {m['count']} embeddings (dim {m['dim']}) in {n_shards} shards, {m['skipped']} unreadable "
              f"files skipped, {m['seconds']} s -> {args.out / 'manifest.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
