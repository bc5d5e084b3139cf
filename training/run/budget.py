"""Steps that fit in a wall-clock budget, counted before the run and resized while it runs.

Users think in minutes and GPU-hours, not epochs. With ``optim.budget_minutes`` the run's length is sized twice
over:

1. **Before the loop** ``training/run/length.py`` has ``calibrate_budget`` time a few real optimiser steps on batches
   from the loader (trial steps, ``training/run/trial.py``: every weight, optimiser moment and RNG stream is put
   back afterwards, so calibration leaves no trace) and keeps the step count that fits in what is left of the
   budget. Warm-up is fixed here, in steps.
2. **During the loop** the step time drifts: it got faster after calibration on the demo (a 10-minute budget
   ended after 9.0 minutes) and slower on a folder of PNGs, where decoding sets the pace. ``BudgetResizer``
   therefore looks again every 2 % of the run's first length: from the rate of the recent steps, measured on the wall
   clock (data loading, logging and checkpoints included; the window spans at least one checkpoint interval),
   it computes the steps that fit in what is left of the budget. When that moves the end by more than 1 % the
   run is resized to it, and the learning-rate, weight-decay and EMA schedules stretch or shrink to end there
   (``training/run/schedules.py``, ``ResizedSchedules``: continuous, warm-up untouched). Every resize is
   logged. Ranks agree on the smallest count (the slowest rank sets the pace of a synchronous run).

A run thus ends within about 1 % of its budget plus what the step time drifts in the last 2 % of the run
(tested with a step whose duration doubles halfway, and with a real run). The budget counts from just after the
processes start: building the networks, calibration, the optimiser steps, checkpoints and logging. Evaluation and
export come after it.

The checkpoint stores the length (``run_length``: the first length's total and warm-up, every resize, the seconds of
budget used): ``--resume`` rebuilds the same schedules without measuring again and spends only what is left of the
budget, resizing from its own rate. A resumed run is bit-identical to an uninterrupted one given the same
resizes; resizes follow the wall clock, which a second run does not repeat exactly.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from training import distributed as dist
from training.run.trial import undone, wall_seconds

__all__ = ["BUDGET_OVERHEAD", "BudgetCalibration", "BudgetResizer", "Resize", "calibrate_budget", "steps_for_budget"]

log = logging.getLogger("msn.train")

# Steps timed after the untimed warm-up ones (allocator, thread pools, compilation); enough for a stable median.
CALIBRATION_STEPS = 16
WARMUP_STEPS = 3
# During the run: look again every RESIZE_EVERY of the run's first length, from the rate over at least RATE_WINDOW
# of it (and at least one checkpoint interval, so checkpoints are averaged in), and resize when the end moves by
# more than RESIZE_THRESHOLD of the run.
RESIZE_EVERY = 0.02
RATE_WINDOW = 0.1
RESIZE_THRESHOLD = 0.01
# The share of every step's time reserved for what a timing does not see (checkpoints, logging, unprefetched data).
BUDGET_OVERHEAD = 0.03


@dataclass(frozen=True)
class BudgetCalibration:
    total_steps: int
    seconds_per_step: float
    calibration_seconds: float


def steps_for_budget(budget_seconds: float, elapsed_seconds: float, seconds_per_step: float,
                     overhead_fraction: float = 0.0) -> int:
    """Optimiser steps that fit in what is left of the budget, at least 1.

    ``overhead_fraction`` reserves a share of every step's time for the work calibration does not see
    (checkpoints, logging, data the loader did not prefetch).
    """
    if not seconds_per_step > 0:
        raise ValueError(f"seconds_per_step must be positive, got {seconds_per_step}")
    remaining = max(0.0, budget_seconds - elapsed_seconds)
    return max(1, math.floor(remaining / (seconds_per_step * (1.0 + overhead_fraction))))


def calibrate_budget(step_fn: Callable[[int], None], modules: list[torch.nn.Module],
                     optimizer: torch.optim.Optimizer, *, budget_seconds: float, started_at: float,
                     mask_generator: torch.Generator | None = None,
                     overhead_fraction: float = BUDGET_OVERHEAD) -> BudgetCalibration:
    """Time ``step_fn`` (one full optimiser step on a fixed batch) and return the step count for the budget.

    The modules' and optimiser's states and the RNG streams are restored afterwards. ``started_at`` is the
    ``time.monotonic()`` reading the budget runs from. Ranks agree on the smallest count (the slowest rank sets
    the pace of a synchronous data-parallel run).
    """
    calibration_start = time.monotonic()
    with undone(modules, optimizer, mask_generator):  # training/run/trial.py: the steps leave no trace
        durations = [wall_seconds(lambda i=i: step_fn(i)) for i in range(WARMUP_STEPS + CALIBRATION_STEPS)]
    seconds_per_step = sorted(durations[WARMUP_STEPS:])[CALIBRATION_STEPS // 2]  # median: robust to a hiccup
    elapsed = time.monotonic() - started_at
    total = steps_for_budget(budget_seconds, elapsed, seconds_per_step, overhead_fraction)
    total = dist.all_reduce_min_int(total)
    return BudgetCalibration(total, seconds_per_step, time.monotonic() - calibration_start)


@dataclass(frozen=True)
class Resize:
    """One resize, for the log: the new step count and what it was computed from."""

    step: int
    old_total: int
    new_total: int
    seconds_per_step: float
    seconds_used: float
    budget_seconds: float

    def describe(self) -> str:
        return (f"budget resize at step {self.step}: {self.seconds_used / 60:.2f} of "
                f"{self.budget_seconds / 60:.2f} min used, {self.seconds_per_step:.4f} s/step over the recent steps "
                f"-> {self.new_total} steps (was {self.old_total})")


@dataclass
class BudgetResizer:
    """Resizes a budget run's step count from its measured rate, at fixed steps of the run.

    ``started_at`` is the ``clock()`` reading the budget counts from; a resumed run passes the seconds it used
    before as ``used_before``. Every rank must call ``check`` after every step (the checks all-reduce).
    """

    budget_seconds: float
    started_at: float
    check_every: int
    window_steps: int
    used_before: float = 0.0
    threshold: float = RESIZE_THRESHOLD
    clock: Callable[[], float] = time.monotonic
    _marks: deque[tuple[int, float]] = field(default_factory=deque, repr=False)

    @classmethod
    def for_length(cls, budget_seconds: float, started_at: float, first_total: int, *, min_window_steps: int = 1,
                   used_before: float = 0.0, clock: Callable[[], float] = time.monotonic) -> BudgetResizer:
        """Checks every ``RESIZE_EVERY`` of ``first_total`` steps (fixed when the run's length is first decided,
        so a resumed run checks at the same steps), rates over ``RATE_WINDOW`` of it or ``min_window_steps``."""
        check_every = max(1, round(RESIZE_EVERY * first_total))
        window = max(check_every, round(RATE_WINDOW * first_total), min(min_window_steps, first_total // 4))
        return cls(budget_seconds, started_at, check_every, window, used_before, clock=clock)

    def seconds_used(self) -> float:
        return self.used_before + self.clock() - self.started_at

    def start(self, step: int) -> None:
        """Mark where the loop starts timing (call right before the first step)."""
        self._marks.clear()
        self._marks.append((step, self.clock()))

    def check(self, step: int, total_steps: int) -> Resize | None:
        """After step ``step`` (the count of steps taken): a resize when one is due and the end moved by more
        than the threshold, else None. The returned total is at least ``step``: equal to it when the budget is
        spent, and the run stops there."""
        if step % self.check_every or not self._marks or step <= self._marks[-1][0]:
            return None
        now = self.clock()
        self._marks.append((step, now))
        while len(self._marks) > 2 and self._marks[1][0] <= step - self.window_steps:
            self._marks.popleft()
        first_step, first_time = self._marks[0]
        seconds_per_step = max(now - first_time, 1e-9) / (step - first_step)
        remaining = self.budget_seconds - (self.used_before + now - self.started_at)
        fits = max(0, math.floor(remaining / seconds_per_step))
        new_total = dist.all_reduce_min_int(step + fits)
        if abs(new_total - total_steps) <= max(self.threshold * total_steps, 1):  # a step either way is noise
            return None
        return Resize(step, total_steps, new_total, seconds_per_step, self.used_before + now - self.started_at,
                      self.budget_seconds)
