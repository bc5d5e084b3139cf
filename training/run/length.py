"""How long a pretraining run is, and the schedules sized by it: decided before the loop, resized by a budget.

A run's length is ``RunLength``: the schedules' total steps and warm-up steps, and the step the loop stops at.
This module is the only place that reads ``optim.epochs``, ``optim.total_steps``, ``optim.budget_minutes``,
``optim.warmup_epochs`` and ``run.max_steps`` to fix it (``decide_run_length``; ``config_total_steps`` holds the
config's part of the rule, which ``training/run/precision_timing.py`` also asks before any timing), in this order:

1. a resumed checkpoint's stored length (so ``--resume`` follows the same schedules, budget or not);
2. ``optim.total_steps``;
3. ``optim.budget_minutes``: real optimiser steps on the first batch are timed (``training/run/budget.py``, which
   undoes them) with the schedules' starting values, and the steps that fit in the rest of the budget are kept;
4. ``optim.epochs`` of ``steps_per_epoch``.

Warm-up lasts ``warmup_epochs`` epochs (official) when the config counts the run in epochs; for a step count or a
budget it is the same fraction of the run, ``warmup_epochs / epochs``. ``build_schedules`` then turns the length
into the cosine learning-rate, weight-decay and EMA schedules, which therefore end with the budget.

``RunSchedule`` is what the loop holds: the length and the schedules, and for a budget run the ``BudgetResizer``
that asks to move the end (and stretch the schedules) when the measured step time says the budget buys more or fewer
steps; the move is a run event (``training/run/events.py``). ``schedule_for`` builds it from the decided config
(``training/run/decide.py`` decides the length first, then the settings that follow it, then builds).
``RunSchedule.checkpoint_entries`` is what a checkpoint stores of it; ``StoredLength.read`` reads it back, from
checkpoints of every earlier format too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from training import distributed as dist
from training.config import Config
from training.run.budget import BUDGET_OVERHEAD, BudgetResizer, Resize, calibrate_budget, steps_for_budget
from training.run.build import Run
from training.run.schedules import ResizedSchedules, Schedules
from training.run.trial import loader_step

__all__ = ["RunLength", "RunSchedule", "StoredLength", "build_schedules", "config_stop_step", "config_total_steps",
           "decide_run_length", "schedule_for", "schedule_run"]

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


@dataclass(frozen=True)
class StoredLength:
    """The run length a checkpoint stores: the first length's total and warm-up, a budget run's resizes
    (``(step, new total)`` pairs) and the seconds of budget used (None without a budget). ``warmup_steps`` is None
    only for checkpoints written before resizing, which stored the total alone: their warm-up follows the config's
    rule again."""

    first_total_steps: int
    warmup_steps: int | None = None
    resizes: tuple[tuple[int, int], ...] = ()
    budget_seconds_used: float | None = None

    def entries(self) -> dict[str, Any]:
        """The checkpoint's ``run_length`` entry (plain lists and numbers: it loads with ``weights_only``)."""
        return {"first_total_steps": self.first_total_steps, "warmup_steps": self.warmup_steps,
                "resizes": [list(r) for r in self.resizes], "budget_seconds_used": self.budget_seconds_used}

    @classmethod
    def read(cls, checkpoint: dict[str, Any] | None) -> StoredLength | None:
        """The length stored in ``checkpoint`` (or in its ``total_steps`` and ``run_length`` entries alone), in every
        format written so far; None when it stores none (written before budgets existed)."""
        checkpoint = checkpoint or {}
        recorded = checkpoint.get("run_length")
        if recorded is None:  # written before resizing: the total alone
            total = checkpoint.get("total_steps")
            return None if total is None else cls(int(total))
        # written before "plan" meant only the recipe: planned_total and replans
        first = recorded.get("first_total_steps", recorded.get("planned_total"))
        resizes = recorded.get("resizes", recorded.get("replans")) or ()
        return cls(int(first), recorded["warmup_steps"], tuple((int(step), int(total)) for step, total in resizes),
                   recorded.get("budget_seconds_used"))


def config_total_steps(cfg: Config, steps_per_epoch: int) -> tuple[int | None, str]:
    """The run's total steps as the config sets them, and the key that set them: ``optim.total_steps`` over
    ``optim.budget_minutes`` over ``optim.epochs``. None for a budget: only timing steps can size it."""
    optim = cfg.optim
    if optim.total_steps is not None:
        return optim.total_steps, "optim.total_steps"
    if optim.budget_minutes is not None:
        return None, "optim.budget_minutes"
    return optim.epochs * steps_per_epoch, "optim.epochs"


