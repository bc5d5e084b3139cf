"""The accuracy guard of int8 bundles: the quantized graph must embed held-out images like the fp32 one.

Run by ``msn-export --quantize int8`` before anything is written. Two checks, both against the fp32 graph of the
same bundle and both on images the quantizer never saw (calibration images come from the training split; the guard
uses the held-out split, or, for an image folder without ``val/``, training images outside the calibration and
labelled sets):

- cosine similarity of the embeddings, unmasked and with half the patches dropped (the service embeds both), every
  image at least ``min_cosine`` (0.99);
- the paper's low-shot protocol (1, 2 and 5 labelled images per class, seeded splits, cyanure logistic regression)
  run on fp32 and on int8 features: each setting's mean accuracy within ``max_lowshot_gap`` (1 point) of fp32's.
  It needs labels of at least two classes; without them it is skipped and ``msn.json`` says why, and only the
  cosine check stands.

Images go through :func:`training.evaluation.features.extract_features`, the bundle's own preprocessing as
``msn-eval`` and ``msn-serve`` apply it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import Preprocessing
from training.data import build_dataset
from training.evaluation.features import OnnxEmbedder, extract_features
from training.evaluation.lowshot import summarize
from training.evaluation.splits import standard_subsets

__all__ = ["GuardData", "GuardThresholds", "guard_data", "run_guard"]

MASKED_RATIO = 0.5


@dataclass(frozen=True)
class GuardThresholds:
    min_cosine: float = 0.99  # every held-out image, unmasked and masked
    max_lowshot_gap: float = 1.0  # accuracy points, per low-shot setting (mean over splits)


@dataclass
class GuardData:
    """Where calibration and guard images come from (dataset objects and indices into them)."""

    source: str
    root: str | None
    train: Any
    heldout: Any
    calibration_idx: np.ndarray
    heldout_idx: np.ndarray
    subsets: dict[str, list[np.ndarray]] | None
    lowshot_skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "root": self.root, "calibration_images": len(self.calibration_idx),
                "heldout_images": len(self.heldout_idx), "heldout_split": self.notes[0] if self.notes else None,
                "labelled_images": None if self.subsets is None else len(_union(self.subsets))}


def _union(subsets: dict[str, list[np.ndarray]]) -> np.ndarray:
    return np.unique(np.concatenate([idx for v in subsets.values() for idx in v]))


def guard_data(source: str, root: str | None, load_size: int, *, calibration_images: int, guard_images: int,
               shots: Sequence[int] = (1, 2, 5), splits: int = 3, seed: int = 0,
               synthetic_size: int = 512) -> GuardData:
    """Calibration images from the training split; held-out images from the test/val split (or, without one, from
    training images that neither calibration nor the labelled low-shot sets use)."""
    train = build_dataset(source, root=root, split="train", load_size=load_size, synthetic_size=synthetic_size)
    separate = source in ("fashion-mnist", "synthetic") or (root is not None and (Path(root) / "val").is_dir())
    labels = np.asarray(train.labels)
    subsets, skipped = None, None
    if len(np.unique(labels)) < 2:
        skipped = "the training data has fewer than two classes: no labels for the low-shot check"
    else:
        try:
            subsets = standard_subsets(train, source, shots=[str(s) for s in shots], splits=splits)
        except ValueError as e:  # a class with fewer images than the largest shot count
            skipped = f"cannot draw the low-shot splits: {e}"
    rng = np.random.default_rng(seed)
    taken = _union(subsets) if subsets else np.zeros(0, np.int64)
    free = np.setdiff1d(np.arange(len(train)), taken)
    order = rng.permutation(free)
    calibration = np.sort(order[:calibration_images])
    if separate:
        heldout = build_dataset(source, root=root, split="test" if source != "image_folder" else "val",
                                load_size=load_size, synthetic_size=max(1, synthetic_size // 2))
        pool, note = np.arange(len(heldout)), "test split" if source != "image_folder" else "val/"
    else:
        heldout, pool = train, order[calibration_images:]
        note = "training images outside the calibration and labelled sets (no val/ folder)"
    heldout_idx = np.sort(rng.permutation(pool)[:guard_images])
    if len(calibration) == 0 or len(heldout_idx) == 0:
        raise ValueError(f"{source} {root or ''}: not enough images for calibration and a held-out guard set")
    return GuardData(source, root, train, heldout, calibration, heldout_idx, subsets, skipped, [note])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def _cosine_stats(c: np.ndarray) -> dict[str, float]:
    return {"images": len(c), "min": round(float(c.min()), 5), "p01": round(float(np.percentile(c, 1)), 5),
            "mean": round(float(c.mean()), 5)}


def run_guard(bundle_dir: Path, int8_path: Path, data: GuardData, preprocessing: Preprocessing, *,
              thresholds: GuardThresholds | None = None, batch_size: int = 64, threads: int = 0,
              seed: int = 0, reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compare the int8 graph with ``bundle_dir``'s fp32 graph; ``passed`` and ``failures`` say how it went.

    ``reference``: a dict passed again to each call on the same bundle, data, preprocessing and seed (one per
    candidate graph); the fp32 graph's features and low-shot accuracy, which do not depend on the int8 graph, are
    kept in it by the first call and reused by the others instead of being computed again."""
    thresholds = thresholds or GuardThresholds()
    cache = {} if reference is None else reference
    int8_embedder = OnnxEmbedder(bundle_dir, model_path=int8_path, intra_op_threads=threads)

    def extract(dataset, indices, mask_ratio: float, embedder) -> Any:
        return extract_features(dataset, embedder, preprocessing=preprocessing, indices=indices,
                                batch_size=batch_size, mask_ratio=mask_ratio, mask_seed=seed, progress=False)

    def features(what: str, dataset, indices, mask_ratio: float = 0.0) -> dict[str, Any]:
        if what not in cache:
            if "embedder" not in cache:
                cache["embedder"] = OnnxEmbedder(bundle_dir, intra_op_threads=threads)
            cache[what] = extract(dataset, indices, mask_ratio, cache["embedder"])
        return {"fp32": cache[what], "int8": extract(dataset, indices, mask_ratio, int8_embedder)}

    held = features("heldout", data.heldout, data.heldout_idx)
    masked = features("masked", data.heldout, data.heldout_idx[:2000], MASKED_RATIO)
    cos = _cosines(held["fp32"].features, held["int8"].features)
    cos_masked = _cosines(masked["fp32"].features, masked["int8"].features)
    report: dict[str, Any] = {"thresholds": asdict(thresholds), "data": data.describe(),
                              "cosine": _cosine_stats(cos), "cosine_masked": {"mask_ratio": MASKED_RATIO,
                                                                              **_cosine_stats(cos_masked)}}
    failures = [f"{what} cosine to fp32 is {c.min():.4f} for some image (< {thresholds.min_cosine})"
                for what, c in (("unmasked", cos), ("masked", cos_masked)) if not c.min() >= thresholds.min_cosine]
    report["lowshot"], report["lowshot_skipped"] = None, data.lowshot_skipped
    if data.subsets is not None:
        union = _union(data.subsets)
        labelled = features("labelled", data.train, union)
        row = {int(i): r for r, i in enumerate(union)}
        remapped = {k: [np.array([row[int(i)] for i in idx]) for idx in v] for k, v in data.subsets.items()}
        with warnings.catch_warnings():  # cyanure's "max_iter was reached": msn-eval's settings, same for both
            warnings.simplefilter("ignore")

            def lowshot(name: str) -> dict[str, float]:
                return {r.setting: r.mean for r in summarize(labelled[name].features, labelled[name].labels,
                                                             held[name].features, held[name].labels, remapped)}

            if "lowshot" not in cache:
                cache["lowshot"] = lowshot("fp32")
            accuracy = {"fp32": cache["lowshot"], "int8": lowshot("int8")}
        report["lowshot"] = {}
        for setting in data.subsets:
            fp32, int8 = accuracy["fp32"][setting], accuracy["int8"][setting]
            gap = round(int8 - fp32, 3)
            report["lowshot"][setting] = {"fp32": round(fp32, 3), "int8": round(int8, 3), "gap": gap,
                                          "splits": len(data.subsets[setting])}
            if not abs(gap) <= thresholds.max_lowshot_gap:
                failures.append(f"low-shot {setting}: int8 {int8:.2f} % vs fp32 {fp32:.2f} % "
                                f"(gap {gap:+.2f} > {thresholds.max_lowshot_gap} point)")
    report["passed"], report["failures"] = not failures, failures
    return report
