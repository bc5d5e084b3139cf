"""``--on-stall adapt``: a stalled run switches itself, once, to what its stall warning advised.

The stall warning (``training/run/stall.py``) names a likely cause and the ``--set`` that fixes it. With
``run.on_stall: adapt`` (``--on-stall adapt``; off by default: a run does what it was told unless asked) the run
takes that advice itself the first time, without a restart:

- the config keys the advice names are set on the run's config (so ``config.yaml``, every later checkpoint and
  the exported bundle's training summary hold the adapted values);
- what was built from them is rebuilt: the views (crops, masking, jitter) or the schedules (the learning rate's
  warm-up and peak, or the targets' sharpening, from the same step on: the step counter, the run length and every
  resize are kept);
- a checkpoint is written at that step holding the adaptation (``adapted``), and ``config.yaml`` is rewritten
  with an ``adapted`` record in its plan section; the log says so. A resumed run re-applies a checkpoint's
  adaptation before it builds its schedules, so it continues with what the run had switched to.

The weights go on from where they are: a run warned within its first 10 % has moved little from its start, and
the advice is about what it learns from next. Every rank adapts at the same step: rank 0's detector decides, the
others learn it at the next logged step (one small collective per logged step, only with ``adapt`` on).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from training import distributed as dist
from training.config import Config, ConfigError, config_from_dict
from training.run.build import Run, build_augment
from training.run.checkpoints import Checkpoints
from training.run.length import RunSchedule, build_schedules
from training.run.stall import Adaptation, Stall
from training.run.state import Progress
from training.run.step import StepOutput

__all__ = ["Adaptation", "OnStall", "adapt_run", "agree_on_adaptation", "apply_to_config"]

log = logging.getLogger("msn.train")

VIEW_KEYS = ("mask.rand_crop_scale", "augment.")
SCHEDULE_KEYS = ("optim.lr", "optim.start_lr", "loss.sharpen_start", "loss.sharpen_end")


def apply_to_config(cfg: Config, sets: dict[str, Any]) -> None:
    """Set the dotted keys on ``cfg`` in place, after checking them the way ``--set`` is checked (a whole config
    built from the result): the run's other parts hold references to ``cfg`` and its sections."""
    raw = cfg.to_dict()
    for key, value in sets.items():
        section, _, name = key.partition(".")
        if section not in raw or name not in raw[section]:
            raise ConfigError(f"adaptation names an unknown key {key!r}")
        raw[section][name] = value
    checked = config_from_dict(raw)
    for key in sets:
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, getattr(getattr(checked, section), name))


def adapt_run(run: Run, schedule: RunSchedule, adaptation: Adaptation) -> None:
    """Switch the built run to ``adaptation``: its config, then the views and the schedules built from it."""
    apply_to_config(run.cfg, adaptation.sets)
    if any(key.startswith(VIEW_KEYS) for key in adaptation.sets):
        run.augment = build_augment(run.cfg, run.mean, run.std, run.device)
    if any(key in SCHEDULE_KEYS for key in adaptation.sets):
        adapt_schedules(schedule, run.cfg)


def adapt_schedules(schedule: RunSchedule, cfg: Config) -> None:
    """The same schedules (length, warm-up, resizes) rebuilt from the config's learning rates and sharpening."""
    schedule.schedules = dataclasses.replace(schedule.schedules, base=build_schedules(cfg, schedule.first))


def agree_on_adaptation(stall: Stall | None, step: int, rank: int) -> Adaptation | None:
    """Rank 0's adaptation for a stall it confirmed (None when none), known to every rank. A collective: every
    rank calls it at every logged step while ``run.on_stall`` is ``adapt`` and the run has not adapted yet."""
    mine = Adaptation(step, stall.cause, dict(stall.sets)) if rank == 0 and stall is not None and stall.sets else None
    if dist.is_distributed():
        return dist.all_gather_object(mine)[0]
    return mine


class OnStall:
    """What the loop does about a stall at each logged step: nothing more than the warning (``warn``), or, once,
    the switch (``adapt``): every rank agrees, adapts, checkpoints; rank 0 rewrites ``config.yaml``."""

    def __init__(self, run: Run, schedule: RunSchedule, checkpoints: Checkpoints,
                 rewrite_config: Callable[[Adaptation], None]) -> None:
        self.run, self.schedule, self.checkpoints, self.rewrite_config = run, schedule, checkpoints, rewrite_config
        self.adapted: Adaptation | None = checkpoints.stored_adaptation  # once per run, resumes included
        self.active = run.cfg.run.on_stall == "adapt" and self.adapted is None

    def after_log(self, progress: Progress, last: StepOutput, stall: Stall | None) -> bool:
        """True when the run switched at this step."""
        if not self.active:
            return False
        adaptation = agree_on_adaptation(stall, progress.step, self.run.info.rank)
        if adaptation is None:
            return False
        self.active, self.adapted = False, adaptation
        adapt_run(self.run, self.schedule, adaptation)
        self.checkpoints.adaptation = adaptation
        self.checkpoints.save(progress, last)
        if self.run.info.rank == 0:
            self.rewrite_config(adaptation)
        log.warning("%s", adaptation.describe())
        return True
