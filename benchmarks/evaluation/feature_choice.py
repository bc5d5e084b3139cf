"""Which frozen feature a bundle should serve, chosen on a held-out part of the TRAINING set (never the test set).

For each candidate feature (:mod:`msn_core.features`) the bundle's torch encoder embeds the 60k training images;
a seeded permutation holds out ``--holdout`` of them as validation images, the rest is the labelled pool. Low-shot
(1/2/5 images per class, 3 seeded class-balanced draws from the pool, the paper's logistic regression and lambda) and
kNN-20 (pool against validation) score each feature; raw pixels get the same protocol as the bar to clear.

The choice weighs what training added, not only the absolute score: every feature is also scored on the bundle's
untrained twin (the same architecture under ``torch.manual_seed(0)``, :mod:`training.bundle.untrained`), since a
random ViT's patch-token map already keeps an aligned image's layout. A feature qualifies when it beats pixels'
score and the twin by at least ``MARGIN`` points at each of 1, 2 and 5 labels; the best-scoring qualifier is the
choice. When none qualifies the choice is the feature with the best worst case of the two margins (over pixels,
over the twin), and the report says so. Pass it to ``msn-export --feature``.

    python -m benchmarks.evaluation.feature_choice --bundle bundles/demo [--features cls_pre_norm patch_tokens ...]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.common import FEATURE_CACHE, RESULTS, machine, save_json

DEFAULT_OUT = RESULTS / "feature_choice.json"
SHOTS = (1, 2, 5)
MARGIN = 5.0  # low-shot points over the untrained twin, at each of SHOTS, that count as "training added it"


def candidates(depth: int, grid: int) -> list[str]:
    """The features worth comparing for an encoder of ``depth`` blocks on a ``grid x grid`` patch grid."""
    names = ["cls_pre_norm", "cls_post_norm", "cls_last2"]
    if depth >= 4:
        names.append("cls_last4")
    names += ["patch_tokens", "cls_patch_tokens"]
    names += [f"patch_grid{g}" for g in (1, 2) if grid % g == 0 and g < grid]
    return names


def holdout_split(n: int, holdout: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(pool, validation) indices of a seeded permutation of ``range(n)``."""
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[holdout:]), np.sort(perm[:holdout])


def score(x: np.ndarray, y: np.ndarray, pool: np.ndarray, val: np.ndarray, splits: int) -> dict:
    """Low-shot (mean, std over ``splits`` draws) and kNN-20 accuracy of features ``x`` on the held-out split."""
    from training.evaluation.knn import knn_accuracy
    from training.evaluation.lowshot import summarize
    from training.evaluation.splits import class_balanced_indices

    subsets = {f"{s}imgs_class": [pool[class_balanced_indices(y[pool], s, seed=k)] for k in range(1, splits + 1)]
               for s in SHOTS}
    rows = {r.setting: r for r in summarize(x, y, x[val], y[val], subsets)}
    out = {f"{s}shot": {"mean": rows[f"{s}imgs_class"].mean, "std": rows[f"{s}imgs_class"].std} for s in SHOTS}
    out["knn20"] = knn_accuracy(x[pool], y[pool], x[val], y[val], k=20)
    out["score"] = float(np.mean([out[f"{s}shot"]["mean"] for s in SHOTS] + [out["knn20"]]))
    return out


def gain_over_untrained(row: dict) -> float:
    """The smallest low-shot gain of a trained feature over the same feature of the untrained twin."""
    return min(row[f"{s}shot"]["mean"] - row["untrained"][f"{s}shot"]["mean"] for s in SHOTS)


