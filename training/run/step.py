"""One MSN optimiser step: views, masks, forward, loss, AdamW update, EMA of the target.

The step takes its hyper-parameters as values (``StepHyperparameters``), not a schedule and a step index: the loop
reads them from the run's schedules, while budget calibration (``training/run/length.py``) times the same step
before any schedule exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from training.config import Config
from training.masking import random_keep_idx
from training.model.losses import LossTerms
from training.model.msn import ema_update
from training.run.build import Run
from training.run.schedules import StepHyperparameters

__all__ = ["StepOutput", "Views", "embedding_spread", "make_views", "start_hyperparameters", "train_step",
           "update", "usage_entropy"]


@dataclass
class StepOutput:
    """What one step leaves for logging; tensors stay on the device until a log step reads them."""

    loss: Tensor
    terms: LossTerms
    grad_norm: Tensor
    target_z: Tensor
    hyper: StepHyperparameters

    def metrics(self) -> dict[str, float]:
        """The logged record of this step (reading it syncs with the device, so only log steps call it)."""
        return {"loss": self.loss.item(), **self.terms.summary(), "lr": self.hyper.lr,
                "weight_decay": self.hyper.weight_decay, "ema_momentum": self.hyper.ema_momentum,
                "grad_norm": float(self.grad_norm), "embedding_spread": embedding_spread(self.target_z),
                "target_usage_entropy": usage_entropy(self.terms.target_probs)}


def start_hyperparameters(cfg: Config) -> StepHyperparameters:
    """The schedules' starting values, read from the config: for steps that run before the schedules exist."""
    o = cfg.optim
    return StepHyperparameters(lr=o.start_lr, weight_decay=o.weight_decay, ema_momentum=o.ema_start,
                               sharpen_temperature=cfg.loss.sharpen_start)


@dataclass
class Views:
    """One step's inputs on the device: the augmented views and the anchor's kept patches (None: no masking)."""

    target: Tensor
    anchor: Tensor
    focal: Tensor
    keep_idx: Tensor | None


def train_step(run: Run, hyper: StepHyperparameters, images: Tensor) -> StepOutput:
    """One MSN step on a uint8 batch with the given learning rate, weight decay, EMA momentum and sharpening."""
    return update(run, hyper, make_views(run, images))


def make_views(run: Run, images: Tensor) -> Views:
    """The step's augmentation and mask: a separate function so that it can be timed (and later run ahead) alone.

    Draws from the same RNG streams in the same order as always (kornia: torch's default generator; masks:
    ``run.mask_generator``), so splitting the step here changes no result.
    """
    cfg = run.cfg
    images = images.to(run.device, non_blocking=True)
    # target (unmasked), anchor (patch-dropped by keep_idx), focal crops; no gradients through these
    with torch.no_grad():
        target_views, anchor_views, focal_views = run.augment(images)
    if cfg.mask.share_target_view:
        anchor_views = target_views
    keep_idx = None
    if cfg.mask.ratio > 0:
        num_patches = (cfg.model.image_size // cfg.model.patch_size) ** 2
        # non_blocking: a blocking copy from pageable host memory waits for the whole CUDA stream every step
        keep_idx = random_keep_idx(images.shape[0], num_patches, cfg.mask.ratio, shared=cfg.mask.shared,
                                   generator=run.mask_generator).to(run.device, non_blocking=True)
    return Views(target_views, anchor_views, focal_views, keep_idx)


def update(run: Run, hyper: StepHyperparameters, views: Views) -> StepOutput:
    """Forward, loss, backward, AdamW and EMA on views already made (:func:`make_views`)."""
    cfg = run.cfg
    # hyper-parameters: the schedules are pure functions of the step, so a resumed run sees the same values
    for group in run.optimizer.param_groups:
        group["lr"] = hyper.lr
        if not group["wd_exclude"]:
            group["weight_decay"] = hyper.weight_decay

    # forward: online anchors (masked + focal) vs. EMA target; the loss itself runs in fp32
    with run.autocast():
        anchor_z, prototypes = run.model(views.anchor, views.keep_idx, views.focal)
        with torch.no_grad():
            target_z = run.target(views.target)
    loss, terms = run.criterion(anchor_z, target_z, prototypes, hyper.sharpen_temperature)

    # update: clip the encoder + head (not the prototypes), AdamW step, EMA of the target's parameters
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.online.net.parameters(), cfg.optim.clip_grad)
    run.optimizer.step()
    ema_update(run.target, run.online.net, hyper.ema_momentum, copy_buffers=False)
    return StepOutput(loss.detach(), terms, grad_norm.detach(), target_z.detach(), hyper)


@torch.no_grad()
def usage_entropy(probs: Tensor) -> float:
    """Entropy of the mean of assignments (B, K), this rank's batch: log K when every prototype is used evenly, 0
    when all fall on one (training/run/collapse.py reads it)."""
    mean = probs.float().mean(dim=0)
    return float(-torch.special.xlogy(mean, mean).sum())


@torch.no_grad()
def embedding_spread(embeddings: Tensor) -> float:
    """Per-dimension std of L2-normalised embeddings times sqrt(d): ~1 when spread out, 0 when collapsed."""
    z = torch.nn.functional.normalize(embeddings.float(), dim=1)
    return float(z.std(dim=0).mean() * math.sqrt(z.shape[1]))
