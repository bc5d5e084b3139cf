"""How long a pretraining run is, decided once, and the schedules sized by that decision.

A run's length is ``RunLength``: the schedules' total steps and warm-up steps, and the step the loop stops at.
``decide_run_length`` is the only place that reads ``optim.epochs``, ``optim.total_steps``,
``optim.budget_minutes``, ``optim.warmup_epochs`` and ``run.max_steps`` to fix it, in this order:

1. a resumed checkpoint's stored ``total_steps`` (so ``--resume`` follows the same schedules, budget or not);
2. ``optim.total_steps``;
3. ``optim.budget_minutes``: real optimiser steps on the first batch are timed (``training/run/budget.py``, which
   undoes them) with the schedules' starting values, and the steps that fit in the rest of the budget are kept;
4. ``optim.epochs`` of ``steps_per_epoch``.

Warm-up lasts ``warmup_epochs`` epochs (official) when the config counts the run in epochs; for a step count or a
budget it is the same fraction of the run, ``warmup_epochs / epochs``. ``build_schedules`` then turns the length
into the cosine learning-rate, weight-decay and EMA schedules, which therefore end with the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from training.config import Config
from training.run.budget import plan_budget
from training.run.build import Run
from training.run.schedules import Schedules
from training.run.step import start_hyperparameters, train_step

__all__ = ["RunLength", "build_schedules", "decide_run_length"]

log = logging.getLogger("msn.train")


@dataclass(frozen=True)
class RunLength:
    """The run's length in optimiser steps. ``stop_at`` < ``total_steps`` only when ``run.max_steps`` cuts it."""

    total_steps: int
    warmup_steps: int
    stop_at: int
    decided_by: str  # "checkpoint", "optim.total_steps", "optim.budget_minutes" or "optim.epochs", for the log

    def describe(self) -> str:
        stop = f", stopping at step {self.stop_at}" if self.stop_at < self.total_steps else ""
        return f"{self.total_steps} steps ({self.warmup_steps} warm-up) from {self.decided_by}{stop}"


def decide_run_length(run: Run, *, stored_total_steps: int | None, started_at: float) -> RunLength:
    """The run's length from a resumed checkpoint, the config, or a timed budget.

    ``started_at`` is the ``time.monotonic()`` reading the budget counts from. With a budget this runs (and
    undoes) a few optimiser steps, so every rank must call it.
    """
    cfg, steps_per_epoch = run.cfg, run.steps_per_epoch
    optim = cfg.optim
    if stored_total_steps is not None:
        total_steps, decided_by = stored_total_steps, "checkpoint"
    elif optim.total_steps is not None:
        total_steps, decided_by = optim.total_steps, "optim.total_steps"
    elif optim.budget_minutes is not None:
        total_steps, decided_by = _steps_in_budget(run, started_at), "optim.budget_minutes"
    else:
        total_steps, decided_by = optim.epochs * steps_per_epoch, "optim.epochs"
    counted_in_epochs = optim.total_steps is None and optim.budget_minutes is None
    if counted_in_epochs:
        warmup_steps = int(optim.warmup_epochs * steps_per_epoch)
    else:
        warmup_steps = round(optim.warmup_epochs / optim.epochs * total_steps)
    stop_at = min(total_steps, cfg.run.max_steps or total_steps)
    return RunLength(total_steps, warmup_steps, stop_at, decided_by)


def _steps_in_budget(run: Run, started_at: float) -> int:
    """Time real steps, each fetching its batch from the loader as the loop does (undone afterwards), and count
    the steps left in the budget. Timing one cached batch instead measured ~20 % fewer seconds per step than the
    loop then took on the demo (fetching, collating and logging are part of a step's cost)."""
    minutes = run.cfg.optim.budget_minutes
    batches = _cycle(run.loader)  # a small dataset may hold fewer batches than calibration takes
    hyper = start_hyperparameters(run.cfg)

    def step(_: int) -> None:
        out = train_step(run, hyper, next(batches)[0])
        out.metrics()  # the loop reads the step's metrics when it logs: the same host sync

    plan = plan_budget(step, [run.online, run.target], run.optimizer,
                       budget_seconds=60 * minutes, started_at=started_at, mask_generator=run.mask_generator)
    log.info("budget %.1f min: %.3f s/step measured over the first steps -> %d steps (%.0f images/s)",
             minutes, plan.seconds_per_step, plan.total_steps, run.global_batch / plan.seconds_per_step)
    return plan.total_steps


def _cycle(loader):
    while True:
        yield from loader


def build_schedules(cfg: Config, length: RunLength) -> Schedules:
    """The official learning-rate, weight-decay, EMA and sharpening schedules over the decided length."""
    o = cfg.optim
    return Schedules(
        total_steps=length.total_steps, warmup_steps=length.warmup_steps,
        start_lr=o.start_lr, ref_lr=o.lr, final_lr=o.final_lr, ref_weight_decay=o.weight_decay,
        final_weight_decay=o.final_weight_decay, ema_start=o.ema_start, ema_end=o.ema_end,
        horizon_scale=o.horizon_scale, sharpen_start=cfg.loss.sharpen_start, sharpen_end=cfg.loss.sharpen_end,
    )