def choose(rows: dict[str, dict], names: list[str]) -> tuple[str, str]:
    """(feature, reason): the best-scoring feature that beats pixels and its untrained twin by ``MARGIN``; else the
    one whose worse margin (over pixels' score, over the twin) is largest. Rows without ``untrained``: best score."""
    pixels = rows["pixels"]["score"]
    if not all("untrained" in rows[n] for n in names):
        best = max(names, key=lambda n: rows[n]["score"])
        return best, "the best held-out score (no untrained control measured)"
    qualified = [n for n in names if rows[n]["score"] > pixels and gain_over_untrained(rows[n]) >= MARGIN]
    if qualified:
        best = max(qualified, key=lambda n: rows[n]["score"])
        return best, (f"the best held-out score of the features that beat pixels and gain >= {MARGIN:g} points over "
                      f"the untrained network at each of {', '.join(map(str, SHOTS))} labels ({', '.join(qualified)})")
    best = max(names, key=lambda n: min(rows[n]["score"] - pixels, gain_over_untrained(rows[n])))
    return best, (f"no feature beats pixels with a gain >= {MARGIN:g} over the untrained network; this one has the "
                  "largest worse margin of the two")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--features", nargs="+", help="default: every candidate that fits the encoder")
    p.add_argument("--holdout", type=int, default=10000, help="training images held out for validation")
    p.add_argument("--splits", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--untrained-seed", type=int, default=0,
                   help="seed of the untrained twin scored beside each feature (-1: skip the control)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)

    import torch

    from msn_core.bundle import load_bundle_info
    from training.bundle.untrained import untrained_encoder
    from training.data import build_dataset
    from training.evaluation.features import (
        PixelEmbedder,
        TorchEmbedder,
        bundle_fingerprint,
        extract_features,
    )
    from training.model.load import load_encoder

    if args.threads:
        torch.set_num_threads(args.threads)
    info = load_bundle_info(args.bundle)
    encoder, _ = load_encoder(args.bundle)
    twin = untrained_encoder(info, args.untrained_seed).eval() if args.untrained_seed >= 0 else None
    names = args.features or candidates(encoder.depth, encoder.grid_size)
    dataset = build_dataset(args.data, split="train", load_size=int(info.preprocessing.resize))
    tag = bundle_fingerprint(args.bundle)
    rows: dict[str, dict] = {}
    pool = val = None
    for name in ["pixels", *names]:
        start = time.perf_counter()
        embedder = PixelEmbedder() if name == "pixels" else TorchEmbedder(encoder, feature=name)
        f = extract_features(dataset, embedder, preprocessing=info.preprocessing, batch_size=256,
                             cache_dir=FEATURE_CACHE, cache_tag="pixels" if name == "pixels" else tag,
                             progress=False, desc=name)
        x, y = f.features.astype(np.float32), np.asarray(f.labels)
        if pool is None:
            pool, val = holdout_split(len(y), args.holdout)
        rows[name] = {"dim": int(x.shape[1]), **score(x, y, pool, val, args.splits)}
        if name != "pixels" and twin is not None:
            f = extract_features(dataset, TorchEmbedder(twin, feature=name), preprocessing=info.preprocessing,
                                 batch_size=256, cache_dir=FEATURE_CACHE,
                                 cache_tag=f"{tag}-untrained{args.untrained_seed}", progress=False,
                                 desc=f"{name} untrained")
            rows[name]["untrained"] = score(f.features.astype(np.float32), y, pool, val, args.splits)
        rows[name]["seconds"] = round(time.perf_counter() - start, 1)
        r = rows[name]
        print(f"{name:>14} {r['dim']:>6}-d  " + "  ".join(
            f"{s}-shot {r[f'{s}shot']['mean']:.1f} ± {r[f'{s}shot']['std']:.1f}" for s in SHOTS)
            + f"  kNN-20 {r['knn20']:.1f}  score {r['score']:.2f}", flush=True)
        if "untrained" in r:
            u = r["untrained"]
            print(f"{'untrained':>14} {'':>8}  " + "  ".join(f"{s}-shot {u[f'{s}shot']['mean']:.1f} ± "
                                                           f"{u[f'{s}shot']['std']:.1f}" for s in SHOTS)
                  + f"  kNN-20 {u['knn20']:.1f}  gain {gain_over_untrained(r):+.1f} (worst of 1/2/5)", flush=True)
    chosen, reason = choose(rows, names)
    print(f"chosen: {chosen} (held-out score {rows[chosen]['score']:.2f}; pixels {rows['pixels']['score']:.2f}): "
          f"{reason}")
    result = {"bundle": str(args.bundle), "model_id": info.model_id, "data": args.data, "holdout": args.holdout,
              "splits": args.splits, "untrained_seed": args.untrained_seed, "margin": MARGIN, "features": rows,
              "chosen": chosen, "reason": reason, "machine": machine()}
    save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
