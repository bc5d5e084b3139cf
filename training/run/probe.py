"""A kNN probe during pretraining: how good the feature the bundle will serve is, every few hundred steps.

The loss of a self-supervised run says little about the representation (a collapsed run can have a fine-looking
loss), so when labels exist the trainer measures what users get: the target encoder's feature (``model.feature``,
read by ``training.model.readout`` as the exported bundle serves it) on a small labelled bank and a disjoint set
of queries, scored by weighted kNN-20 (``msn_core.knn``, the protocol of ``msn-eval knn``).

Where the labelled images come from (``run.eval_data``, ``--eval-data``):

- unset: the training images themselves when their source has labels (an image folder, a labelled file list,
  Fashion-MNIST, synthetic). Two seeded, disjoint subsets: queries and a bank. They are only encoded, never held
  out from training: the probe tracks the representation, it is not a test-set score;
- ``fashion-mnist`` or ``synthetic``: that dataset's train split is the bank, its test split the queries;
- a labelled folder or file list (``msn_core/sources.py``): its ``train/`` as the bank and ``val/`` or ``test/``
  as the queries when it has them, otherwise two seeded subsets of it.

An unlabelled source and no ``run.eval_data``: no probe (collapse is still watched, ``training/run/collapse.py``).

Cost, kept to a few per cent of the run: the images (at most ``run.probe_images``, under a memory cap) are decoded
once, on rank 0, when the run is built, and held as uint8; a probe is one forward pass of the target encoder over
them in inference mode, and runs only on rank 0, between steps (the other ranks wait at their next collective,
so no collective is ever mismatched). A probe is due every ``run.probe_every_steps`` steps and at the last step,
but is postponed while the probes so far would take more than ``MAX_TIME_FRACTION`` of the training time between
them. A probe draws from no random stream and leaves the encoder's train/eval mode as it found it, so a resumed
run is still bit-exact.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from msn_core.knn import DEFAULT_K, knn_accuracy
from msn_core.sources import MEMORY_SOURCES, SPLIT_FOLDERS, SourceError, list_images, relabel
from training.data import ImageListDataset, build_dataset, collate_views
from training.model.readout import feature_spec, read_feature
from training.model.vit import VisionTransformer
from training.run.build import Run, preprocessing
from training.views import eval_transform

__all__ = ["KnnProbe", "ProbeImages", "build_probe", "probe_images"]

log = logging.getLogger("msn.train")

MAX_TIME_FRACTION = 0.02  # probes may take at most this share of the training time between them
MAX_PROBE_BYTES = 384 * 2**20  # uint8 images held in memory for the probe
QUERY_FRACTION = 1 / 3  # of the probe images, when bank and queries come from one labelled set
BATCH_SIZE = 256


@dataclass
class ProbeImages:
    """Decoded probe images (uint8, at the dataset's load size) and their labels: a bank and disjoint queries."""

    bank: Tensor
    bank_labels: np.ndarray
    queries: Tensor
    query_labels: np.ndarray
    description: str


@dataclass(frozen=True)
class ProbeResult:
    knn_top1: float  # %
    seconds: float

    def record(self) -> dict[str, float]:
        """The fields a probe adds to the step's ``metrics.jsonl`` record."""
        return {f"knn{DEFAULT_K}_top1": self.knn_top1, "probe_seconds": self.seconds}


class KnnProbe:
    """kNN-20 accuracy of ``encoder``'s feature ``feature`` on ``images``, when due (``maybe``)."""

    def __init__(self, images: ProbeImages, encoder: VisionTransformer, *, feature: str, eval_preprocessing: dict,
                 device: torch.device, autocast: Callable[[], AbstractContextManager], every_steps: int,
                 max_time_fraction: float = MAX_TIME_FRACTION) -> None:
        self.images, self.encoder = images, encoder
        self.spec = feature_spec(encoder, feature)
        self.transform = {k: eval_preprocessing[k] for k in ("resize", "crop", "mean", "std")}
        self.device, self.autocast = device, autocast
        self.every_steps, self.max_time_fraction = every_steps, max_time_fraction
        self.last_step: int | None = None
        self.next_step = every_steps
        self.probe_seconds = 0.0  # all probes so far
        self.started = time.monotonic()

    def due(self, step: int, *, final: bool = False) -> bool:
        """Every ``every_steps`` steps and at the last step; a periodic probe waits while the probes so far took
        more than ``max_time_fraction`` of the training time."""
        if final:
            return self.last_step != step
        if step < self.next_step:
            return False
        training_seconds = time.monotonic() - self.started - self.probe_seconds
        return self.probe_seconds <= self.max_time_fraction * training_seconds

    def maybe(self, step: int, *, final: bool = False) -> ProbeResult | None:
        return self.run(step) if self.due(step, final=final) else None

    def run(self, step: int) -> ProbeResult:
        start = time.monotonic()
        bank = self.features(self.images.bank)
        queries = self.features(self.images.queries)
        accuracy = knn_accuracy(bank, self.images.bank_labels, queries, self.images.query_labels, k=DEFAULT_K)
        seconds = time.monotonic() - start
        self.probe_seconds += seconds
        self.last_step, self.next_step = step, (step // self.every_steps + 1) * self.every_steps
        return ProbeResult(accuracy, seconds)

    @torch.inference_mode()
    def features(self, images: Tensor) -> np.ndarray:
        was_training = self.encoder.training
        self.encoder.eval()
        try:
            chunks = []
            for start in range(0, len(images), BATCH_SIZE):
                batch = images[start:start + BATCH_SIZE].to(self.device, non_blocking=True)
                pixels = eval_transform(batch, **self.transform)
                with self.autocast():
                    chunks.append(read_feature(self.encoder, self.spec, pixels).float().cpu().numpy())
            return np.concatenate(chunks)
        finally:
            self.encoder.train(was_training)


def build_probe(run: Run) -> KnnProbe | None:
    """The run's probe (call it on rank 0 only), or None when ``run.probe_every_steps`` is 0 or no labels are
    available (logged either way). A ``run.eval_data`` that cannot be read ends the run with a one-line error."""
    settings = run.cfg.run
    if settings.probe_every_steps <= 0 or settings.probe_images <= 0:
        return None
    cfg = run.cfg
    prep = preprocessing(cfg, run.mean, run.std)
    try:
        images = probe_images(run.loader.dataset, eval_data=settings.eval_data, load_size=int(prep["resize"]),
                              max_images=settings.probe_images, seed=settings.seed,
                              num_workers=min(cfg.data.num_workers, 8), image_root=cfg.data.image_root)
    except (SourceError, FileNotFoundError) as err:
        sys.exit(f"pretrain: run.eval_data: {err}")
    if images is None:
        log.info("kNN probe: off (the training images have no labels, or one class; see --eval-data)")
        return None
    log.info("kNN probe: %s, every %d steps", images.description, settings.probe_every_steps)
    return KnnProbe(images, run.target.encoder, feature=cfg.model.feature, eval_preprocessing=prep,
                    device=run.device, autocast=run.autocast, every_steps=settings.probe_every_steps)


def probe_images(train_dataset: Dataset, *, eval_data: str | None, load_size: int, max_images: int, seed: int,
                 num_workers: int = 0, image_root: str | None = None) -> ProbeImages | None:
    """The probe's bank and queries (see the module docstring), decoded; None when there are no labels."""
    if eval_data is None:
        return _split_one(train_dataset, "training images", max_images, seed, num_workers)
    if eval_data in MEMORY_SOURCES and not Path(eval_data).exists():
        bank = build_dataset(eval_data, split="train", load_size=load_size, seed=seed)
        queries = build_dataset(eval_data, split="test", load_size=load_size, seed=seed)
        return _two_sets(bank, queries, f"{eval_data} train/test", max_images, seed, num_workers)
    train = list_images("auto", eval_data, split="train", image_root=image_root)
    if not train.labelled:
        raise SourceError(f"{eval_data} has no labels ({train.describe()}): the probe needs class folders or a "
                          "file list with labels")
    path = Path(eval_data)
    if path.is_dir() and any((path / name).is_dir() for name in SPLIT_FOLDERS["test"]):
        test = relabel(list_images("auto", eval_data, split="test", image_root=image_root), train.classes)
        return _two_sets(ImageListDataset(train, load_size=load_size), ImageListDataset(test, load_size=load_size),
                         f"{eval_data} train/val", max_images, seed, num_workers)
    return _split_one(ImageListDataset(train, load_size=load_size), str(eval_data), max_images, seed, num_workers)


def _labels(dataset: Dataset) -> np.ndarray | None:
    labels = getattr(dataset, "labels", None)
    if labels is None:
        return None
    labels = np.asarray(labels)
    return labels if len(np.unique(labels)) >= 2 else None


def _capped(max_images: int, dataset: Dataset) -> int:
    """``max_images`` or fewer, so the uint8 images fit in ``MAX_PROBE_BYTES``."""
    image = dataset[0].image
    return max(2, min(max_images, MAX_PROBE_BYTES // max(1, image.numel())))


def _split_one(dataset: Dataset, name: str, max_images: int, seed: int, num_workers: int) -> ProbeImages | None:
    labels = _labels(dataset)
    if labels is None or len(dataset) < 4:
        return None
    total = min(len(dataset), _capped(max_images, dataset))
    order = np.random.default_rng([seed, 7]).permutation(len(dataset))[:total]
    num_queries = max(1, round(total * QUERY_FRACTION))
    query_idx, bank_idx = order[:num_queries], order[num_queries:]
    bank, bank_labels = _decode(dataset, bank_idx, num_workers)
    queries, query_labels = _decode(dataset, query_idx, num_workers)
    return ProbeImages(bank, bank_labels, queries, query_labels,
                       f"{len(bank_idx)} bank and {len(query_idx)} query images from the {name} (seeded, disjoint)")


def _two_sets(bank_set: Dataset, query_set: Dataset, name: str, max_images: int, seed: int,
              num_workers: int) -> ProbeImages:
    if _labels(bank_set) is None or getattr(query_set, "labels", None) is None:
        raise SourceError(f"{name}: the probe needs labels in both splits")
    total = _capped(max_images, bank_set)
    num_queries = min(len(query_set), max(1, round(total * QUERY_FRACTION)))
    num_bank = min(len(bank_set), total - num_queries)
    bank_idx = np.sort(np.random.default_rng([seed, 7]).permutation(len(bank_set))[:num_bank])
    query_idx = np.sort(np.random.default_rng([seed, 8]).permutation(len(query_set))[:num_queries])
    bank, bank_labels = _decode(bank_set, bank_idx, num_workers)
    queries, query_labels = _decode(query_set, query_idx, num_workers)
    return ProbeImages(bank, bank_labels, queries, query_labels,
                       f"{num_bank} bank and {num_queries} query images from {name}")


def _decode(dataset: Dataset, indices: np.ndarray, num_workers: int) -> tuple[Tensor, np.ndarray]:
    """Decode ``dataset[indices]`` once. The loader gets its own generator: decoding must not draw from the global
    RNG, which drives the augmentations and is checkpointed for an exact resume."""
    loader = DataLoader(Subset(dataset, indices.tolist()), batch_size=BATCH_SIZE, shuffle=False,
                        num_workers=num_workers, collate_fn=collate_views, generator=torch.Generator())
    images, labels = [], []
    for batch_images, batch_labels, _ in loader:
        images.append(batch_images)
        labels.append(batch_labels.numpy())
    return torch.cat(images), np.concatenate(labels)
