"""The decision stage (training/run/decide.py): the settings that follow the run's length are chosen from the steps
the budget finally planned, not the planner's estimate; the config the loop gets is frozen."""

from __future__ import annotations

import time

import pytest
import torch

from training import distributed as dist
from training.config import FrozenConfigError, load_config
from training.run import length
from training.run.budget import BudgetCalibration
from training.run.build import build_run
from training.run.checkpoints import Checkpoints
from training.run.decide import decide_run
from training.run.plan import DataSurvey, plan_run
from training.run.state import TrainState

from .test_plan import CPU
from .test_precision import TINY

DIGITS = DataSurvey("digits folder", 1_797, 8, False, [0.3] * 3, [0.35] * 3)
SETTLED = "EMA averaging over ~100 steps, 2 % of the ~3,555 planned (0.99 to 0.996)"


def test_the_step_dependent_choices_follow_the_decided_length():
    plan = plan_run(DIGITS, CPU, {"optim.budget_minutes": 10})
    assert plan.reasons["optim.ema_start"] != SETTLED  # from the machine's estimated step time
    assert plan.settle(3_555) == {"optim.ema_start": 0.99, "run.checkpoint_every_steps": 200}
    assert plan.reasons["optim.ema_start"] == SETTLED and plan.values["optim.ema_start"] == 0.99
    assert plan.reasons["run.checkpoint_every_steps"] == "about every 5 % of the run"
    assert plan.settle(26_117) == {"optim.ema_start": 0.996, "run.checkpoint_every_steps": 1300}
    fixed = plan_run(DIGITS, CPU, {"optim.budget_minutes": 10, "optim.ema_start": 0.999})
    assert fixed.settle(3_555) == {"run.checkpoint_every_steps": 200}
    assert fixed.reasons["optim.ema_start"] == "set by you"


def test_a_budget_run_s_ema_is_chosen_from_the_steps_its_budget_planned(tmp_path, monkeypatch):
    """The planner estimates the step count from the machine's peak figure; the budget then sizes the run from its
    own timed steps (here: 3,555); the EMA, the checkpoint interval and the schedules follow the latter."""
    monkeypatch.setattr(length, "calibrate_budget", lambda *a, **k: BudgetCalibration(3_555, 0.1, 0.0))
    cfg = load_config(None, [*TINY, "optim.budget_minutes=10", "run.precision=fp32"])  # nothing to time
    torch.manual_seed(0)
    run = build_run(cfg, dist.init_distributed("cpu"))
    checkpoints = Checkpoints(run, TrainState(run.online, run.target, run.optimizer), tmp_path)
    plan = plan_run(DIGITS, CPU, {"optim.budget_minutes": 10})
    decisions, events = decide_run(run, plan, checkpoints, resumed=False, started_at=time.monotonic())
    assert events.schedule.first.total_steps == 3_555 and not decisions.speed.timed
    assert (run.cfg.optim.ema_start, run.cfg.run.checkpoint_every_steps) == (0.99, 200)
    assert events.schedule.schedules.at(0).ema_momentum == 0.99
    assert events.schedule.budget is not None and events.schedule.budget.window_steps >= 200
    assert decisions.record()["why"]["optim.ema_start"] == SETTLED
    assert decisions.record()["why"]["run.precision"] == "set by you"
    with pytest.raises(FrozenConfigError):  # the loop only reads; a change is a run event (training/run/events.py)
        run.cfg.optim.ema_start = 0.996
