"""``training/run/checkpoints.py``: a checkpoint written in an earlier format still resumes with its run length."""
from __future__ import annotations

import torch

from training import distributed as dist
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import load_config
from training.run.build import Run, build_run
from training.run.checkpoints import Checkpoints
from training.run.length import schedule_run
from training.run.state import Progress, TrainState
from training.run.step import start_hyperparameters, train_step

from .test_precision import TINY


def _state(run: Run) -> TrainState:
    return TrainState(run.online, run.target, run.optimizer)


def test_a_checkpoint_with_the_earlier_length_keys_resumes_the_same_schedule(tmp_path):
    """Checkpoints written before "plan" meant only the recipe stored the run length as ``planned_total`` and
    ``replans``: resuming one rebuilds the length and the resized schedules it was written with."""
    cfg = load_config(None, [*TINY, "optim.total_steps=50"])
    torch.manual_seed(0)
    run = build_run(cfg, dist.init_distributed("cpu"))
    state = _state(run)
    schedule = schedule_run(run, stored=None, started_at=0.0)
    schedule.schedules = schedule.schedules.resize(10, 40)  # as a budget run's resize would
    state.length = schedule
    out = train_step(run, start_hyperparameters(cfg), next(iter(run.loader))[0])
    Checkpoints(run, state, tmp_path).save(Progress(step=10), out)

    path = tmp_path / "checkpoint.pt"
    written = load_checkpoint(path)
    length = dict(written["run_length"])
    assert (length["first_total_steps"], length["resizes"]) == (50, [[10, 40]])
    written["run_length"] = {"planned_total": length.pop("first_total_steps"), "replans": length.pop("resizes"),
                             **length}
    save_checkpoint(path, written)

    resumed = build_run(cfg, dist.init_distributed("cpu"))
    checkpoints = Checkpoints(resumed, _state(resumed), tmp_path)
    assert checkpoints.should_resume(asked=True)
    assert checkpoints.resume().step == 10
    rebuilt = schedule_run(resumed, stored=checkpoints.stored_length, started_at=0.0)
    assert rebuilt.first.decided_by == "checkpoint" and rebuilt.schedules == schedule.schedules
    assert (rebuilt.length.total_steps, rebuilt.length.warmup_steps) == (40, schedule.length.warmup_steps)
