"""``msn-eval``: low-shot, kNN, linear-probe and masking-robustness evaluation of an exported bundle.

    msn-eval lowshot --bundle bundles/demo --data fashion-mnist --shots 1 2 5 --splits 3 [--lambd-sweep]
    msn-eval lowshot --bundle bundles/b16 --data /data/imagenet --subset-file splits/in1k_1percent.txt
    msn-eval knn --bundle bundles/demo --data fashion-mnist [--k 20]
    msn-eval linear --bundle bundles/demo --data fashion-mnist
    msn-eval robustness --bundle bundles/demo --data fashion-mnist --ratios 0.15 0.3 0.5 0.7 0.9

``--data`` is ``fashion-mnist``, ``synthetic``, or labelled images (``msn_core/sources.py``): a folder with ``train/``
and ``val/`` (or ``test/``) subfolders, each ``<class>/<image>``, or one labelled folder or file list (``path label``
lines, or CSV ``path,label``) for the training images with ``--test-data`` naming the test images the same way:

    msn-eval knn --bundle B --data train.csv --test-data test.csv [--image-root DIR]

``--untrained [SEED]`` (every subcommand, any backend but pixels) scores the untrained control instead of the
bundle's weights: a random init (``torch.manual_seed(SEED)``, default 0) of the bundle's architecture, exported with
its preprocessing and feature (``training/evaluation/untrained.py``, kept under ``CACHE_DIR/untrained/``), measured
the same way; what MSN's training added is the difference:

    msn-eval lowshot --bundle bundles/demo --data fashion-mnist --shots 1 2 5 --splits 3 --untrained
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from msn_core.bundle import BundleError, load_bundle_info
from msn_core.features import FEATURE_PATTERNS
from msn_core.sources import (
    MEMORY_SOURCES,
    SPLIT_FOLDERS,
    SourceError,
    SourceListing,
    list_images,
    relabel,
)
from training.evaluation import splits as split_files
from training.evaluation.features import (
    BACKENDS,
    Features,
    bundle_fingerprint,
    extract_features,
    load_embedder,
)
from training.evaluation.knn import DEFAULT_K, DEFAULT_TEMPERATURE, knn_accuracy
from training.evaluation.linear_probe import train_linear_probe
from training.evaluation.lowshot import DEFAULT_LAMBD, LAMBD_SWEEP, LowShotResult, summarize
from training.evaluation.robustness import DEFAULT_RATIOS, masked_lowshot, similarity_by_ratio
from training.evaluation.untrained import untrained_twin

REPO_SPLITS = split_files.REPO_SPLITS
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "msn-eval"


@dataclass
class Context:
    """What every subcommand needs: the embedder, the bundle's preprocessing and the cache settings."""

    args: argparse.Namespace
    embedder: object
    preprocessing: dict
    cache_tag: str
    weights: str = "trained"  # or "untrained (random init, seed N)"
    untrained_bundle: Path | None = None  # the twin that was measured instead of --bundle
    _scratch: object = None  # keeps a --no-cache twin's temporary directory alive

    def dataset(self, split: str):
        """``split`` is ``train`` or ``test``; decoded at the resize size."""
        from training.data import ImageListDataset, build_dataset

        data, load_size = self.args.data, int(self.preprocessing["resize"])
        if data in MEMORY_SOURCES and not Path(data).exists():
            size = self.args.synthetic_size if split == "train" else max(1, self.args.synthetic_size // 2)
            return build_dataset(data, root=self.args.data_root, split=split, load_size=load_size,
                                 synthetic_size=size)
        return ImageListDataset(labelled_listing(self.args, split), load_size=load_size)

    def embed(self, dataset, indices=None, *, mask_ratio: float = 0.0, desc: str = "embedding") -> Features:
        a = self.args
        return extract_features(dataset, self.embedder, preprocessing=self.preprocessing, indices=indices,
                                batch_size=a.batch_size, mask_ratio=mask_ratio, mask_seed=a.mask_seed,
                                cache_dir=None if a.no_cache else a.cache_dir, cache_tag=self.cache_tag,
                                num_workers=a.workers, progress=not a.no_progress, desc=desc)

    def train_features(self) -> Features:
        """All training images, or the first ``--max-train`` (kNN and linear probe)."""
        train = self.dataset("train")
        limit = self.args.max_train
        return self.embed(train, None if not limit else np.arange(min(limit, len(train))), desc="train")

    def test_features(self) -> Features:
        test = self.dataset("test")
        limit = self.args.max_test
        return self.embed(test, None if not limit else np.arange(min(limit, len(test))), desc="test")


def labelled_listing(args: argparse.Namespace, split: str) -> SourceListing:
    """The labelled images of ``split``: ``--data`` (its ``train/`` when it has one) for ``train``; ``--test-data``,
    else ``--data``'s ``val/`` or ``test/``, for ``test``, with labels mapped onto the training classes by name."""
    data = Path(args.data)
    train = _require_labels(list_images(args.source, data, split="train", image_root=args.image_root))
    if split == "train":
        return train
    if args.test_data is not None:
        test = list_images(args.source, args.test_data, split="test", image_root=args.image_root)
    elif data.is_dir() and any((data / name).is_dir() for name in SPLIT_FOLDERS["test"]):
        test = list_images(args.source, data, split="test", image_root=args.image_root)
    else:
        raise SourceError(f"--data {data}: no test images; give --test-data (a labelled folder or file list) or "
                          "use a folder with train/ and val/ subfolders")
    return relabel(_require_labels(test), train.classes)


def _require_labels(listing: SourceListing) -> SourceListing:
    if not listing.labelled:
        raise SourceError(f"evaluation needs labels, but found {listing.describe()}: use class folders "
                          "(root/<class>/<image>, --source image_folder for deeper layouts) or a file list with "
                          "labels (path label, or CSV path,label)")
    return listing


def make_context(args: argparse.Namespace) -> Context:
    try:
        preprocessing = load_bundle_info(args.bundle).preprocessing.to_dict()
    except BundleError as e:
        raise SystemExit(f"msn-eval: {e}") from None
    if args.backend != "pixels" and args.device == "cpu" and args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.untrained is None:
        embedder = load_embedder(args.bundle, args.backend, feature=args.feature, device=args.device,
                                 threads=args.threads)
        if args.backend == "pixels":
            return Context(args, embedder, preprocessing, "pixels", weights="none (raw pixels)")
        return Context(args, embedder, preprocessing, bundle_fingerprint(args.bundle))
    if args.backend == "pixels":
        raise SystemExit("msn-eval: --untrained scores a random-init trunk; raw pixels have no weights")
    # the twin: its own bundle directory, so its own fingerprint and embedding-cache key (and a prefix that says so);
    # with --no-cache it lives in a temporary directory for this run
    scratch = tempfile.TemporaryDirectory(prefix="msn-eval-untrained-") if args.no_cache else None
    try:
        twin = untrained_twin(args.bundle, args.untrained, scratch.name if scratch else args.cache_dir)
    except RuntimeError as e:
        raise SystemExit(f"msn-eval: {e}") from None
    embedder = load_embedder(twin, args.backend, feature=args.feature, device=args.device, threads=args.threads)
    tag = f"untrained-seed{args.untrained}:{bundle_fingerprint(twin)}"
    return Context(args, embedder, preprocessing, tag, weights=f"untrained (random init, seed {args.untrained})",
                   untrained_bundle=None if scratch else twin, _scratch=scratch)


# --------------------------------------------------------------------------------------------------- subsets


def lowshot_subsets(ctx: Context, train) -> dict[str, list[np.ndarray]]:
    """``{setting: [indices of split 1, ...]}`` from ``--subset-file`` or the shipped / seeded splits."""
    args = ctx.args
    if args.subset_file:
        return {Path(f).stem: [split_files.resolve_subset(f, train)] for f in args.subset_file}
    return split_files.standard_subsets(train, args.data, shots=args.shots, splits=args.splits,
                                        shipped=REPO_SPLITS)


def _gather(features: Features, subsets: dict[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray, dict]:
    """Re-index subsets (dataset indices) onto rows of ``features`` extracted for their union."""
    row = {int(i): r for r, i in enumerate(features.indices)}
    remapped = {k: [np.array([row[int(i)] for i in idx]) for idx in v] for k, v in subsets.items()}
    return features.features, features.labels, remapped


def _union(subsets: dict[str, list[np.ndarray]]) -> np.ndarray:
    return np.unique(np.concatenate([idx for v in subsets.values() for idx in v]))


# ------------------------------------------------------------------------------------------------- commands


def _lowshot_rows(results: Sequence[LowShotResult], **extra) -> list[dict]:
    return [{**extra, "setting": r.setting, "lambd": r.lambd, "mean": r.mean, "std": r.std,
             "splits": len(r.accuracies), "accuracies": r.accuracies, "fit_seconds": r.fit_seconds}
            for r in results]


def run_lowshot(ctx: Context) -> list[dict]:
    args = ctx.args
    train = ctx.dataset("train")
    subsets = lowshot_subsets(ctx, train)
    train_feats = ctx.embed(train, _union(subsets), mask_ratio=args.train_mask_ratio, desc="labelled")
    x, y, remapped = _gather(train_feats, subsets)
    test = ctx.test_features()
    lambdas = LAMBD_SWEEP if args.lambd_sweep else (args.lambd,)
    results = summarize(x, y, test.features, test.labels, remapped, lambdas=lambdas, solver=args.solver,
                        tol=args.tol, max_iter=args.max_iter)
    return _lowshot_rows(results, solver=args.solver, tol=args.tol, max_iter=args.max_iter,
                         train_mask_ratio=args.train_mask_ratio)


def run_knn(ctx: Context) -> list[dict]:
    train, test = ctx.train_features(), ctx.test_features()
    acc = knn_accuracy(train.features, train.labels, test.features, test.labels, k=ctx.args.k,
                       temperature=ctx.args.temperature)
    return [{"k": ctx.args.k, "temperature": ctx.args.temperature, "train": len(train.labels),
             "test": len(test.labels), "top1": acc}]


def run_linear(ctx: Context) -> list[dict]:
    a = ctx.args
    train, test = ctx.train_features(), ctx.test_features()
    result = train_linear_probe(train.features, train.labels, test.features, test.labels, epochs=a.epochs,
                                batch_size=a.probe_batch_size, lr=a.lr, seed=a.seed)
    return [{**result.as_dict(), "train": len(train.labels), "test": len(test.labels)}]


def run_robustness(ctx: Context) -> list[dict]:
    args = ctx.args
    test = ctx.dataset("test")
    probe = np.arange(min(args.max_images, len(test)))
    similarity = similarity_by_ratio(
        lambda r: ctx.embed(test, probe, mask_ratio=r, desc=f"mask {r:g}").features, args.ratios)
    rows = [{"metric": "cosine", "ratio": r, "value": v} for r, v in similarity.items()]
    if args.lowshot:
        train = ctx.dataset("train")
        subsets = lowshot_subsets(ctx, train)
        union = _union(subsets)
        by_ratio = {}
        for r in (0.0, *args.ratios):
            feats = ctx.embed(train, union, mask_ratio=r, desc=f"labelled, mask {r:g}")
            x, y, remapped = _gather(feats, subsets)
            by_ratio[r] = x
        test_feats = ctx.test_features()
        for r, results in masked_lowshot(by_ratio, y, test_feats.features, test_feats.labels, remapped,
                                         lambd=args.lambd, solver=args.solver).items():
            rows += [{"metric": "lowshot", "ratio": r, "value": row["mean"], **row}
                     for row in _lowshot_rows(results)]
    return rows


COMMANDS = {"lowshot": run_lowshot, "knn": run_knn, "linear": run_linear, "robustness": run_robustness}


# ------------------------------------------------------------------------------------------------ reporting


def format_table(rows: list[dict]) -> str:
    """Plain aligned table; ``mean``/``std`` pairs print as ``mean ± std``, lists are left out."""
    if not rows:
        return "(no results)"
    shown = []
    for row in rows:
        out = {k: v for k, v in row.items() if not isinstance(v, list) and k not in ("mean", "std", "value")}
        if "mean" in row:
            out["top1 (%)"] = f"{row['mean']:.2f} ± {row['std']:.2f}"
        elif "value" in row:
            out["value"] = f"{row['value']:.4f}"
        shown.append({k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in out.items()})
    columns = list(dict.fromkeys(k for row in shown for k in row))
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in shown)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns), "  ".join("-" * widths[c] for c in columns)]
    lines += ["  ".join(r.get(c, "").ljust(widths[c]) for c in columns) for r in shown]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- parser


