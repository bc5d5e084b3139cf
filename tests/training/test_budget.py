"""Schedules sized by a step count or a wall-clock budget, and the calibration that leaves no trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from training.checkpoint import load_checkpoint
from training.config import ConfigError, load_config
from training.run.budget import plan_budget, steps_for_budget

from .test_pretrain import _args, _env


def test_steps_for_budget_counts_what_is_left():
    assert steps_for_budget(600, 0, 0.5) == 1200
    assert steps_for_budget(600, 60, 0.5) == 1080
    assert steps_for_budget(600, 0, 0.5, overhead_fraction=0.2) == 1000
    assert steps_for_budget(10, 20, 0.5) == 1  # budget already spent: still one step
    with pytest.raises(ValueError):
        steps_for_budget(10, 0, 0.0)


def test_calibration_restores_weights_optimiser_and_rng():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    mask_generator = torch.Generator().manual_seed(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before, mask_before = torch.get_rng_state(), mask_generator.get_state()

    def step(_: int) -> None:
        loss = model(torch.randn(16, 8)).pow(2).mean() + torch.rand(1, generator=mask_generator).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    plan = plan_budget(step, [model], optimizer, budget_seconds=60, started_at=0.0, mask_generator=mask_generator)
    assert plan.total_steps >= 1 and plan.seconds_per_step > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN statistics too
    assert optimizer.state_dict()["state"] == {}
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(mask_generator.get_state(), mask_before)


def _pretrain(path, extra, *, resume=False):
    cmd = [sys.executable, "-m", "training.pretrain", *_args(path, extra)] + (["--resume"] if resume else [])
    subprocess.run(cmd, check=True, env=_env(), timeout=300, capture_output=True)


def test_budget_run_fixes_total_steps_and_resume_keeps_them(tmp_path):
    _pretrain(tmp_path, ["optim.budget_minutes=10", "run.max_steps=3"])  # stop early, as a kill would
    first = load_checkpoint(tmp_path / "checkpoint.pt")
    assert first["step"] == 3 and first["total_steps"] >= 3
    # Resuming does not measure again: the stored count fixes the schedule, whatever the new budget says.
    _pretrain(tmp_path, ["optim.budget_minutes=5", "run.max_steps=5"], resume=True)
    second = load_checkpoint(tmp_path / "checkpoint.pt")
    assert second["total_steps"] == first["total_steps"] and second["step"] == min(5, first["total_steps"])


def test_total_steps_sizes_the_schedule_across_epochs(tmp_path):
    _pretrain(tmp_path, ["optim.total_steps=12", "optim.horizon_scale=1.0"])  # 8 steps per epoch
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert (state["step"], state["total_steps"], state["epoch"], state["batch_in_epoch"]) == (12, 12, 1, 4)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # warm-up 1/3 of the run (warmup_epochs 1 of epochs 3), then cosine to final_lr on the last step
    assert records[-1]["lr"] == pytest.approx(1e-6) and records[3]["lr"] == pytest.approx(1e-3)


def test_budget_config_errors():
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["data.source=synthetic", "optim.total_steps=5", "optim.budget_minutes=1"])
    with pytest.raises(ConfigError, match="budget_minutes"):
        load_config(None, ["data.source=synthetic", "optim.budget_minutes=0"])
    with pytest.raises(ConfigError, match="augment.blur_p"):
        load_config(None, ["data.source=synthetic", "augment.blur_p=1.5"])
    with pytest.raises(ConfigError, match="augment.blur_sigma"):
        load_config(None, ["data.source=synthetic", "augment.blur_sigma=[2, 1]"])


def test_moved_key_still_loads():
    cfg = load_config(None, ["data.source=synthetic", "mask.color_jitter_strength=0.3"])
    assert cfg.augment.color_jitter_strength == 0.3


def test_run_length_is_decided_once_from_checkpoint_step_count_or_epochs():
    from types import SimpleNamespace

    from training.run.length import RunLength, build_schedules, decide_run_length

    def length(overrides, stored=None):
        cfg = load_config(None, ["data.source=synthetic", "optim.epochs=10", "optim.warmup_epochs=2", *overrides])
        return decide_run_length(SimpleNamespace(cfg=cfg, steps_per_epoch=5), stored_total_steps=stored,
                                 started_at=0.0), cfg

    assert length([])[0] == RunLength(50, 10, 50, "optim.epochs")  # official: warm-up in epochs
    assert length(["optim.total_steps=100"])[0] == RunLength(100, 20, 100, "optim.total_steps")  # same fraction
    assert length(["optim.total_steps=100", "run.max_steps=7"])[0] == RunLength(100, 20, 7, "optim.total_steps")
    # A resumed run keeps its stored length whatever the config now says; warm-up follows the same rule.
    assert length(["optim.budget_minutes=5"], stored=80)[0] == RunLength(80, 16, 80, "checkpoint")
    resumed, cfg = length(["optim.budget_minutes=5"], stored=80)
    schedules = build_schedules(cfg, resumed)
    assert (schedules.total_steps, schedules.warmup_steps) == (80, 16)
    assert schedules.at(15).lr == pytest.approx(cfg.optim.lr) and schedules.at(0).ema_momentum == cfg.optim.ema_start
