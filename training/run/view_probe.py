"""Is the encoder learning? A label-free signal, read on a few of the user's own images during the run.

The loss of an MSN run says little on its own: a stalled run sits near log K, but so does a useful run on some
folders (the rendered glyphs plateau 7 % below it whatever their views), and a small folder seen for many epochs
drifts below any fixed threshold without learning (docs/results-notes.md, "A label-free signal of learning"). What
MSN asks of its target encoder is that two views of one image land together, apart from other images. So the
probe asks exactly that of the target encoder, against its own start:

- ``run.view_probe_images`` images (128) are drawn (seeded) from the training set and decoded once, on rank 0,
  when the run is built; each gets two views made once with the run's own view pipeline (random crops, flips,
  jitter: the target views' recipe), in a private RNG stream, so the probe draws nothing from the run's streams
  (a resumed run stays bit-exact);
- a probe encodes both views with the target encoder (inference mode) and scores, for the paper's CLS token and
  for the served feature: **view top-1**, how often a view's nearest neighbour (cosine) among the other images'
  second views is its own second view (%), and **view margin**, how far the two views' cosine stands above the
  cosines to the other images, in standard deviations of the latter (a continuous form of the same question); and
  the **effective rank** of the served feature over the images (exp of the entropy of the normalised singular
  values: how many directions the feature uses);
- the first probe runs before the first optimiser step: the encoder's start (its initial or warm-start weights).
  The stall detector (``training/run/stall.py``) reads later probes against it.

Not held out: the images stay in the training set. The probe compares the encoder with its own start on the same
images, which is what tells learning from not learning; holding images out would take a tenth of a small folder
from training, and a stall detector need not measure generalisation (the kNN probe, ``probe.py``, does when
labels exist).

Cost: two forward passes over those images, about every 1 % of the planned steps, postponed while the
probes so far took more than ``MAX_TIME_FRACTION`` of the training time (the demo's 10-minute run on 2 cores: 88 probes,
4.8 s, under 1 % of it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from training.model.readout import feature_spec, read_features
from training.model.vit import VisionTransformer
from training.run.build import Run
from training.run.probe import _decode
from training.views import MultiViewAugment

__all__ = ["ViewProbe", "ViewSignals", "build_view_probe", "view_signals"]

EVERY_FRACTION = 0.01  # a probe about every this share of the planned steps ...
MIN_EVERY_STEPS = 10  # ... at least this many steps apart
MAX_TIME_FRACTION = 0.05  # probes may take at most this share of the training time between them
BATCH_SIZE = 256
VIEW_SEED = 20_220_413  # the views' private stream (a fixed seed: the same views in every launch of a run)


@dataclass(frozen=True)
class ViewSignals:
    """One probe: view retrieval of the CLS token and of the served feature, and the served feature's rank."""

    step: int
    top1_cls: float  # % of views whose nearest other-view is their own, paper's CLS token
    top1: float  # the same, served feature
    margin_cls: float  # (own-view cosine - mean other cosine) / std of other cosines, averaged over images
    margin: float
    rank: float  # effective rank of the served feature over the probe images
    seconds: float

    def values(self) -> dict[str, float]:
        return {"view_top1_cls": self.top1_cls, "view_top1": self.top1, "view_margin_cls": self.margin_cls,
                "view_margin": self.margin, "feature_rank": self.rank}

    def record(self, start: ViewSignals) -> dict[str, float]:
        """The fields a probe adds to the step's ``metrics.jsonl`` record: its values, the start's (``_start``)
        and its seconds."""
        return {**self.values(), **{f"{key}_start": value for key, value in start.values().items()},
                "view_seconds": self.seconds}


def view_signals(first: Tensor, second: Tensor) -> tuple[float, float]:
    """(top-1 %, mean margin) of ``first[i]`` retrieving ``second[i]`` among all rows of ``second`` by cosine."""
    a = torch.nn.functional.normalize(first.float(), dim=1)
    b = torch.nn.functional.normalize(second.float(), dim=1)
    cos = a @ b.T
    n = cos.shape[0]
    own = cos.diagonal()
    top1 = float((cos.argmax(dim=1) == torch.arange(n)).float().mean()) * 100
    others = cos.masked_fill(torch.eye(n, dtype=torch.bool), float("nan"))
    mean, std = others.nanmean(dim=1), _nanstd(others)
    margin = float(((own - mean) / std.clamp(min=1e-6)).mean())
    return top1, margin


def _nanstd(x: Tensor) -> Tensor:
    mean = x.nanmean(dim=1, keepdim=True)
    return ((x - mean) ** 2).nanmean(dim=1).sqrt()


