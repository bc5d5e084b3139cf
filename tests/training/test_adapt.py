"""--on-stall adapt: a stalled run switches itself once to the advice it was given (training/run/adapt.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.training.test_stall import TINY
from training.config import Config, ConfigError, FrozenConfigError, freeze, with_keys
from training.run.events import adapt_schedules
from training.run.length import RunLength, RunSchedule, build_schedules
from training.run.schedules import ResizedSchedules
from training.run.stall import Adaptation

REPO = Path(__file__).resolve().parents[2]


def _config() -> Config:
    cfg = Config()
    cfg.data.source = "synthetic"
    return cfg


def test_the_advice_replaces_the_frozen_config_checked_like_a_set():
    cfg = freeze(_config())
    with pytest.raises(FrozenConfigError):  # the decided config is read-only: a switch replaces it
        cfg.optim.lr = 1.0
    adapted = with_keys(cfg, {"mask.rand_crop_scale": [0.6, 1.0], "mask.ratio": 0.3, "optim.lr": 2.5e-4})
    assert adapted.mask.rand_crop_scale == [0.6, 1.0] and adapted.mask.ratio == 0.3 and adapted.optim.lr == 2.5e-4
    assert cfg.mask.rand_crop_scale == [0.3, 1.0] and cfg.mask.ratio == 0.15 and cfg.optim.lr == 1e-3  # as it was
    with pytest.raises(ConfigError, match="unknown config key"):
        with_keys(cfg, {"mask.nothing": 1})
    with pytest.raises(ConfigError):
        with_keys(cfg, {"run.on_stall": "explode"})


def test_new_learning_rates_take_effect_from_the_step_and_keep_the_length_and_resizes():
    cfg = _config()
    cfg.optim.lr, cfg.optim.start_lr = 2.5e-6, 2e-6
    first = RunLength(total_steps=1000, warmup_steps=100, stop_at=1000, decided_by="test")
    schedule = RunSchedule(first, ResizedSchedules(build_schedules(cfg, first)).resize(50, 1200))
    before = schedule.schedules.at(60).lr
    adapt_schedules(schedule, with_keys(cfg, {"optim.lr": 2.5e-4, "optim.start_lr": 2e-4}))
    assert schedule.schedules.total_steps == 1200 and schedule.schedules.resizes == ((50, 1200),)
    assert schedule.schedules.at(60).lr == pytest.approx(100 * before, rel=0.02)


def test_an_adaptation_round_trips_through_its_record():
    adaptation = Adaptation(120, "learning_rate", {"optim.lr": 2.5e-4})
    assert Adaptation.from_record(json.loads(json.dumps(adaptation.record()))) == adaptation
    assert Adaptation.from_record(None) is None
    assert "optim.lr=0.00025" in adaptation.describe()


def test_a_stalled_run_adapts_once_checkpoints_it_and_a_resume_keeps_it(tmp_path):
    """A tiny run at a learning rate ~900x below the rule, with --on-stall adapt: the stall is warned, the run
    switches to the advised learning rate at that step (log, metrics, config.yaml, checkpoint), trains on at it,
    and a resumed run continues with it without adapting again. One thread each: torch's default of one a core makes
    a model this small spin its threads against the rest of the suite (4-5x the CPU time on a shared 2-core machine)."""
    out = tmp_path / "run"
    sets = [*TINY, "optim.total_steps=1200", "run.checkpoint_every_steps=50", "optim.lr=1e-7", "optim.start_lr=1e-7",
            "run.precision=fp32"]
    command = [sys.executable, str(REPO / "training" / "pretrain.py"), "--output-dir", str(out), "--on-stall",
               "adapt", "--set", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run([*command, "run.max_steps=130"], env=env, capture_output=True, text=True, timeout=300,
                           check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "run.on_stall=adapt: switching" in first.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stalled = [r for r in records if "stall" in r]
    assert len(stalled) == 1 and stalled[0]["stall"] == "learning_rate"
    step = stalled[0]["step"]
    after = [r["lr"] for r in records if r["step"] > step]
    assert after and min(after) > 100 * 1e-7  # trained on at the advised learning rate
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["plan"]["adapted"]["step"] == step and config["optim"]["lr"] == config["plan"]["adapted"]["sets"][
        "optim.lr"] > 1e-5
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["adapted"]["step"] == step and checkpoint["config"]["optim"]["lr"] > 1e-5
    resumed = subprocess.run([*command, "run.max_steps=140", "--resume"], env=env, capture_output=True, text=True,
                             check=False, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "switching" not in resumed.stderr  # once per run
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["optim"]["lr"] > 1e-5 and config["plan"]["adapted"]["step"] == step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 140 and records[-1]["lr"] > 100 * 1e-7
