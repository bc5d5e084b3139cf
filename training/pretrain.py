"""MSN pretraining.

    torchrun --nproc_per_node=N training/pretrain.py --config configs/X.yaml --output-dir runs/X [--set k=v ...]
    msn-pretrain --config configs/X.yaml --output-dir runs/X            # one process, same thing
    torchrun ... --resume        # continue exactly from runs/X/checkpoint.pt

One process per device (CPU processes use gloo, GPUs NCCL); multi-node through torchrun's rendezvous flags.
Per image and step: an unmasked target view goes through the EMA target encoder; a patch-dropped anchor view and
`num_focal` small focal views go through the online encoder; the anchors' prototype assignments are trained to
match the sharpened, Sinkhorn-balanced assignment of the target (training/model/losses.py). The run lasts
`optim.epochs`, `optim.total_steps` optimiser steps, or `optim.budget_minutes` of wall-clock time.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch

from training import distributed as dist
from training.run.budget import plan_budget
from training.run.build import (
    Run,
    StepOutput,
    build_run,
    build_schedules,
    embedding_spread,
    preprocessing,
    train_step,
)
from training.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, copy_checkpoint, load_checkpoint
from training.config import Config, ConfigError, dump_config, load_config
from training.run.monitor import TrainingMonitor
from training.run.state import Progress, TrainState, batches_from, restore_progress, save_progress
from training.model.vit import encoder_kwargs

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
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"pretrain: {err}")
    info = dist.init_distributed(cfg.run.device)
    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        train(cfg, info, args.output_dir, resume=args.resume)
    finally:
        dist.cleanup()


def train(cfg: Config, info: dist.DistInfo, output_dir: Path, *, resume: bool) -> None:
    started_at = time.monotonic()
    is_main, checkpoint_path = info.rank == 0, output_dir / "checkpoint.pt"
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, output_dir / "config.yaml")
    run = build_run(cfg, info)
    state, progress = TrainState(run.online, run.target, run.optimizer), Progress()
    if resume and checkpoint_path.exists():
        stored = load_checkpoint(checkpoint_path)
        state.load_state_dict(stored)
        progress = restore_progress(stored, steps_per_epoch=run.steps_per_epoch, info=info,
                                    mask_generator=run.mask_generator, seed=cfg.run.seed)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", checkpoint_path, progress.step,
                 progress.epoch, progress.batch_in_epoch)
    state.total_steps = state.total_steps or plan_total_steps(run, started_at)
    schedules = build_schedules(cfg, state.total_steps, run.steps_per_epoch)
    stop_at = min(state.total_steps, cfg.run.max_steps or state.total_steps)
    monitor = TrainingMonitor(output_dir, enabled=is_main, total_steps=stop_at, start_step=progress.step,
                              num_prototypes=cfg.model.num_prototypes, progress_bar=cfg.run.progress_bar,
                              tensorboard=cfg.run.tensorboard)
    monitor.write(describe(run, state.total_steps))

    skipped_files = 0
    batches = batches_from(run.loader, run.sampler, progress, cfg.data.batch_size)
    while progress.step < stop_at:
        images, _labels, num_skipped = next(batches)
        skipped_files += num_skipped
        out = train_step(run, schedules, progress.step, images)
        epoch_ended = progress.advance(run.steps_per_epoch)
        monitor.step(run.global_batch)
        if progress.step % cfg.run.log_every_steps == 0 or progress.step == stop_at:
            monitor.log(progress.step, progress.epoch, log_record(out, run, skipped_files))
        if progress.step % cfg.run.checkpoint_every_steps == 0 or epoch_ended or progress.step == stop_at:
            check_finite(out, progress.step)
            payload = {**state.state_dict(), **checkpoint_metadata(run)}
            save_progress(checkpoint_path, payload, progress, steps_per_epoch=run.steps_per_epoch, info=info,
                          mask_generator=run.mask_generator, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION)
            keep_every = cfg.run.keep_epoch_checkpoints
            if is_main and epoch_ended and keep_every and progress.epoch % keep_every == 0:
                copy_checkpoint(checkpoint_path, output_dir / f"checkpoint-ep{progress.epoch:04d}.pt")
    if skipped_files:
        log.warning("%d unreadable image files were skipped", skipped_files)
    minutes = (time.monotonic() - started_at) / 60
    monitor.write(f"done: step {progress.step} of {state.total_steps}, epoch {progress.epoch}, {minutes:.1f} min; "
                  f"checkpoint at {checkpoint_path}")
    monitor.close()


def plan_total_steps(run: Run, started_at: float) -> int:
    """The schedule's length: ``optim.total_steps``, a measured ``optim.budget_minutes``, or epochs."""
    optim = run.cfg.optim
    if optim.total_steps is not None:
        return optim.total_steps
    if optim.budget_minutes is None:
        return optim.epochs * run.steps_per_epoch
    images = next(iter(run.loader))[0]
    probe = build_schedules(run.cfg, 1_000_000, run.steps_per_epoch)  # calibration steps only: their values are undone
    plan = plan_budget(lambda i: train_step(run, probe, i, images), [run.online, run.target], run.optimizer,
                       budget_seconds=60 * optim.budget_minutes, started_at=started_at,
                       mask_generator=run.mask_generator)
    log.info("budget %.1f min: %.3f s/step measured over the first steps -> %d steps (%.0f images/s)",
             optim.budget_minutes, plan.seconds_per_step, plan.total_steps, run.global_batch / plan.seconds_per_step)
    return plan.total_steps


def describe(run: Run, total_steps: int) -> str:
    params = sum(p.numel() for p in run.online.parameters()) / 1e6
    return (f"MSN: {params:.2f}M trainable parameters, {run.num_images} images, {run.steps_per_epoch} steps/epoch, "
            f"{total_steps} steps in the schedule, global batch {run.global_batch}, world size "
            f"{run.info.world_size}, device {run.device}, {run.precision}")


def log_record(out: StepOutput, run: Run, skipped_files: int) -> dict:
    record = {"loss": out.loss.item(), **out.terms.summary(), "lr": out.lr, "weight_decay": out.weight_decay,
              "ema_momentum": out.ema_momentum, "grad_norm": float(out.grad_norm),
              "embedding_spread": embedding_spread(out.target_z), "skipped_files": skipped_files}
    if run.device.type == "cuda":
        record["max_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    return record


def check_finite(out: StepOutput, step: int) -> None:
    """Checked before every checkpoint (one sync), so a diverged run never overwrites a good checkpoint."""
    if not math.isfinite(out.loss.item()):
        raise FloatingPointError(f"loss is {out.loss.item()} at step {step}: stopping before it is saved")


def checkpoint_metadata(run: Run) -> dict:
    """What export and evaluation read besides the weights: the config, the trunk's shape, the preprocessing."""
    return {"config": run.cfg.to_dict(), "arch": run.cfg.model.arch,
            "encoder_kwargs": encoder_kwargs(run.online.net.encoder),
            "preprocessing": preprocessing(run.cfg, run.mean, run.std)}


if __name__ == "__main__":
    main()