def config_stop_step(cfg: Config, steps_per_epoch: int) -> int | None:
    """The step a fresh run will stop at as far as the config says before any timing (``run.max_steps`` cuts it);
    None: a budget decides. What ``run.precision: auto`` weighs its timing's cost against."""
    total, _ = config_total_steps(cfg, steps_per_epoch)
    max_steps = cfg.run.max_steps
    return total if max_steps is None else min(total or max_steps, max_steps)


def decide_run_length(run: Run, *, stored: StoredLength | None, started_at: float,
                      seconds_per_step: float | None = None) -> RunLength:
    """The run's first length, from a resumed checkpoint's (``stored``), the config, or a timed budget.
    ``started_at`` is the ``time.monotonic()`` reading the budget counts from. With a budget this runs (and undoes)
    a few optimiser steps, so every rank must call it, unless ``seconds_per_step`` (the rate ``run.precision: auto``
    measured for the chosen precision on these same steps) already says it."""
    cfg, steps_per_epoch = run.cfg, run.steps_per_epoch
    optim = cfg.optim
    configured, decided_by = config_total_steps(cfg, steps_per_epoch)
    counted_in_epochs = decided_by == "optim.epochs"
    if stored is not None:
        total_steps, decided_by = stored.first_total_steps, "checkpoint"
    elif configured is not None:
        total_steps = configured
    else:
        total_steps = _steps_in_budget(run, started_at, seconds_per_step)
    if stored is not None and stored.warmup_steps is not None:
        warmup_steps = stored.warmup_steps  # fixed when the run's length was first decided
    elif counted_in_epochs:
        warmup_steps = int(optim.warmup_epochs * steps_per_epoch)
    else:
        warmup_steps = round(optim.warmup_epochs / optim.epochs * total_steps)
    stop_at = min(total_steps, cfg.run.max_steps or total_steps)
    return RunLength(total_steps, warmup_steps, stop_at, decided_by)


def _steps_in_budget(run: Run, started_at: float, measured: float | None = None) -> int:
    """Time real steps, each fetching its batch from the loader as the loop does (undone afterwards), and count
    the steps left in the budget. Timing one cached batch instead measured ~20 % fewer seconds per step than the
    loop then took on the demo (fetching, collating and logging are part of a step's cost). ``measured``: the
    precision timing's median for the chosen precision, taken the same way (loader batches, the metrics sync,
    the slowest rank), so the steps are not timed twice."""
    minutes = run.cfg.optim.budget_minutes
    if measured is not None:
        total = dist.all_reduce_min_int(steps_for_budget(60 * minutes, time.monotonic() - started_at, measured,
                                                         BUDGET_OVERHEAD))
        log.info("budget %.1f min: %.3f s/step from the precision timing -> %d steps (%.0f images/s)",
                 minutes, measured, total, run.global_batch / measured)
        return total
    step = loader_step(run)  # training/run/trial.py: undone by calibrate_budget
    calibration = calibrate_budget(lambda _: step(), [run.online, run.target], run.optimizer,
                                   budget_seconds=60 * minutes, started_at=started_at,
                                   mask_generator=run.mask_generator)
    log.info("budget %.1f min: %.3f s/step measured over the first steps -> %d steps (%.0f images/s)",
             minutes, calibration.seconds_per_step, calibration.total_steps,
             run.global_batch / calibration.seconds_per_step)
    return calibration.total_steps


def build_schedules(cfg: Config, length: RunLength) -> Schedules:
    """The official learning-rate, weight-decay, EMA and sharpening schedules over the decided length; a warm start
    (``run.init_from``) scales the start and peak lr by ``optim.warm_lr_scale`` and starts the EMA at no less than
    ``optim.warm_ema_start`` (the rule reads only the config: a warm start resumed with the same command line gets
    the same schedules)."""
    o = cfg.optim
    start_lr, ref_lr, final_lr, ema_start = o.start_lr, o.lr, o.final_lr, o.ema_start
    if cfg.run.init_from:
        start_lr, ref_lr = start_lr * o.warm_lr_scale, ref_lr * o.warm_lr_scale
        final_lr, ema_start = min(final_lr, ref_lr), max(ema_start, o.warm_ema_start)
    return Schedules(
        total_steps=length.total_steps, warmup_steps=length.warmup_steps,
        start_lr=start_lr, ref_lr=ref_lr, final_lr=final_lr, ref_weight_decay=o.weight_decay,
        final_weight_decay=o.final_weight_decay, ema_start=ema_start, ema_end=o.ema_end,
        horizon_scale=o.horizon_scale, sharpen_start=cfg.loss.sharpen_start, sharpen_end=cfg.loss.sharpen_end,
    )


