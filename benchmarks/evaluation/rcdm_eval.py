"""Does the RCDM decoder show what the MSN representation keeps? Class consistency and embedding agreement.

    python -m benchmarks.evaluation.rcdm_eval --bundle bundles/demo --decoder runs/rcdm   # full: writes docs/
    python -m benchmarks.evaluation.rcdm_eval --bundle bundles/demo --quick               # smoke run, minutes

For held-out images masked at ratios 0 / 0.5 / 0.7 / 0.9, ``--samples`` images are sampled from the decoder
conditioned on the MSN embedding of the masked image, and the same from a *baseline*: an identical decoder trained
(same config and steps) on the features of a random-init encoder of the same architecture. Reported per ratio:

* class consistency: the fraction of samples whose class, predicted by a low-shot logistic classifier on MSN
  features (``training.evaluation.lowshot``, fitted on ``--train-per-class`` labelled training images), equals the
  conditioning image's class (chance: 1 / classes);
* cosine similarity between the MSN embedding of each sample and the MSN embedding of the masked conditioning image
  (``cos_msn``, comparable across both decoders), and in the conditioning encoder's own space (``cos_own``);
  ``cos_unrelated`` is the mean cosine of MSN embeddings of unrelated test images, for scale.

Missing decoders are trained first (``--train-steps``, config ``--config``) into ``OUT/decoders``. Writes
``rcdm_eval.json`` and ``rcdm_samples.png`` (rows: original, masked, MSN samples, baseline samples) to ``--out-dir``;
``python -m benchmarks.render`` puts the table into ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO, machine
from benchmarks.protocol import RCDM_JSON
from msn_core.durable import atomic_write_json
from training.data import build_dataset
from training.evaluation.lowshot import fit_logistic
from training.masking import random_keep_idx
from visualizer.config import load_config
from visualizer.render import bitmap_from_keep_idx, masked_view, save_grid, to_hwc

RATIOS = (0.0, 0.5, 0.7, 0.9)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="the MSN bundle")
    parser.add_argument("--decoder", type=Path, help="decoder run trained on --bundle (trained if missing)")
    parser.add_argument("--random-decoder", type=Path, help="decoder run trained on the random-init encoder")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "rcdm_fmnist_32.yaml")
    parser.add_argument("--data", default="fashion-mnist")
    parser.add_argument("--data-root")
    parser.add_argument("--train-steps", type=int, help="steps for decoders trained here (default: config's)")
    parser.add_argument("--images", type=int, default=200, help="held-out conditioning images (class-balanced)")
    parser.add_argument("--samples", type=int, default=4, help="samples per image and ratio")
    parser.add_argument("--steps", type=int, help="sampling steps (default: the decoder config's)")
    parser.add_argument("--sampler", choices=("ddim", "ddpm"), help="default: the decoder config's")
    parser.add_argument("--train-per-class", type=int, default=100, help="labelled images for the classifier")
    parser.add_argument("--grid-images", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256, help="samples drawn per decoder call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, help="default: docs/ (quick: runs/rcdm_eval_quick/)")
    parser.add_argument("--quick", action="store_true", help="tiny everything: checks the pipeline, not the claim")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.samples, args.steps, args.train_per_class = 20, 2, 10, 10
        args.train_steps = args.train_steps or 30
    args.out_dir = args.out_dir or (REPO / "runs" / "rcdm_eval_quick" if args.quick else REPO / "docs")
    return args


def random_bundle(msn_bundle: Path, out: Path, seed: int) -> Path:
    """A bundle with the MSN bundle's architecture and preprocessing but random-init weights."""
    from training.bundle.untrained import export_untrained

    if (out / "msn.json").is_file():
        return out
    # never the seed a test or demo bundle was initialised with; the MSN bundle's feature
    export_untrained(msn_bundle, out, seed=10_007 + seed, parity_check=False)
    return out


def ensure_decoder(run: Path, bundle: Path, args: argparse.Namespace) -> Path:
    """Train (or finish training) a decoder at ``run`` unless a finished one is there."""
    from visualizer.pipeline import load_run  # diffusers: imported when used, so the parser builds in a blink
    from visualizer.train import train

    overrides = [f"data.source={args.data}"] + ([f"data.root={args.data_root}"] if args.data_root else [])
    if args.train_steps:
        overrides.append(f"optim.max_steps={args.train_steps}")
    cfg = load_config(args.config, overrides)
    if (run / "checkpoint.pt").is_file() and load_run(run)["step"] >= cfg.optim.max_steps:
        return run
    print(f"training a decoder on {bundle} into {run} ({cfg.optim.max_steps} steps)", flush=True)
    train(cfg, bundle, run, resume=True)
    return run


def balanced_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """``per_class`` random indices of each class, interleaved (class 0, 1, ..., 0, 1, ...)."""
    picks = [rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in np.unique(labels)]
    order = sorted((rank, c) for c, idx in enumerate(picks) for rank in range(len(idx)))
    return np.array([picks[c][rank] for rank, c in order], dtype=np.int64)


def images_of(dataset, indices: np.ndarray) -> torch.Tensor:
    return torch.stack([dataset[int(i)][0] for i in indices])


def cosine(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).cpu().numpy()