def effective_rank(features: Tensor) -> float:
    """exp(entropy) of the normalised singular values of the centred features (Roy & Vetterli, 2007)."""
    centred = features.float() - features.float().mean(dim=0, keepdim=True)
    singular = torch.linalg.svdvals(centred)
    p = singular / singular.sum().clamp(min=1e-12)
    p = p[p > 0]
    return float(math.exp(float(-(p * p.log()).sum())))


class ViewProbe:
    """The view signals of ``encoder`` on fixed view pairs, when due (``maybe``); ``start`` holds the first probe."""

    def __init__(self, first: Tensor, second: Tensor, encoder: VisionTransformer, *, feature: str,
                 device: torch.device, autocast: Callable[[], AbstractContextManager], every_steps: int,
                 max_time_fraction: float = MAX_TIME_FRACTION) -> None:
        self.first, self.second, self.encoder = first, second, encoder
        self.cls_spec, self.spec = feature_spec(encoder, "cls_pre_norm"), feature_spec(encoder, feature)
        self.device, self.autocast = device, autocast
        self.every_steps, self.max_time_fraction = every_steps, max_time_fraction
        self.next_step, self.probe_seconds = every_steps, 0.0
        self.start: ViewSignals = self.run(0)  # before training: not counted against the probes' share
        self.next_step, self.probe_seconds, self.started = every_steps, 0.0, time.monotonic()

    @property
    def num_images(self) -> int:
        return len(self.first)

    def due(self, step: int) -> bool:
        if step < self.next_step:
            return False
        training_seconds = time.monotonic() - self.started - self.probe_seconds
        return self.probe_seconds <= self.max_time_fraction * training_seconds

    def maybe(self, step: int) -> ViewSignals | None:
        return self.run(step) if self.due(step) else None

    def run(self, step: int) -> ViewSignals:
        began = time.monotonic()
        cls_a, served_a = self._features(self.first)
        cls_b, served_b = self._features(self.second)
        top1_cls, margin_cls = view_signals(cls_a, cls_b)
        top1, margin = view_signals(served_a, served_b)
        rank = effective_rank(served_a)
        seconds = time.monotonic() - began
        self.probe_seconds += seconds
        self.next_step = (step // self.every_steps + 1) * self.every_steps
        return ViewSignals(step, top1_cls, top1, margin_cls, margin, rank, seconds)

    @torch.inference_mode()
    def _features(self, views: Tensor) -> tuple[Tensor, Tensor]:
        was_training = self.encoder.training
        self.encoder.eval()
        try:
            cls, served = [], []
            for begin in range(0, len(views), BATCH_SIZE):
                batch = views[begin:begin + BATCH_SIZE].to(self.device, non_blocking=True)
                with self.autocast():
                    cls_batch, served_batch = read_features(self.encoder, [self.cls_spec, self.spec], batch)
                cls.append(cls_batch.float().cpu())
                served.append(served_batch.float().cpu())
            return torch.cat(cls), torch.cat(served)
        finally:
            self.encoder.train(was_training)


def probe_views(augment: MultiViewAugment, images: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """Two views of each uint8 image with the run's view recipe, drawn in a private stream: the global RNG (which
    drives the run's own augmentations and is checkpointed) is left exactly as it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(VIEW_SEED)
        firsts, seconds = [], []
        for begin in range(0, len(images), BATCH_SIZE):
            target, anchor, _ = augment(images[begin:begin + BATCH_SIZE].to(device))
            firsts.append(target.cpu())
            seconds.append(anchor.cpu())
    return torch.cat(firsts), torch.cat(seconds)


def build_view_probe(run: Run, total_steps: int) -> ViewProbe | None:
    """The run's view probe (rank 0 only), or None when ``run.view_probe_images`` is 0 or the dataset has fewer than
    8 images. Draws its own images."""
    dataset = run.loader.dataset
    if run.cfg.run.view_probe_images <= 0 or len(dataset) < 8:
        return None
    count = min(run.cfg.run.view_probe_images, len(dataset))
    indices = np.sort(np.random.default_rng([run.cfg.run.seed, 11]).permutation(len(dataset))[:count])
    images, _ = _decode(dataset, indices, min(run.cfg.data.num_workers, 8))
    first, second = probe_views(run.augment, images, run.device)  # focal views made once and dropped
    every = max(MIN_EVERY_STEPS, round(EVERY_FRACTION * total_steps))
    return ViewProbe(first, second, run.target.encoder, feature=run.cfg.model.feature, device=run.device,
                     autocast=run.autocast, every_steps=every)