def _shots(value: str) -> str:
    if value == "1percent" or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError(f"shots must be a positive integer or '1percent', got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msn-eval", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bundle", required=True, help="exported bundle directory (msn.json, model.onnx, ...)")
    common.add_argument("--data", required=True, help="fashion-mnist | synthetic | DIR with train/ and val/ | "
                        "a labelled folder or file list of training images (with --test-data)")
    common.add_argument("--test-data", help="labelled folder or file list of the test images (default: DATA/val)")
    common.add_argument("--source", choices=("auto", "image_folder", "file_list"), default="auto",
                        help="how to read --data and --test-data (auto: a file is a list, a folder of class "
                             "folders an image folder)")
    common.add_argument("--image-root", help="where a file list's relative paths point (default: the list's folder)")
    common.add_argument("--data-root", help="directory of the Fashion-MNIST idx files")
    common.add_argument("--backend", choices=BACKENDS, default="onnx",
                        help="onnx (model.onnx), torch (encoder.safetensors) or pixels (raw-pixel baseline)")
    common.add_argument("--feature", help=f"{', '.join(FEATURE_PATTERNS)}; default: the bundle's feature "
                        "(another one needs --backend torch)")
    common.add_argument("--device", default="cpu")
    common.add_argument("--batch-size", type=int, default=128)
    common.add_argument("--workers", type=int, default=0, help="data-loader worker processes")
    common.add_argument("--threads", type=int, default=0, help="CPU threads of torch / ONNX Runtime (0: their default)")
    common.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    common.add_argument("--no-cache", action="store_true")
    common.add_argument("--mask-seed", type=int, default=0,
                        help='image i is masked as /embed\'s {"ratio": R, "seed": [MASK_SEED, i]}')
    common.add_argument("--max-train", type=int, default=0, help="kNN/linear: first N training images (0: all)")
    common.add_argument("--max-test", type=int, default=0, help="use the first N test images (0: all)")
    common.add_argument("--synthetic-size", type=int, default=512, help="training images of --data synthetic")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--untrained", type=int, nargs="?", const=0, metavar="SEED",
                        help="score the untrained control instead: the bundle's architecture and preprocessing, "
                             "weights a random init under torch.manual_seed(SEED) (default 0); same feature and "
                             "protocol")
    common.add_argument("--json", type=Path, help="also write the results here")
    common.add_argument("--no-progress", action="store_true")

    lowshot_opts = argparse.ArgumentParser(add_help=False)
    lowshot_opts.add_argument("--shots", nargs="+", type=_shots, default=["1", "2", "5", "1percent"],
                              help="images per class, or 1percent")
    lowshot_opts.add_argument("--splits", type=int, choices=(1, 2, 3), default=3)
    lowshot_opts.add_argument("--subset-file", action="append", help="index list or ImageNet-style file list")
    lowshot_opts.add_argument("--lambd", type=float, default=DEFAULT_LAMBD, help="divided by n, as the paper")
    lowshot_opts.add_argument("--solver", choices=("cyanure", "sklearn"), default="cyanure")
    lowshot_opts.add_argument("--tol", type=float, default=1e-3,
                              help="cyanure: relative duality gap to stop at (1e-3: the official value); "
                                   "sklearn always uses 1e-6")
    lowshot_opts.add_argument("--max-iter", type=int, default=300, help="solver epochs (official: 300)")

    p = sub.add_parser("lowshot", parents=[common, lowshot_opts], help="the paper's low-shot logistic regression")
    p.add_argument("--lambd-sweep", action="store_true", help=f"report every lambd of {LAMBD_SWEEP}")
    p.add_argument("--train-mask-ratio", type=float, default=0.0, help="mask the labelled images (official --mask)")

    p = sub.add_parser("knn", parents=[common], help="weighted kNN on all training labels")
    p.add_argument("--k", type=int, default=DEFAULT_K)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)

    p = sub.add_parser("linear", parents=[common], help="linear probe on all training labels")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--probe-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, help="default: 6.4 x batch / 8192 (official)")

    p = sub.add_parser("robustness", parents=[common, lowshot_opts], help="masked vs unmasked embeddings")
    p.add_argument("--ratios", nargs="+", type=float, default=list(DEFAULT_RATIOS))
    p.add_argument("--max-images", type=int, default=2000, help="test images for the cosine similarity")
    p.add_argument("--no-lowshot", dest="lowshot", action="store_false",
                   help="skip low-shot accuracy with masked labelled images")
    p.set_defaults(shots=["1", "2", "5"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        ctx = make_context(args)
        rows = COMMANDS[args.command](ctx)
    except (FileNotFoundError, ValueError, IndexError, KeyError) as error:
        raise SystemExit(f"msn-eval {args.command}: error: {error}") from None
    elapsed = time.perf_counter() - start
    if args.untrained is not None:
        print(f"untrained control: random init (seed {args.untrained}) of {args.bundle}'s architecture and "
              f"preprocessing; {args.backend}, {ctx.embedder.feature}")
    print(format_table(rows))
    weights = "" if args.untrained is None else f", {ctx.weights}"
    print(f"{args.command}: {args.bundle} on {args.data} ({args.backend}, {ctx.embedder.feature}{weights}) "
          f"in {elapsed:.1f} s", file=sys.stderr)
    if args.json:
        report = {"command": args.command, "bundle": str(args.bundle), "data": args.data, "test_data": args.test_data,
                  "backend": args.backend, "feature": ctx.embedder.feature, "weights": ctx.weights,
                  "untrained_seed": args.untrained, "seconds": elapsed, "results": rows}
        if ctx.untrained_bundle is not None:
            report["untrained_bundle"] = str(ctx.untrained_bundle)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
