"""Resumable training state: the position in the data, every rank's RNG streams, and what a checkpoint holds.

Two trainers share this skeleton: MSN pretraining (``TrainState``, below) and the RCDM decoder
(``visualizer/train.py``). Both resume bit-exactly, mid-epoch, after a kill: a checkpoint records the step, the
epoch and the batch within it, the sampler's geometry (world size, steps per epoch) and the RNG streams of every
rank; ``restore_progress`` puts them back, or warns and reseeds when the geometry changed.

``TrainState`` is the one place that names the keys of an MSN checkpoint; ``msn-export``
(``training.bundle.sources``) reads the target encoder through ``target_encoder_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from training import distributed as dist
from training.checkpoint import capture_rng_state, restore_rng_state, save_checkpoint
from training.data import ResumableDistributedSampler

log = logging.getLogger("msn.train")

__all__ = ["Progress", "TrainState", "batches_from", "restore_progress", "save_progress", "target_encoder_weights"]


@dataclass
class Progress:
    """Where a run stands: optimiser steps taken, and the epoch and batch the next step reads."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def advance(self, steps_per_epoch: int) -> bool:
        """Count one optimiser step; returns True when that step ended an epoch."""
        self.step += 1
        self.batch_in_epoch += 1
        if self.batch_in_epoch == steps_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            return True
        return False


def batches_from(loader: DataLoader, sampler: ResumableDistributedSampler, progress: Progress,
                 batch_size: int) -> Iterator[Any]:
    """The loader's batches from ``progress`` on, epoch after epoch, without end.

    The caller advances ``progress`` after each batch; a new epoch (new shuffle) starts when it wraps to batch 0.
    """
    while True:
        sampler.set_epoch(progress.epoch)
        sampler.set_start_index(progress.batch_in_epoch * batch_size)
        for batch in loader:
            yield batch
            if progress.batch_in_epoch == 0:
                break


def save_progress(path: Path, payload: dict[str, Any], progress: Progress, *, steps_per_epoch: int,
                  info: dist.DistInfo, mask_generator: torch.Generator | None, fmt: str, version: int) -> None:
    """Write ``payload`` + the position + every rank's RNG streams atomically. Every rank must call it."""
    rng = dist.all_gather_object(capture_rng_state(mask_generator))
    if info.rank == 0:
        save_checkpoint(path, {
            **payload, "step": progress.step, "epoch": progress.epoch, "batch_in_epoch": progress.batch_in_epoch,
            "steps_per_epoch": steps_per_epoch, "world_size": info.world_size, "rng": rng,
        }, fmt=fmt, version=version)


def restore_progress(state: dict[str, Any], *, steps_per_epoch: int, info: dist.DistInfo,
                     mask_generator: torch.Generator | None, seed: int) -> Progress:
    """The position stored in ``state``; this rank's RNG streams too when the run's geometry is unchanged."""
    progress = Progress(state["step"], state["epoch"], state["batch_in_epoch"])
    if state["world_size"] == info.world_size and state["steps_per_epoch"] == steps_per_epoch:
        restore_rng_state(state["rng"][info.rank], mask_generator)
    else:
        log.warning("resuming with a different world size or batch size: continuing, but not bit-exactly")
        torch.manual_seed(seed + info.rank + progress.step)
    return progress


class TrainState:
    """An MSN run's learnable state and schedule length; ``state_dict`` names every checkpoint key once.

    ``length`` is the run's schedule (``training.run.length.RunSchedule``): its ``checkpoint_entries`` store the current
    ``total_steps`` and the ``run_length`` behind it (the first length's total and warm-up, a budget run's resizes
    and the seconds of budget used), so a resumed run follows the same schedules; ``training.run.length.StoredLength``
    reads them back (``training/run/checkpoints.py`` does on resume).
    """

    def __init__(self, online: nn.Module, target: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.online, self.target, self.optimizer = online, target, optimizer
        self.length: Any = None

    def state_dict(self) -> dict[str, Any]:
        length = self.length.checkpoint_entries() if self.length is not None else {"total_steps": None}
        return {
            "encoder": self.online.net.encoder.state_dict(), "head": self.online.net.head.state_dict(),
            "prototypes": self.online.prototypes.detach().clone(),
            "target_encoder": self.target.encoder.state_dict(), "target_head": self.target.head.state_dict(),
            "optimizer": self.optimizer.state_dict(), **length,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.online.net.encoder.load_state_dict(state["encoder"])
        self.online.net.head.load_state_dict(state["head"])
        with torch.no_grad():
            self.online.prototypes.copy_(state["prototypes"])
        self.target.encoder.load_state_dict(state["target_encoder"])
        self.target.head.load_state_dict(state["target_head"])
        self.optimizer.load_state_dict(state["optimizer"])


def target_encoder_weights(checkpoint: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(target-encoder state dict, ``VisionTransformer`` kwargs) of a pretraining checkpoint."""
    missing = [key for key in ("target_encoder", "encoder_kwargs") if key not in checkpoint]
    if missing:
        raise KeyError(f"not an MSN pretraining checkpoint: no {', '.join(missing)}")
    return checkpoint["target_encoder"], checkpoint["encoder_kwargs"]
