"""MSN pretraining.

    torchrun --nproc_per_node=N training/pretrain.py --config configs/X.yaml --output-dir runs/X [--set k=v ...]
    msn-pretrain --config configs/X.yaml --output-dir runs/X            # one process, same thing
    torchrun ... --resume        # continue exactly from runs/X/checkpoint.pt

One process per device (CPU processes use gloo, GPUs NCCL); multi-node through torchrun's rendezvous flags.
Per image and step: an unmasked target view goes through the EMA target encoder; a patch-dropped anchor view and
`num_focal` small focal views go through the online encoder; the anchors' prototype assignments are trained to
match the sharpened, Sinkhorn-balanced assignment of the target (training/model/losses.py). The run lasts
`optim.epochs`, `optim.total_steps` optimiser steps, or `optim.budget_minutes` of wall-clock time, decided once
before the loop (training/run/length.py).

`main` reads top to bottom: config -> distributed -> build (and resume) -> run length -> loop -> save.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training import distributed as dist
from training.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, copy_checkpoint, load_checkpoint
from training.config import ConfigError, dump_config, load_config
from training.model.vit import encoder_kwargs
from training.run.build import Run, build_run, preprocessing
from training.run.length import RunLength, build_schedules, decide_run_length
from training.run.monitor import TrainingMonitor
from training.run.schedules import Schedules
from training.run.state import Progress, TrainState, batches_from, restore_progress, save_progress
from training.run.step import StepOutput, train_step

log = logging.getLogger("msn.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML config (keys: see training/config.py)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set optim.budget_minutes=30 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt if it exists")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    # 1. config: YAML + --set overrides; a bad key is an error message, not a traceback
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"pretrain: {err}")
    # 2. distributed: one process per device (torchrun's environment, or a single process)
    info = dist.init_distributed(cfg.run.device)
    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    started_at = time.monotonic()  # a budget counts from here: building, calibration, the loop, checkpoints
    try:
        if info.rank == 0:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, args.output_dir / "config.yaml")
        # 3. build: data, views, networks, loss, optimiser; then the stored position when resuming
        run = build_run(cfg, info)
        state, progress = TrainState(run.online, run.target, run.optimizer), Progress()
        checkpoints = Checkpoints(run, state, args.output_dir)
        if args.resume and checkpoints.path.exists():
            progress = checkpoints.resume()
        # 4. run length, decided once (stored, or from steps, a timed budget or epochs), and the schedules over it
        length = decide_run_length(run, stored_total_steps=state.total_steps, started_at=started_at)
        state.total_steps = length.total_steps  # stored in every checkpoint: --resume keeps this length
        schedules = build_schedules(cfg, length)
        # 5. loop: optimiser steps with logs and periodic checkpoints
        monitor = TrainingMonitor(args.output_dir, enabled=info.rank == 0, total_steps=length.stop_at,
                                  start_step=progress.step, num_prototypes=cfg.model.num_prototypes,
                                  progress_bar=cfg.run.progress_bar, tensorboard=cfg.run.tensorboard)
        monitor.write(describe(run, length))
        last = train_loop(run, schedules, length, progress, monitor, checkpoints)
        # 6. save: the last step's checkpoint, unless the loop just wrote it
        if last is not None and checkpoints.saved_step != progress.step:
            checkpoints.save(progress, last)
        minutes = (time.monotonic() - started_at) / 60
        monitor.write(f"done: step {progress.step} of {length.total_steps}, epoch {progress.epoch}, "
                      f"{minutes:.1f} min; checkpoint at {checkpoints.path}")
        monitor.close()
    finally:
        dist.cleanup()


def train_loop(run: Run, schedules: Schedules, length: RunLength, progress: Progress, monitor: TrainingMonitor,
               checkpoints: Checkpoints) -> StepOutput | None:
    """Optimiser steps from ``progress`` to ``length.stop_at``, with logs and periodic and epoch checkpoints.

    Returns the last step's output (None when there was no step left); the caller writes the last checkpoint.
    """
    cfg, last, skipped_files = run.cfg, None, 0
    batches = batches_from(run.loader, run.sampler, progress, cfg.data.batch_size)
    while progress.step < length.stop_at:
        images, _labels, num_skipped = next(batches)
        skipped_files += num_skipped
        last = train_step(run, schedules.at(progress.step), images)
        epoch_ended = progress.advance(run.steps_per_epoch)
        monitor.step(run.global_batch)
        if progress.step % cfg.run.log_every_steps == 0 or progress.step == length.stop_at:
            monitor.log(progress.step, progress.epoch, log_record(last, run, skipped_files))
        if progress.step % cfg.run.checkpoint_every_steps == 0 or epoch_ended:
            checkpoints.save(progress, last)
            keep_every = cfg.run.keep_epoch_checkpoints
            if epoch_ended and keep_every and progress.epoch % keep_every == 0:
                checkpoints.keep_epoch_copy(progress.epoch)
    if skipped_files:
        log.warning("%d unreadable image files were skipped", skipped_files)
    return last


@dataclass
class Checkpoints:
    """The run's ``checkpoint.pt``: resuming from it and writing it (every rank calls ``save``; rank 0 writes)."""

    run: Run
    state: TrainState
    output_dir: Path
    saved_step: int = -1

    @property
    def path(self) -> Path:
        return self.output_dir / "checkpoint.pt"

    def resume(self) -> Progress:
        """Load the weights, optimiser and stored run length into ``state``; return the position to go on from."""
        stored = load_checkpoint(self.path)
        self.state.load_state_dict(stored)
        run = self.run
        progress = restore_progress(stored, steps_per_epoch=run.steps_per_epoch, info=run.info,
                                    mask_generator=run.mask_generator, seed=run.cfg.run.seed)
        self.saved_step = progress.step
        log.info("resumed from %s at step %d (epoch %d, batch %d)", self.path, progress.step, progress.epoch,
                 progress.batch_in_epoch)
        return progress

    def save(self, progress: Progress, last: StepOutput) -> None:
        check_finite(last, progress.step)
        run = self.run
        payload = {**self.state.state_dict(), **checkpoint_metadata(run)}
        save_progress(self.path, payload, progress, steps_per_epoch=run.steps_per_epoch, info=run.info,
                      mask_generator=run.mask_generator, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION)
        self.saved_step = progress.step

    def keep_epoch_copy(self, epoch: int) -> None:
        if self.run.info.rank == 0:
            copy_checkpoint(self.path, self.output_dir / f"checkpoint-ep{epoch:04d}.pt")