@dataclass
class RunSchedule:
    """The loop's length and schedules; a budget run's ``budget`` resizes both while it runs.

    ``first`` is the length decided before the loop (its total and warm-up fix the base schedules); ``length``
    is the current one. ``due_resize`` is called by every rank after every optimiser step.
    """

    first: RunLength
    schedules: ResizedSchedules
    max_steps: int | None = None
    budget: BudgetResizer | None = None

    @property
    def length(self) -> RunLength:
        total = self.schedules.total_steps
        decided_by = self.first.decided_by
        if self.schedules.resizes:
            decided_by += f", resized {len(self.schedules.resizes)}x"
        return replace(self.first, total_steps=total, stop_at=min(total, self.max_steps or total),
                       decided_by=decided_by)

    def start(self, step: int) -> None:
        """Call right before the first step of this process (the budget's rate is timed from here)."""
        if self.budget is not None:
            self.budget.start(step)

    def due_resize(self, step: int) -> Resize | None:
        """``step`` steps are done: the resize the budget asks for now, or None. Every rank calls it after every
        step (the check all-reduces); the resize is applied as a run event (``training/run/events.py``)."""
        if self.budget is None:
            return None
        return self.budget.check(step, self.schedules.total_steps)

    def apply(self, resize: Resize) -> None:
        """The schedules resized: a resize event's part here (``training/run/events.py`` applies and logs it; the
        checkpoint stores it with the resizes)."""
        self.schedules = self.schedules.resize(resize.step, resize.new_total)

    def summary(self) -> str:
        """How the budget was spent, for the run's last line ('' without a budget)."""
        if self.budget is None:
            return ""
        used, budget = self.budget.seconds_used(), self.budget.budget_seconds
        return (f"budget {budget / 60:.2f} min, used {used / 60:.2f} min ({100 * used / budget:.1f} %), "
                f"{len(self.schedules.resizes)} resizes")

    def checkpoint_entries(self) -> dict[str, Any]:
        """``total_steps`` (the current length) and ``run_length`` (``StoredLength``: what rebuilds these schedules
        on resume)."""
        stored = StoredLength(self.schedules.base.total_steps, self.schedules.warmup_steps, self.schedules.resizes,
                              self.budget.seconds_used() if self.budget is not None else None)
        return {"total_steps": self.schedules.total_steps, "run_length": stored.entries()}


def schedule_run(run: Run, *, stored: StoredLength | None, started_at: float,
                 seconds_per_step: float | None = None) -> RunSchedule:
    """The run's schedule: a checkpoint's stored one (``stored``, from ``StoredLength.read``), or a new one
    (``decide_run_length``; ``seconds_per_step`` as there), by :func:`schedule_for`."""
    first = decide_run_length(run, stored=stored, started_at=started_at, seconds_per_step=seconds_per_step)
    return schedule_for(run.cfg, first, stored=stored, started_at=started_at)


def schedule_for(cfg: Config, first: RunLength, *, stored: StoredLength | None, started_at: float) -> RunSchedule:
    """The schedules over the decided length ``first`` (and a checkpoint's stored resizes); with
    ``optim.budget_minutes``, a ``BudgetResizer`` for what is left of it. Built from the run's decided config:
    the schedules read its learning rates and EMA, the resizer its checkpoint interval."""
    schedules = ResizedSchedules(build_schedules(cfg, first), stored.resizes if stored is not None else ())
    budget = None
    if cfg.optim.budget_minutes is not None:
        budget = BudgetResizer.for_length(
            60 * cfg.optim.budget_minutes, started_at, first.total_steps,
            min_window_steps=cfg.run.checkpoint_every_steps,
            used_before=(stored.budget_seconds_used if stored is not None else None) or 0.0)
    return RunSchedule(first, schedules, cfg.run.max_steps, budget)
