import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paper_tables.py"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("paper_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_dry_run_plans_every_ablation_with_one_budget(tables, tmp_path, capsys):
    assert tables.main(["--dry-run", "--workdir", str(tmp_path), "--docs", str(tmp_path / "docs")]) == 0
    out = capsys.readouterr().out
    pretrain = [line for line in out.splitlines() if "training/pretrain.py" in line]
    assert len(pretrain) == 8
    assert all("--set run.seed=0" in line and "--set run.max_steps=" in line for line in pretrain)
    assert any("--set mask.share_target_view=true" in line for line in pretrain)
    assert any("--set mask.ratio=0.0 --set mask.num_focal=0" in line for line in pretrain)
    assert "--backend pixels" in out and "robustness" in out and "--plot-tsne" in out
    assert not (tmp_path / "docs").exists()  # a dry run writes nothing


def test_render_marks_missing_results(tables):
    from benchmarks import results_report as report

    runs = tables.pretraining_runs(0.3)
    rows = [{"setting": s, "mean": 70.0, "std": 1.0, "fit_seconds": [0.1, 0.2, 0.3]}
            for s, _ in report.SETTINGS]
    result = {"profile": "cpu", "machine": "test machine", "seconds": 60.0, "overrides": {}, "default_ratio": 0.3,
              "lambd": 0.00025, "runs": {n: {"label": r.label} for n, r in runs.items()},
              "evals": {"msn-lowshot": {"results": rows}}}
    text = report.render_profile(result)
    for title in ("### 1.", "### 2.", "### 3.", "### 4.", "### 5.", "Solver check"):
        assert title in text
    assert "70.0 ± 1.0" in text and "n/a" in text and "test machine" in text
    assert "| cyanure 1.2.2, official stop (gap 1e-3, 300 epochs) | 70.00 (0.200 s)" in text


def test_render_includes_the_rcdm_table_when_its_results_exist(tmp_path):
    from benchmarks.results_report import render

    ratio = {"msn": {"consistent": 0.41, "cos_msn": 0.98}, "random": {"consistent": 0.17, "cos_msn": 0.96}}
    rcdm = {"ratios": {"0.0": ratio, "0.9": ratio}, "machine": "x86_64", "machine_name": "test cpu", "seconds": 120.0,
            "msn": {"bundle": "msn-a", "decoder_steps": 2000}, "images": 100, "samples_per_image": 4,
            "sampling_steps": 100, "sampler": "ddpm", "classifier": {"train_images": 1000, "accuracy_on_originals": 0.69},
            "chance": 0.1, "cos_unrelated": 0.92, "grid": {"file": "rcdm_samples.png"}}
    assert "RCDM" not in render(tmp_path)
    (tmp_path / "rcdm_eval.json").write_text(json.dumps(rcdm))
    text = render(tmp_path)
    assert "| 0.9 | 0.410 | 0.170 | 0.980 | 0.960 |" in text
    assert "test cpu" in text and "100 DDPM steps" in text and "(rcdm_samples.png)" in text


def test_budget_curve_plans_one_schedule_and_renders_its_table(tmp_path, capsys):
    from benchmarks import budget_curve
    from benchmarks.results_report import render

    assert budget_curve.main(["--dry-run", "--epochs", "3", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    pretrain = [line for line in out.splitlines() if "training/pretrain.py" in line]
    assert len(pretrain) == 1 and "--set optim.epochs=3 --set run.keep_epoch_checkpoints=1" in pretrain[0]
    for epoch in (1, 2, 3):
        assert f"checkpoint-ep000{epoch}.pt" in out and f"ep000{epoch}-lowshot.json" in out
    assert "pixels-lowshot.json" in out and "random_init-knn.json" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing

    rows = [{"setting": "1imgs_class", "mean": 55.5, "std": 0.5}]
    result = {"machine": "test cpu", "config": "configs/x.yaml", "epochs": 3, "eval_epochs": [1, 3],
              "pretrain_step_seconds": 600.0, "eval_seconds": 120.0,
              "evals": {"ep0003-lowshot": {"results": rows}, "pixels-knn": {"results": [{"top1": 80.25}]}}}
    (tmp_path / "budget_curve.json").write_text(json.dumps(result))
    text = render(tmp_path)
    assert "| MSN after 3 epochs | 55.5 ± 0.5 | n/a | n/a | n/a | n/a |" in text
    assert "| raw pixels | n/a | n/a | n/a | n/a | 80.2 |" in text
    assert "test cpu" in text and "10 min of optimiser steps" in text
    assert "MSN above raw pixels at 1, 2 and 5 images per class: n/a." in text


def test_budget_verdict_names_the_epoch_from_which_msn_stays_above(tmp_path):
    from benchmarks.results_report import render_budget

    def lowshot(acc):
        return {"results": [{"setting": f"{k}imgs_class", "mean": acc, "std": 0.0} for k in (1, 2, 5)]}

    evals = {"ep0001-lowshot": lowshot(60.0), "ep0002-lowshot": lowshot(40.0), "ep0003-lowshot": lowshot(55.0),
             "ep0004-lowshot": lowshot(56.0), "pixels-lowshot": lowshot(50.0), "random_init-lowshot": lowshot(30.0)}
    result = {"machine": "m", "config": "c", "epochs": 4, "eval_epochs": [1, 2, 3, 4], "pretrain_step_seconds": 60.0,
              "eval_seconds": 60.0, "evals": evals}
    text = render_budget(result)
    assert "above raw pixels at 1, 2 and 5 images per class: from epoch 3 on" in text
    assert "above the random-init ViT at 1, 2 and 5 images per class: from epoch 1 on" in text
    evals["ep0004-lowshot"] = lowshot(45.0)
    assert "raw pixels at 1, 2 and 5 images per class: **not by epoch 4**" in render_budget(result)