def describe(run: Run, length: RunLength) -> str:
    params = sum(p.numel() for p in run.online.parameters()) / 1e6
    return (f"MSN: {params:.2f}M trainable parameters, {run.num_images} images, {run.steps_per_epoch} steps/epoch, "
            f"{length.describe()}, global batch {run.global_batch}, world size {run.info.world_size}, "
            f"device {run.device}, {run.precision}")


def log_record(out: StepOutput, run: Run, skipped_files: int) -> dict:
    record = {**out.metrics(), "skipped_files": skipped_files, "precision": run.precision}
    if run.device.type == "cuda":
        record["max_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    return record


def check_finite(out: StepOutput, step: int) -> None:
    """Checked before every checkpoint (one sync), so a diverged run never overwrites a good checkpoint."""
    if not math.isfinite(out.loss.item()):
        raise FloatingPointError(f"loss is {out.loss.item()} at step {step}: stopping before it is saved")


def checkpoint_metadata(run: Run) -> dict:
    """What export and evaluation read besides the weights: the config, the trunk's shape, the preprocessing."""
    return {"config": run.cfg.to_dict(), "arch": run.cfg.model.arch, "precision": run.precision,
            "encoder_kwargs": encoder_kwargs(run.online.net.encoder),
            "preprocessing": preprocessing(run.cfg, run.mean, run.std)}


if __name__ == "__main__":
    main()
