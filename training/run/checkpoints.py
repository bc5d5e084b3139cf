"""A pretraining run's ``checkpoint.pt``: whether to resume from it, resuming, and writing it.

Kept out of ``training/pretrain.py`` so the entry script reads as the run's steps. What a checkpoint holds is
named in ``training/run/state.py`` (``TrainState``, the position and RNG streams) and ``training/run/length.py``
(the run length); this module decides when it is read and written, and by which rank.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training import distributed as dist
from training.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, copy_checkpoint, load_checkpoint
from training.model.vit import encoder_kwargs
from training.run.build import Run, preprocessing
from training.run.length import StoredLength
from training.run.stall import Adaptation
from training.run.state import Progress, TrainState, restore_progress, save_progress
from training.run.step import StepOutput

__all__ = ["Checkpoints", "check_finite", "checkpoint_metadata"]

log = logging.getLogger("msn.train")


@dataclass
class Checkpoints:
    """The run's ``checkpoint.pt``: resuming from it and writing it (every rank calls ``save``; rank 0 writes).

    Only rank 0 writes, atomically, so the file is always one complete checkpoint; ``launch`` (rank 0) is the id
    of this launch, stored in every checkpoint so that a torchrun restart resumes only what its launch wrote.
    """

    run: Run
    state: TrainState
    output_dir: Path
    launch: str | None = None
    saved_step: int = -1
    resume_step: int = field(default=-1, init=False)  # the step rank 0 read; every rank must load that same step
    stored_precision: str | None = field(default=None, init=False)  # what the resumed checkpoint trained in
    stored_run: dict[str, Any] | None = field(default=None, init=False)  # its run config (attention kernel, threads)
    stored_length: StoredLength | None = field(default=None, init=False)  # the resumed run's length, if stored
    # a switch made on a stall (--on-stall adapt; a run event, training/run/events.py, sets it): stored in every
    # later checkpoint, and the one a resumed checkpoint holds
    adaptation: Adaptation | None = field(default=None, init=False)
    stored_adaptation: Adaptation | None = field(default=None, init=False)
    _stored: dict[str, Any] | None = field(default=None, init=False, repr=False)  # rank 0's copy: read once

    @property
    def path(self) -> Path:
        return self.output_dir / "checkpoint.pt"

    def should_resume(self, *, asked: bool) -> bool:
        """Whether every rank continues from ``checkpoint.pt``: with ``--resume``, or when torchrun restarted the
        workers (same command line, no ``--resume``) of the launch that wrote it. Rank 0 decides for all."""
        step = -1
        if self.run.info.rank == 0:
            for leftover in self.output_dir.glob(".checkpoint*.tmp"):  # a write killed before its rename
                log.info("removing %s, left by an interrupted checkpoint write", leftover.name)
                leftover.unlink(missing_ok=True)
            step = self._resumable_step(asked)
        self.resume_step = dist.all_gather_object(step)[0]
        return self.resume_step >= 0

    def _resumable_step(self, asked: bool) -> int:
        if not self.path.exists():
            return -1
        restart = dist.restart_count()
        if not asked and not restart:
            log.warning("%s is overwritten by this run's checkpoints (--resume continues it)", self.path)
            return -1
        self._stored = load_checkpoint(self.path)
        if asked or self._stored.get("launch") == self.launch:
            return self._stored["step"]
        log.warning("torchrun restart %d: %s is from an earlier launch, not this one: starting over (--resume "
                    "continues it)", restart, self.path)
        self._stored = None
        return -1

    def resume(self) -> Progress:
        """Load the weights and optimiser into ``state`` and keep the stored precision and run length (any
        checkpoint format so far: ``StoredLength.read``); return the position to go on from."""
        stored, self._stored, rank = self._stored, None, self.run.info.rank
        if stored is None:
            if not self.path.exists():  # e.g. an output directory that not every node shares
                sys.exit(f"pretrain: rank {rank} finds no {self.path}: every rank must see the same output "
                         "directory")
            stored = load_checkpoint(self.path)
        if self.resume_step >= 0 and stored["step"] != self.resume_step:
            sys.exit(f"pretrain: rank {rank} read step {stored['step']} from {self.path}, rank 0 step "
                     f"{self.resume_step}: every rank must see the same output directory")
        self.state.load_state_dict(stored)
        self.stored_precision = stored.get("precision")
        self.stored_run = dict(stored.get("config", {}).get("run", {}))
        self.stored_length = StoredLength.read(stored)
        self.adaptation = self.stored_adaptation = Adaptation.from_record(stored.get("adapted"))
        run = self.run
        progress = restore_progress(stored, steps_per_epoch=run.steps_per_epoch, info=run.info,
                                    mask_generator=run.mask_generator, seed=run.cfg.run.seed)
        self.saved_step = progress.step
        restart = dist.restart_count()
        log.info("resumed from %s at step %d (epoch %d, batch %d)%s", self.path, progress.step, progress.epoch,
                 progress.batch_in_epoch, f" after torchrun restart {restart}" if restart else "")
        return progress

    def save(self, progress: Progress, last: StepOutput) -> None:
        check_finite(last, progress.step)
        run = self.run
        payload = {**self.state.state_dict(), **checkpoint_metadata(run), "launch": self.launch,
                   "adapted": self.adaptation.record() if self.adaptation is not None else None}
        save_progress(self.path, payload, progress, steps_per_epoch=run.steps_per_epoch, info=run.info,
                      mask_generator=run.mask_generator, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION)
        self.saved_step = progress.step

    def keep_epoch_copy(self, epoch: int) -> None:
        if self.run.info.rank == 0:
            copy_checkpoint(self.path, self.output_dir / f"checkpoint-ep{epoch:04d}.pt")


def check_finite(out: StepOutput, step: int) -> None:
    """Checked before every checkpoint (one sync), so a diverged run never overwrites a good checkpoint."""
    if not math.isfinite(out.loss.item()):
        raise FloatingPointError(f"loss is {out.loss.item()} at step {step}: stopping before it is saved")


def checkpoint_metadata(run: Run) -> dict[str, Any]:
    """What export and evaluation read besides the weights: the config, the trunk's shape, the preprocessing."""
    return {"config": run.cfg.to_dict(), "arch": run.cfg.model.arch, "precision": run.precision,
            "encoder_kwargs": encoder_kwargs(run.online.net.encoder),
            "preprocessing": preprocessing(run.cfg, run.mean, run.std)}