def evaluate(args: argparse.Namespace) -> dict:
    from visualizer.pipeline import RCDMPipeline

    started = time.perf_counter()
    work = args.out_dir / "decoders" if args.quick else REPO / "runs" / "rcdm_eval"
    msn_run = args.decoder or ensure_decoder(work / "msn", args.bundle, args)
    rand_bundle = random_bundle(args.bundle, work / "random_bundle", args.seed)
    rand_run = args.random_decoder or ensure_decoder(work / "random", rand_bundle, args)
    msn = RCDMPipeline.from_dirs(args.bundle, msn_run, name="msn")
    rand = RCDMPipeline.from_dirs(rand_bundle, rand_run, name="random-init")
    if msn.step != rand.step:
        print(f"warning: decoders trained {msn.step} vs {rand.step} steps", file=sys.stderr)

    load_size = int(msn.encoder.transform["resize"])
    train_set = build_dataset(args.data, root=args.data_root, split="train", load_size=load_size)
    test_set = build_dataset(args.data, root=args.data_root, split="val" if args.data == "image_folder" else "test",
                             load_size=load_size)
    rng = np.random.default_rng(args.seed)
    train_labels, test_labels = np.asarray(train_set.labels), np.asarray(test_set.labels)
    num_classes = len(np.unique(train_labels))
    fit_idx = balanced_indices(train_labels, args.train_per_class, rng)

    def embed(batch: torch.Tensor) -> torch.Tensor:
        return torch.cat([msn.encoder.embed(batch[i:i + 256]) for i in range(0, len(batch), 256)])

    classifier = fit_logistic(embed(images_of(train_set, fit_idx)).cpu().numpy(), train_labels[fit_idx])
    eval_idx = balanced_indices(test_labels, max(1, args.images // num_classes), rng)[: args.images]
    images, labels = images_of(test_set, eval_idx), test_labels[eval_idx]
    full_msn = embed(images)
    accuracy = float(np.mean(classifier.predict(full_msn.cpu().numpy()) == labels))
    perm = torch.from_numpy(rng.permutation(len(images)))
    unrelated = cosine(full_msn, full_msn[perm])[perm.numpy() != np.arange(len(images))]

    results: dict = {"ratios": {}}
    grid_rows = []
    k = args.samples
    for ratio in RATIOS:
        generator = torch.Generator().manual_seed(args.seed * 100_003 + int(ratio * 100))
        keep = random_keep_idx(len(images), msn.encoder.num_patches, ratio, shared=False, generator=generator)
        msn_cond = msn.encoder.embed(images, keep)
        repeat_labels = np.repeat(labels, k)
        stats, outs = {}, {}
        for name, pipe in (("msn", msn), ("random", rand)):
            cond = msn_cond if pipe is msn else pipe.encoder.embed(images, keep)
            samples = torch.cat([
                pipe.sample_from_features(chunk.repeat_interleave(k, dim=0), steps=args.steps,
                                         sampler=args.sampler, seed=args.seed + i)
                for i, chunk in enumerate(cond.split(max(1, args.batch // k)))])  # rows: image-major
            sample_msn = embed(samples)
            stats[name] = {
                "consistent": float(np.mean(classifier.predict(sample_msn.cpu().numpy()) == repeat_labels)),
                "cos_msn": float(cosine(sample_msn, msn_cond.repeat_interleave(k, dim=0)).mean()),
                "cos_own": float(cosine(pipe.encoder.embed(samples), cond.repeat_interleave(k, dim=0)).mean()),
            }
            outs[name] = samples
        for n in range(min(args.grid_images, len(images))):
            view = to_hwc(msn.encoder.model_view(images[n:n + 1])[0])
            grid_rows.append([view, masked_view(view, bitmap_from_keep_idx(keep[n], msn.encoder.grid))]
                             + [to_hwc(s) for name in ("msn", "random") for s in outs[name][n * k:(n + 1) * k]])
        results["ratios"][f"{ratio:.1f}"] = stats
        print(f"ratio {ratio:.1f}: " + ", ".join(
            f"{name} consistency {v['consistent']:.3f} cos {v['cos_msn']:.3f}" for name, v in stats.items()),
            flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    grid = save_grid(grid_rows, args.out_dir / "rcdm_samples.png", cell=max(64, msn.image_size))
    results.update({
        "quick": args.quick, "data": args.data, "images": len(images), "samples_per_image": args.samples,
        "sampler": args.sampler or msn.config.diffusion.sampler,
        "sampling_steps": args.steps or msn.config.diffusion.sample_steps,
        "num_classes": num_classes, "chance": 1.0 / num_classes,
        "classifier": {"train_images": len(fit_idx), "accuracy_on_originals": accuracy},
        "cos_unrelated": float(np.mean(unrelated)) if len(unrelated) else None,
        "msn": {"bundle": msn.encoder.model_id, "decoder": str(msn_run), "decoder_steps": msn.step},
        "random": {"bundle": rand.encoder.model_id, "decoder": str(rand_run), "decoder_steps": rand.step},
        "grid": {"file": grid.name, "rows": f"{args.grid_images} images x {len(RATIOS)} ratios",
                 "columns": f"original, masked, {args.samples} MSN samples, {args.samples} random-encoder samples"},
        "seconds": round(time.perf_counter() - started, 1), "torch": torch.__version__,
        "machine": machine(), "threads": torch.get_num_threads(),
    })
    atomic_write_json(args.out_dir / RCDM_JSON, results)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = evaluate(args)
    print(f"wrote {args.out_dir / RCDM_JSON} and {args.out_dir / results['grid']['file']} "
          f"({results['seconds']} s); docs: python -m benchmarks.render")


if __name__ == "__main__":
    main()
