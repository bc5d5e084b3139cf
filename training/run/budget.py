"""Steps that fit in a wall-clock budget: users think in minutes and GPU-hours, not epochs.

With ``optim.budget_minutes``, ``training/run/length.py`` has ``plan_budget`` time a few real optimiser steps on
batches from the loader before the run (every weight, optimiser moment and RNG stream is put back afterwards, so
calibration leaves no trace) and keeps the step count that ends the cosine learning-rate, weight-decay and EMA
schedules with the budget. The count is stored in the checkpoint: ``--resume`` follows the same schedules and does
not measure again.

The budget counts from just after the processes start: building the networks, calibration, the optimiser steps,
checkpoints and logging. Evaluation and export come after it. A machine that gets slower (or faster) during the
run ends later (or earlier) than planned; the trainer logs the planned and the measured rate.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from training import distributed as dist
from training.checkpoint import capture_rng_state, restore_rng_state

__all__ = ["BudgetPlan", "plan_budget", "steps_for_budget"]

# Steps timed after the untimed warm-up ones (allocator, thread pools, compilation); enough for a stable median.
CALIBRATION_STEPS = 16
WARMUP_STEPS = 3


@dataclass(frozen=True)
class BudgetPlan:
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


def plan_budget(step_fn: Callable[[int], None], modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                *, budget_seconds: float, started_at: float, mask_generator: torch.Generator | None = None,
                overhead_fraction: float = 0.03) -> BudgetPlan:
    """Time ``step_fn`` (one full optimiser step on a fixed batch) and return the step count for the budget.

    The modules' and optimiser's states and the RNG streams are restored afterwards. ``started_at`` is the
    ``time.monotonic()`` reading the budget runs from. Ranks agree on the smallest count (the slowest rank sets
    the pace of a synchronous data-parallel run).
    """
    calibration_start = time.monotonic()
    saved_modules = [copy.deepcopy(m.state_dict()) for m in modules]
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_rng = capture_rng_state(mask_generator)
    durations = []
    for i in range(WARMUP_STEPS + CALIBRATION_STEPS):
        dist.synchronize()
        start = time.perf_counter()
        step_fn(i)
        dist.synchronize()
        durations.append(time.perf_counter() - start)
    for module, state in zip(modules, saved_modules, strict=True):
        module.load_state_dict(state)
    optimizer.load_state_dict(saved_optimizer)
    restore_rng_state(saved_rng, mask_generator)
    seconds_per_step = sorted(durations[WARMUP_STEPS:])[CALIBRATION_STEPS // 2]  # median: robust to a hiccup
    elapsed = time.monotonic() - started_at
    total = steps_for_budget(budget_seconds, elapsed, seconds_per_step, overhead_fraction)
    total = dist.all_reduce_min_int(total)
    return BudgetPlan(total, seconds_per_step, time.monotonic() - calibration_start)
