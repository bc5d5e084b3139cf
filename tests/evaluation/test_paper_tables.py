import importlib.util
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
    assert "--backend pixels" in out and "robustness" in out and "TSNE" in out
    assert not (tmp_path / "docs").exists()  # a dry run writes nothing


def test_render_marks_missing_results(tables):
    runs = tables.pretraining_runs(0.3)
    rows = [{"setting": s, "mean": 70.0, "std": 1.0, "fit_seconds": [0.1, 0.2, 0.3]}
            for s, _ in tables.SETTINGS]
    result = {"profile": "cpu", "machine": "test machine", "seconds": 60.0, "overrides": {}, "default_ratio": 0.3,
              "lambd": 0.00025, "runs": {n: {"label": r.label} for n, r in runs.items()},
              "evals": {"msn-lowshot": {"results": rows}}}
    text = tables.render_profile(result)
    for title in ("### 1.", "### 2.", "### 3.", "### 4.", "### 5.", "Solver check"):
        assert title in text
    assert "70.0 ± 1.0" in text and "n/a" in text and "test machine" in text
    assert "| cyanure 1.2.2 | 70.00 (0.200 s)" in text
