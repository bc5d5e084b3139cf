"""What a glyph encoder's features tell apart: the digit, or how the glyph was drawn?

    python -m benchmarks.training.glyph_factors NAME=BUNDLE [NAME=BUNDLE ...]      # each bundle, and raw pixels
    python -m benchmarks.training.glyph_factors plan=runs/glyph_folders/flat-10m/bundles/flat --blocks

The rendered glyphs (:mod:`benchmarks.training.glyph_folders`) know every image's factors: the digit, the size and
font it was drawn at, and its affine, stroke and contrast jitter (``draw_jitter`` re-drawn from the image's own
seed). For each feature (raw pixels; each bundle's served feature and the paper's CLS, ``cls_pre_norm``; with
``--blocks`` the CLS of every block) this prints the weighted kNN-20 accuracy (DINO's, ``msn_core.knn``) of
predicting each factor on the test images from the training images, the continuous factors split at their
training quartiles (chance 25 %). A feature that predicts the background grey better than the digit has learned
the way the images were made, not what they show: the measurement behind the glyph section of
docs/results-notes.md. Nothing here is timed. The table goes to stdout and ``benchmarks/results/glyph_factors.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.common import REPO, RESULTS, machine, save_json
from benchmarks.training.glyph_folders import SPLIT_CODES, data_dir, draw_jitter, split_glyphs
from msn_core.knn import knn_accuracy
from msn_core.preprocessing import transform_image
from training.model.load import load_encoder
from training.model.readout import feature_spec, read_feature
from training.model.vit import VisionTransformer

DEFAULT_DATA = data_dir(REPO / "runs" / "glyph_folders", (16, 28, 32))
# every factor, the digit first; the continuous ones (from ``height`` on) are cut at their training quartiles
FACTORS = ("digit", "size", "font", "height", "rotation", "shear", "stroke", "shift_x", "shift_y", "background",
           "foreground")
CONTINUOUS = FACTORS[3:]


def factor_table(data: Path, split: str) -> tuple[list[Path], np.ndarray]:
    """The test or training images of the labelled tree, and one row of factors per image (``FACTORS`` order)."""
    record = json.loads((data / "images.json").read_text())
    per_class = record[split if split == "train" else "test"] // len(record["classes"])
    files, rows = [], []
    for glyph in split_glyphs(per_class, record["sizes"], record["fonts"]):
        j = draw_jitter(np.random.default_rng([record["seed"], SPLIT_CODES[split], glyph.index]), glyph.size)
        files.append(data / "labelled" / split / record["classes"][glyph.label] / f"{glyph.index:05d}.png")
        rows.append((glyph.label, record["sizes"].index(glyph.size), record["fonts"].index(glyph.font), j.height,
                     j.rotation, j.shear, j.stroke_px, *j.shift, j.background, j.foreground))
    return files, np.asarray(rows, dtype=np.float64)


def factor_classes(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer classes per factor: categorical ones as they are, continuous ones by training quartile."""
    train_y, test_y = train.astype(np.int64), test.astype(np.int64)
    for col in range(FACTORS.index(CONTINUOUS[0]), len(FACTORS)):
        edges = np.quantile(train[:, col], [0.25, 0.5, 0.75])
        train_y[:, col], test_y[:, col] = np.digitize(train[:, col], edges), np.digitize(test[:, col], edges)
    return train_y, test_y


def preprocessed(files: list[Path], preprocessing) -> torch.Tensor:
    """``files`` as the bundle's graph takes them (serving's own Pillow pipeline)."""
    return torch.from_numpy(np.stack([transform_image(Image.open(f), preprocessing) for f in files]))


@torch.inference_mode()
def bundle_features(encoder: VisionTransformer, feature: str, images: torch.Tensor,
                    blocks: bool) -> dict[str, np.ndarray]:
    """The served ``feature`` and the CLS (every block's with ``blocks``) of ``images``."""
    out = {f"served ({feature})": read_feature(encoder, feature_spec(encoder, feature), images).numpy()}
    tokens = encoder.forward_blocks(images, last=encoder.depth if blocks else 1)
    for i, block in enumerate(tokens):
        depth = encoder.depth - len(tokens) + i
        out["cls_pre_norm" if depth == encoder.depth - 1 else f"cls block {depth}"] = block[:, 0].numpy()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", help="NAME=BUNDLE_DIR, one per encoder")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the rendered glyphs (images.json)")
    parser.add_argument("--blocks", action="store_true", help="also the CLS token of every block")
    parser.add_argument("--json", type=Path, default=RESULTS / "glyph_factors.json")
    args = parser.parse_args(argv)
    named = dict(item.split("=", 1) for item in args.bundles)
    (train_files, train_f), (test_files, test_f) = factor_table(args.data, "train"), factor_table(args.data, "val")
    train_y, test_y = factor_classes(train_f, test_f)
    features: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, bundle in named.items():
        encoder, info = load_encoder(bundle)
        train_images, test_images = (preprocessed(files, info.preprocessing) for files in (train_files, test_files))
        # raw pixels under the first bundle's preprocessing (``msn-eval --backend pixels``)
        features.setdefault("pixels", (train_images.flatten(1).numpy(), test_images.flatten(1).numpy()))
        train_x, test_x = (bundle_features(encoder, info.feature, x, args.blocks) for x in (train_images, test_images))
        features |= {f"{name}: {kind}": (train_x[kind], test_x[kind]) for kind in train_x}
    rows = {}
    print(f"{'feature':38s}" + "".join(f"{f[:10]:>11s}" for f in FACTORS))
    for name, (train_x, test_x) in features.items():
        rows[name] = {factor: round(knn_accuracy(train_x, train_y[:, i], test_x, test_y[:, i]), 1)
                      for i, factor in enumerate(FACTORS)}
        print(f"{name[:38]:38s}" + "".join(f"{v:11.1f}" for v in rows[name].values()), flush=True)
    chance = {factor: round(100 / len(np.unique(train_y[:, i])), 1) for i, factor in enumerate(FACTORS)}
    print(f"{'chance':38s}" + "".join(f"{v:11.1f}" for v in chance.values()))
    save_json(args.json, {"machine": machine(), "data": str(args.data), "bundles": named, "knn": "k=20, T=0.07",
                          "chance": chance, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
