"""``--on-stall adapt``: a stalled run switches itself, once, to what its stall warning advised.

The stall warning (``training/run/stall.py``) names a likely cause and the ``--set`` that fixes it. With
``run.on_stall: adapt`` (``--on-stall adapt``; off by default: a run does what it was told unless asked) the run
takes that advice itself the first time, without a restart:

- the switch is a run event (``training/run/events.py``, the one way a decided run changes): the run's config is
  replaced by one holding the advised keys (so ``config.yaml``, every later checkpoint and the exported bundle's
  training summary hold the adapted values), and what was built from them is rebuilt as
  ``training/run/advice.py``'s table declares: the views (crops, masking, jitter) or the schedules (the learning
  rate's warm-up and peak, or the targets' sharpening, from the same step on: the step counter, the run length and
  every resize are kept);
- a checkpoint is written at that step holding the adaptation (``adapted``), and ``config.yaml`` is rewritten
  with an ``adapted`` record in its plan section; the log says so. A resumed run re-applies a checkpoint's
  adaptation before it builds its schedules, so it continues with what the run had switched to.

The weights go on from where they are: a run warned within its first 10 % has moved little from its start, and
the advice is about what it learns from next. Every rank adapts at the same step: rank 0's detector decides, the
others learn it at the next logged step (one small collective per logged step, only with ``adapt`` on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from training import distributed as dist
from training.run.events import RunEvents
from training.run.stall import Adaptation, Stall
from training.run.state import Progress
from training.run.step import StepOutput

__all__ = ["Adaptation", "OnStall", "agree_on_adaptation"]

log = logging.getLogger("msn.train")


def agree_on_adaptation(stall: Stall | None, step: int, rank: int) -> Adaptation | None:
    """Rank 0's adaptation for a stall it confirmed (None when none), known to every rank. A collective: every
    rank calls it at every logged step while ``run.on_stall`` is ``adapt`` and the run has not adapted yet."""
    mine = Adaptation(step, stall.cause, dict(stall.sets)) if rank == 0 and stall is not None and stall.sets else None
    if dist.is_distributed():
        return dist.all_gather_object(mine)[0]
    return mine


class OnStall:
    """What the loop does about a stall at each logged step: nothing more than the warning (``warn``), or, once,
    the switch (``adapt``): every rank agrees, applies it as a run event, checkpoints; rank 0 rewrites
    ``config.yaml``."""

    def __init__(self, events: RunEvents, rewrite_config: Callable[[Adaptation], None]) -> None:
        self.events, self.rewrite_config = events, rewrite_config
        self.adapted: Adaptation | None = events.checkpoints.stored_adaptation  # once per run, resumes included
        self.active = events.run.cfg.run.on_stall == "adapt" and self.adapted is None

    def after_log(self, progress: Progress, last: StepOutput, stall: Stall | None) -> bool:
        """True when the run switched at this step."""
        if not self.active:
            return False
        run = self.events.run
        adaptation = agree_on_adaptation(stall, progress.step, run.info.rank)
        if adaptation is None:
            return False
        self.active, self.adapted = False, adaptation
        self.events.apply(adaptation)
        self.events.checkpoints.save(progress, last)
        if run.info.rank == 0:
            self.rewrite_config(adaptation)
        log.warning("%s", adaptation.describe())
        return True
