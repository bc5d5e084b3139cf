"""``run.precision: auto`` where a CPU could run bf16: time fp32 and bf16 on this run's own steps, keep the faster.

bf16 units do not make every step faster: on a 2-core Xeon with AVX512-BF16 but no AMX the demo trained at
341-352 images/s in bf16 against 536-561 in fp32, so the CPU flags only say that bf16 *can* pay. Before the first
step ``choose_precision`` therefore runs real optimiser steps of this run (its networks, batch size, views and
loader) in each candidate: ``WARMUP_STEPS`` untimed ones each (oneDNN primitives, allocator, compilation), then
``WINDOWS`` timed windows of ``WINDOW_STEPS`` steps each, interleaved fp32, bf16, bf16, fp32, ... so that a noisy
moment on a shared machine falls on both and a slow drift cancels. The median window decides. Every rank times;
the ranks gather their windows and all keep the precision the slowest rank runs fastest.

Nothing of the run changes: the weights, BatchNorm statistics, AdamW's state and every RNG stream are saved before
and put back after (as budget calibration does, ``training/run/budget.py``), so a run with ``auto`` ends with the
same weights as the same run with the chosen precision set explicitly. The timing costs ``timing_steps(2)`` steps
(36; 3.5-4 s for the demo on a 2-core Zen 4, under 1 % of its 10-minute budget); its seconds count against a budget
like any start-up work.

Not timed, with the reason said: an explicit ``fp32``/``bf16``; a single candidate (a GPU, or a CPU without bf16
units, where ``training/run/precision.py``'s flag rule decides); a resumed run (it keeps its checkpoint's precision,
so it continues bit-exactly); and a run too short to pay for the timing (more than ``MAX_COST`` of its steps, or of
its budget at the warm-up steps' pace), which keeps the flag rule.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from msn_core.hardware import CpuInfo
from training import distributed as dist
from training.checkpoint import capture_rng_state, restore_rng_state
from training.run.build import Run
from training.run.length import config_stop_step
from training.run.precision import precision_candidates, resolve_precision
from training.run.step import start_hyperparameters, train_step

__all__ = ["PrecisionChoice", "Timer", "choose_precision", "timing_steps", "wall_timer"]

WARMUP_STEPS = 2  # per candidate, untimed
WINDOWS = 4  # timed windows per candidate
WINDOW_STEPS = 4  # steps per window: 16 timed steps per candidate, as many as budget calibration times
MAX_COST = 0.05  # the most of a run's steps (or budget) the timing may take; shorter runs keep the flag rule

# Runs one step (the callable) in the named precision and returns its seconds; tests simulate the clock with it.
Timer = Callable[[str, Callable[[], None]], float]


def wall_timer(precision: str, step: Callable[[], None]) -> float:
    """The step's wall-clock seconds, queued device work included."""
    dist.synchronize()
    start = time.perf_counter()
    step()
    dist.synchronize()
    return time.perf_counter() - start


def timing_steps(candidates: int) -> int:
    """Optimiser steps (all undone) that timing ``candidates`` precisions takes."""
    return candidates * (WARMUP_STEPS + WINDOWS * WINDOW_STEPS)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision the run trains in and why; when timed, each candidate's median seconds per step."""

    requested: str
    precision: str
    reason: str
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    global_batch: int = 0
    steps: int = 0  # optimiser steps the timing ran and undid
    seconds: float = 0.0  # wall-clock seconds the timing took, warm-up included

    @property
    def timed(self) -> bool:
        return bool(self.seconds_per_step)

    def images_per_second(self) -> dict[str, float]:
        return {p: self.global_batch / s for p, s in self.seconds_per_step.items()}

    def record(self) -> dict[str, Any]:
        """The measurement, for the ``plan`` section of the run's ``config.yaml``."""
        record: dict[str, Any] = {"requested": self.requested, "chosen": self.precision}
        if self.timed:
            record.update(
                images_per_second={p: round(r, 1) for p, r in self.images_per_second().items()},
                seconds_per_step={p: round(s, 5) for p, s in self.seconds_per_step.items()},
                windows=WINDOWS, window_steps=WINDOW_STEPS, steps=self.steps, seconds=round(self.seconds, 2))
        return record


