"""benchmarks/training/stall_cases.py: the cases it plans, the detector replayed over a run's records, the table."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.stall import section
from benchmarks.training.stall_cases import CASES, TIMED, case_plan, replay
from training.config import Config, dump_config


def test_every_case_is_one_pretraining_run_and_finished_ones_are_scored(tmp_path):
    for case in CASES + TIMED:
        names = [step.name for step in case_plan(case, tmp_path)]
        assert names[1] == f"pretrain {case.name}"
        command = case_plan(case, tmp_path)[1].command
        assert ("--budget" in command) == (case.budget is not None)
        assert any(name.startswith("eval msn lowshot") for name in names) == (case.stop_at is None)
    planted = case_plan(CASES[0], tmp_path)[1].command
    assert "optim.lr=2.5e-06" in planted and "optim.total_steps=1500" in planted


def test_the_detector_is_replayed_over_a_finished_run_and_tabled(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = Config()
    cfg.data.source, cfg.optim.lr = "synthetic", 2.5e-6
    dump_config(cfg, run / "config.yaml")
    records = [{"step": step, "loss": 6.9, "target_entropy": 5.4, "entropy": 6.7, "view_margin_cls": 0.88,
                "view_margin_cls_start": 0.88, "view_top1": 8.0} for step in range(30, 301, 30)]
    stall = replay(run, records, planned_steps=1500)
    assert stall is not None and stall.cause == "learning_rate" and stall.step == 150
    row = {"case": "planted", "healthy": False, "budget": None, "steps": 300, "planned_steps": 1500,
           "loss_first": 6.9, "loss_last": 6.9, "warned_as_run": None, "warned_at": stall.step,
           "cause": stall.cause, "start": {"view_margin_cls": 0.88}, "at_10pct": {"view_margin_cls": 0.88},
           "end": {"view_margin_cls": 0.88}, "scores": {"msn": {"1imgs_class": 40.0, "2imgs_class": 50.0,
                                                                "5imgs_class": 60.0, "knn": 80.0}}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "stall_cases.json").write_text(json.dumps({"machine": "a test machine", "precision": "fp32",
                                                          "cases": [row]}))
    text = section(results)
    assert "| planted | no | 300 (1,500) |" in text and "step 150 (learning_rate) | no |" not in text
    assert "step 150 (learning_rate) | yes |" in text and "40.0 / 50.0 / 60.0" in text
    assert section(Path(tmp_path / "nowhere")) == ""
