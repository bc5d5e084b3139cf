"""The decision stage: every setting of a run decided once, before its loop, into one frozen config.

Each decision reads only what the ones before it decided, in this order:

1. **planner and survey** (``training/run/plan.py``, ``survey.py``; in ``training/pretrain.py``'s ``resolve_config``,
   before anything is built): model, views, batch, learning rate, the length's unit, from the data and the machine;
2. **speed timing** (``training/run/precision_timing.py``): precision, CPU attention and threads, each by the one
   ladder of ``training/run/precedence.py`` (set by you, resumed, the rule), timed on the run's own steps;
3. **budget to steps** (``training/run/length.py``): the run's length, a budget's from the speed timing's rate (or
   its own trial steps);
4. **step-dependent settings** (``Plan.settle``): the EMA start and the checkpoint interval, from that length, not
   from the planner's estimate of the machine's speed.

The config is then frozen with all of them (``training.config.freeze``), the schedules are built from it, and a
resumed run's adaptation is replayed. The loop only reads the result; what may change while it runs (a budget's
resize, a stall's adaptation) is an event applied by ``training/run/events.py``. :class:`Decisions` is the record:
each decided value's reason, what the printed plan block and ``config.yaml``'s ``plan`` section show.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from training.config import freeze, with_keys
from training.run.build import Run
from training.run.checkpoints import Checkpoints
from training.run.events import RunEvents
from training.run.length import decide_run_length, schedule_for
from training.run.plan import Plan
from training.run.precision_timing import SpeedChoice, choose_speed, use_setting
from training.run.stall import Adaptation

__all__ = ["Decisions", "decide_run", "settle_speed"]

log = logging.getLogger("msn.train")


@dataclass(frozen=True)
class Decisions:
    """Why the run has its settings: a planned run's plan (None for a run from a recipe) and the speed choice."""

    plan: Plan | None
    speed: SpeedChoice

    def record(self, adapted: Adaptation | None = None) -> dict[str, Any]:
        """``config.yaml``'s ``plan`` section: a planned run's plan, or for a run from a recipe the speed settings'
        reasons; the timing's measurement (``speed_timing``) when they were timed; a stall's switch (``adapted``)."""
        record = self.plan.record() if self.plan is not None else {"why": dict(self.speed.reasons)}
        if self.speed.timed:
            record["speed_timing"] = self.speed.record()
        if adapted is not None:
            record["adapted"] = adapted.record()
        return record

    def announce(self) -> None:
        """Say what was decided (rank 0): the plan block of a planned run, else each speed setting's reason."""
        if self.plan is not None:
            print(self.plan.describe(), flush=True)
            return
        for key, value in self.speed.values().items():
            log.info("%s %s: %s", key, value, self.speed.reasons[key])


def settle_speed(run: Run, choice: SpeedChoice, plan: Plan | None) -> dict[str, Any]:
    """Train in the chosen speed settings (precision, and on a CPU the bf16 attention kernel and threads); returns
    their resolved config values by key. A planned run's plan takes each as its line, unless ``--set`` fixed it."""
    use_setting(run, choice.setting)
    values = choice.values()
    if plan is not None:
        for key, value in values.items():
            if key not in plan.fixed:
                plan.values[key], plan.reasons[key] = value, choice.reasons[key]
    return values


def decide_run(run: Run, plan: Plan | None, checkpoints: Checkpoints, *, resumed: bool,
               started_at: float) -> tuple[Decisions, RunEvents]:
    """Stages 2-4 of the module docstring on the built (and, when ``resumed``, resumed) ``run``: ``run.cfg`` becomes
    the frozen resolved config, and the returned events hold the schedule the loop follows. ``started_at`` is the
    ``time.monotonic()`` reading a budget counts from. Every rank calls it (the timings are collective)."""
    stored = {**(checkpoints.stored_run or {}), "precision": checkpoints.stored_precision} if resumed else None
    speed = choose_speed(run, stored=stored)
    values = settle_speed(run, speed, plan)
    first = decide_run_length(run, stored=checkpoints.stored_length, started_at=started_at,
                              seconds_per_step=speed.chosen_seconds_per_step)  # a timed rate: no second timing
    if plan is not None:
        values.update(plan.settle(first.total_steps))
    run.cfg = freeze(with_keys(run.cfg, values))
    schedule = schedule_for(run.cfg, first, stored=checkpoints.stored_length, started_at=started_at)
    events = RunEvents(run, schedule, checkpoints)
    if checkpoints.stored_adaptation is not None:  # the run had switched itself (--on-stall adapt): again
        events.apply(checkpoints.stored_adaptation)
    return Decisions(plan, speed), events