def choose_precision(run: Run, *, resumed: bool = False, stored: str | None = None, cpu: CpuInfo | None = None,
                     timer: Timer = wall_timer) -> PrecisionChoice:
    """The precision ``run`` trains in. ``resumed``: it continues a checkpoint that trained in ``stored``; ``cpu``
    replaces this machine's CPU reading. Every rank must call it (the timing's steps and gathers are collective)."""
    requested, device = run.cfg.run.precision, run.device
    flag = resolve_precision(requested, device, cpu)
    candidates = precision_candidates(requested, device, cpu)
    if requested != "auto":
        return PrecisionChoice(requested, flag, "set by you")
    if len(candidates) == 1:
        why = ("the GPU supports bf16" if flag == "bf16" else "the GPU has no bf16") if device.type == "cuda" else (
            "no bf16 units on this CPU (AMX or AVX512-BF16): bf16 would be emulated, slower")
        return PrecisionChoice(requested, flag, f"{why}; not timed")
    if resumed:
        if stored in candidates:
            return PrecisionChoice(requested, stored, "the resumed checkpoint's precision; not timed again, so the "
                                   "run continues bit-exactly")
        return PrecisionChoice(requested, flag, "resumed from a checkpoint that records no usable precision: the "
                               "CPU-flag rule; not timed")
    flag_rule = f"{flag} by the CPU-flag rule (bf16 units); not timed"
    cost, run_steps = timing_steps(len(candidates)), config_stop_step(run.cfg, run.steps_per_epoch)
    if run_steps is not None and cost > MAX_COST * run_steps:
        return PrecisionChoice(requested, flag, f"{flag_rule}: {cost} timing steps would be more than "
                               f"{MAX_COST * 100:g} % of the run's {run_steps}")
    budget = run.cfg.optim.budget_minutes if run.cfg.optim.total_steps is None else None
    started = time.monotonic()
    with _undone(run):
        seconds, steps, why_not = _time(run, candidates, timer, budget_seconds=60 * budget if budget else None)
    spent = time.monotonic() - started
    if seconds is None:
        return PrecisionChoice(requested, flag, f"{flag_rule}: {why_not}", global_batch=run.global_batch,
                               steps=steps, seconds=spent)
    chosen = min(candidates, key=seconds.__getitem__)  # a tie keeps the first: fp32
    rates = " and ".join(f"{p} {run.global_batch / seconds[p]:.0f}" for p in candidates)
    reason = (f"the faster of {rates} images/s, timed on this run's steps ({WINDOWS} interleaved windows of "
              f"{WINDOW_STEPS} steps each; {steps} steps, {spent:.1f} s, undone)")
    return PrecisionChoice(requested, chosen, reason, seconds, run.global_batch, steps, spent)


def _time(run: Run, candidates: tuple[str, ...], timer: Timer, *,
          budget_seconds: float | None) -> tuple[dict[str, float] | None, int, str]:
    """Each candidate's median window (seconds per step, the slowest rank's), the steps run, and why none (when
    the warm-up's pace says the timing would cost more than ``MAX_COST`` of the budget)."""
    batches = _cycle(run.loader)
    hyper = start_hyperparameters(run.cfg)
    steps = 0

    def step() -> None:
        train_step(run, hyper, next(batches)[0]).metrics()  # the loop reads metrics when it logs: the same sync

    def timed(precision: str) -> float:
        nonlocal steps
        run.use_precision(precision)
        steps += 1
        return timer(precision, step)

    warm = {}
    for _ in range(WARMUP_STEPS):
        for precision in candidates:
            warm[precision] = timed(precision)  # the last warm-up step of each: its pace after start-up
    pace = max(max(rank.values()) for rank in dist.all_gather_object(warm))
    cost = pace * WINDOWS * WINDOW_STEPS * len(candidates)
    if budget_seconds is not None and cost > MAX_COST * budget_seconds:
        return None, steps, (f"timing would take ~{cost:.1f} s, more than {MAX_COST * 100:g} % of the "
                             f"{budget_seconds / 60:g}-minute budget")
    windows: dict[str, list[float]] = {precision: [] for precision in candidates}
    for w in range(WINDOWS):
        for precision in candidates if w % 2 == 0 else candidates[::-1]:  # A B, B A, ...: drift falls on both
            windows[precision].append(sum(timed(precision) for _ in range(WINDOW_STEPS)) / WINDOW_STEPS)
    ranks = dist.all_gather_object(windows)
    return {precision: statistics.median(max(rank[precision][w] for rank in ranks) for w in range(WINDOWS))
            for precision in candidates}, steps, ""


@contextmanager
def _undone(run: Run) -> Iterator[None]:
    """Put back everything steps change: weights and buffers, AdamW's state, the RNG streams, the precision."""
    modules = (run.online, run.target)
    saved_modules = [copy.deepcopy(module.state_dict()) for module in modules]
    saved_optimizer = copy.deepcopy(run.optimizer.state_dict())
    saved_rng = capture_rng_state(run.mask_generator)
    precision = run.precision
    try:
        yield
    finally:
        for module, state in zip(modules, saved_modules, strict=True):
            module.load_state_dict(state)
        run.optimizer.load_state_dict(saved_optimizer)
        run.optimizer.zero_grad(set_to_none=True)
        restore_rng_state(saved_rng, run.mask_generator)
        run.use_precision(precision)


def _cycle(loader):
    while True:
        yield from loader
