"""The one way a run changes once it is decided: explicit events, each applied here and stored in the checkpoint.

Before its loop a run decides every setting once (``training/run/decide.py``) into a frozen config that the loop
only reads. Two things may still change while it runs, and both are events applied by :meth:`RunEvents.apply`:

- a **resize** (``training/run/budget.py``'s ``Resize``): a budget run's measured rate moves its end; the schedules
  stretch or shrink to end there (``RunSchedule.apply``). The checkpoint stores every resize (``run_length``).
- an **adaptation** (``training/run/stall.py``'s ``Adaptation``, ``--on-stall adapt``): a stalled run takes its
  advice. The config is replaced by a new frozen one holding the advised keys (checked like ``--set``), and what
  was built from them is rebuilt, as ``training/run/advice.py``'s table declares: the views, or the schedules over
  the same length, warm-up and resizes. The checkpoint stores it (``adapted``); a resumed run replays it before
  its loop, so it goes on with what the run had switched to.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from training.config import Config, freeze, with_keys
from training.run.advice import rebuilds
from training.run.budget import Resize
from training.run.build import Run, build_augment
from training.run.checkpoints import Checkpoints
from training.run.length import RunSchedule, build_schedules
from training.run.stall import Adaptation

__all__ = ["RunEvent", "RunEvents", "adapt_schedules"]

log = logging.getLogger("msn.train")

RunEvent = Resize | Adaptation


@dataclass
class RunEvents:
    """What the loop changes the run through: its built parts, its schedule and the checkpoints that store events."""

    run: Run
    schedule: RunSchedule
    checkpoints: Checkpoints

    def after_step(self, step: int) -> Resize | None:
        """``step`` steps are done: a budget's resize when one is due, applied (every rank, after every step)."""
        resize = self.schedule.due_resize(step)
        if resize is not None:
            self.apply(resize)
        return resize

    def apply(self, event: RunEvent) -> None:
        """Apply ``event`` to the run and keep it for the next checkpoint (module docstring)."""
        if isinstance(event, Resize):
            self.schedule.apply(event)
            log.info(event.describe())
            return
        run = self.run
        run.cfg = freeze(with_keys(run.cfg, event.sets))
        rebuilt = rebuilds(event.sets)
        if "views" in rebuilt:
            run.augment = build_augment(run.cfg, run.mean, run.std, run.device)
        if "schedules" in rebuilt:
            adapt_schedules(self.schedule, run.cfg)
        self.checkpoints.adaptation = event


def adapt_schedules(schedule: RunSchedule, cfg: Config) -> None:
    """The same schedules (length, warm-up, resizes) rebuilt from the config's learning rates and sharpening."""
    schedule.schedules = dataclasses.replace(schedule.schedules, base=build_schedules(cfg, schedule.first))
