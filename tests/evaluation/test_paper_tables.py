import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tables():
    from benchmarks.evaluation import paper_tables

    return paper_tables


def test_dry_run_plans_every_ablation_of_the_step_sized_profile(tables, tmp_path, capsys):
    argv = ["--profile", "cpu", "--dry-run", "--workdir", str(tmp_path), "--docs", str(tmp_path / "docs")]
    assert tables.main(argv) == 0
    out = capsys.readouterr().out
    pretrain = [line for line in out.splitlines() if "training/pretrain.py" in line]
    assert len(pretrain) == 8
    assert all("--set run.seed=0" in line and "--set run.max_steps=" in line and "--resume" in line
               for line in pretrain)
    assert any("--set mask.share_target_view=true" in line for line in pretrain)
    assert any("--set mask.ratio=0.0 --set mask.num_focal=0" in line for line in pretrain)
    assert "--backend pixels" in out and "robustness" in out and "--plot-tsne" in out
    assert not (tmp_path / "docs").exists()  # a dry run writes nothing


def test_the_default_profile_is_the_shipped_recipe_with_focal_rows_added(tables, tmp_path, capsys):
    """``make demo``'s config and budget, unchanged for the MSN row; focal views only where a row needs them."""
    assert tables.main(["--dry-run", "--workdir", str(tmp_path), "--docs", str(tmp_path / "docs")]) == 0
    out = capsys.readouterr().out
    pretrain = {line.split("--output-dir ")[1].split()[0].rsplit("/", 1)[1]: line
                for line in out.splitlines() if "training/pretrain.py" in line}
    assert len(pretrain) == 8 and all("--config configs/fmnist_vit_tiny.yaml" in line for line in pretrain.values())
    assert not any("--resume" in line or "max_steps" in line or "budget" in line for line in pretrain.values())
    assert pretrain["msn"].endswith("--set run.seed=0 --set run.progress_bar=false")  # the recipe as shipped
    focal = "--set mask.num_focal=4 --set mask.focal_size=14"
    assert {name for name, line in pretrain.items() if focal in line} == {"msn_focal", "focal_only"}
    assert "--set mask.ratio=0.0" in pretrain["no_mask"] and "ratio_0.3" not in pretrain  # 0.3 is the recipe's
    assert tables.strategy_runs(tables.PROFILES["demo"].focal_views) == {
        "none": "no_mask", "focal only": "focal_only", "random only": "msn", "random + focal": "msn_focal"}
    for name in pretrain:  # every run gets a kNN beside its low-shot rows
        assert f"{name}-knn.json" in out and f"{name}-lowshot.json" in out


def test_render_marks_missing_results(tables):
    from benchmarks.protocol import SETTINGS
    from benchmarks.render.results_page import render_profile

    runs = tables.pretraining_runs(0.3)
    rows = [{"setting": s, "mean": 70.0, "std": 1.0, "fit_seconds": [0.1, 0.2, 0.3]}
            for s, _ in SETTINGS]
    result = {"profile": "cpu", "machine": "test machine", "seconds": 60.0, "overrides": {}, "default_ratio": 0.3,
              "lambd": 0.00025, "runs": {n: {"label": r.label} for n, r in runs.items()},
              "evals": {"msn-lowshot": {"results": rows}}}
    text = render_profile(result)
    for title in ("### 1.", "### 2.", "### 3.", "### 4.", "### 5.", "Solver check"):
        assert title in text
    assert "70.0 ± 1.0" in text and "n/a" in text and "test machine" in text
    assert "| cyanure 1.2.2, official stop (gap 1e-3, 300 epochs) | 70.00 (0.200 s)" in text


def test_a_budgeted_profile_renders_first_with_its_own_strategy_rows(tables, tmp_path):
    from benchmarks.protocol import SETTINGS
    from benchmarks.render.results_page import render

    def lowshot(acc):
        return {"results": [{"setting": s, "mean": acc, "std": 0.5, "fit_seconds": [0.1]} for s, _ in SETTINGS]}

    focal = tables.PROFILES["demo"].focal_views
    runs = {n: {"label": r.label, "steps": 1000 + i}
            for i, (n, r) in enumerate(tables.pretraining_runs(0.3, focal).items())}
    evals = {"msn-lowshot": lowshot(60.0), "msn_focal-lowshot": lowshot(55.0),
             "msn_focal-knn": {"results": [{"top1": 80.5}]},
             "no_mask-cls-lowshot": lowshot(40.0), "no_mask-cls-knn": {"results": [{"top1": 70.25}]}}
    demo = {"profile": "demo", "machine": "demo machine", "seconds": 60.0, "overrides": {}, "default_ratio": 0.3,
            "lambd": 0.00025, "runs": runs, "evals": evals, "budgeted": True, "config": "configs/fmnist_vit_tiny.yaml",
            "patches": 16, "strategy": tables.strategy_runs(focal)}
    old = {**demo, "profile": "cpu", "machine": "old machine", "budgeted": False, "strategy": None,
           "evals": {"msn-lowshot": lowshot(60.0)}}
    del old["strategy"]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "cpu.json").write_text(json.dumps(old))
    (tmp_path / "results" / "demo.json").write_text(json.dumps(demo))
    text = render(tmp_path)
    assert text.index("shipped recipe (profile `demo`)") < text.index("## Profile `cpu`")
    assert "| random only | `msn` | 60.0 ± 0.5 |" in text
    assert "| random + focal | `msn_focal` | 55.0 ± 0.5 | 55.0 ± 0.5 | 55.0 ± 0.5 | 55.0 ± 0.5 | 80.5 | 59.8 |" in text
    assert "msn 1,000, msn_focal 1,001" in text and "on 16 patches" in text
    assert "### 6. Every run on the paper's feature" in text.split("## Profile `cpu`")[0]
    assert ("| `no_mask`: no masking (no random mask, no focal views) "
            "| 40.0 ± 0.5 | 40.0 ± 0.5 | 40.0 ± 0.5 | 40.0 ± 0.5 | 70.2 |") in text
    assert "### 6." not in text.split("## Profile `cpu`")[1]  # the old profile measured no CLS rows


def test_render_includes_the_rcdm_table_when_its_results_exist(tmp_path):
    from benchmarks.render.results_page import render

    ratio = {"msn": {"consistent": 0.41, "cos_msn": 0.98}, "random": {"consistent": 0.17, "cos_msn": 0.96}}
    rcdm = {"ratios": {"0.0": ratio, "0.9": ratio}, "machine": "x86_64", "machine_name": "test cpu", "seconds": 120.0,
            "msn": {"bundle": "msn-a", "decoder_steps": 2000}, "images": 100, "samples_per_image": 4,
            "sampling_steps": 100, "sampler": "ddpm",
            "classifier": {"train_images": 1000, "accuracy_on_originals": 0.69},
            "chance": 0.1, "cos_unrelated": 0.92, "grid": {"file": "rcdm_samples.png"}}
    assert "RCDM" not in render(tmp_path)
    (tmp_path / "rcdm_eval.json").write_text(json.dumps(rcdm))
    text = render(tmp_path)
    assert "| 0.9 | 0.410 | 0.170 | 0.980 | 0.960 |" in text
    assert "test cpu" in text and "100 DDPM steps" in text and "(rcdm_samples.png)" in text


def test_budget_curve_plans_one_run_per_budget_and_renders_its_table(tmp_path, capsys):
    from benchmarks.render.results_page import render
    from benchmarks.training import budget_curve

    assert budget_curve.main(["--dry-run", "--budgets", "10", "30", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    pretrain = [line for line in out.splitlines() if "training.pretrain" in line]
    assert len(pretrain) == 2 and all("--set optim.budget_minutes=" in line for line in pretrain)
    for name in ("budget-10min", "budget-30min"):
        assert f"{name}-lowshot.json" in out and f"{name}-knn.json" in out
    assert "pixels-lowshot.json" in out and "random_init-knn.json" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing

    rows = [{"setting": "1imgs_class", "mean": 55.5, "std": 0.5}]
    run = {"steps": 900, "epochs": 2, "images_per_sec": 300.0, "wall_minutes": 10.2, "load_before": 0.1,
           "load_after": 1.9}
    result = {"machine": "test cpu", "config": "configs/x.yaml", "seed": 0, "budgets": [10],
              "runs": {"budget-10min": run},
              "evals": {"budget-10min-lowshot": {"results": rows}, "pixels-knn": {"results": [{"top1": 80.25}]}}}
    (tmp_path / "budget_curve.json").write_text(json.dumps(result))
    text = render(tmp_path)
    assert "| MSN, 10 min (900 steps, 300 img/s, 2 epochs) | 55.5 ± 0.5 | n/a | n/a | n/a | n/a |" in text
    assert "| raw pixels | n/a | n/a | n/a | n/a | 80.2 |" in text
    assert "test cpu" in text and "10 min: 0.10" in text


def test_a_later_budget_merges_into_the_curve_of_the_same_machine_only():
    import pytest

    from benchmarks.training.budget_curve import merge

    def curve(budget: int, cpu: str) -> dict:
        name = f"budget-{budget}min"
        return {"machine": {"cpu": cpu}, "config": "c.yaml", "seed": 0, "budgets": [budget],
                "runs": {name: {"steps": budget}}, "evals": {f"{name}-knn": {"top1": budget},
                                                             "pixels-knn": {"top1": cpu}}}

    merged = merge(curve(10, "epyc"), curve(60, "epyc"))
    assert merged["budgets"] == [10, 60] and set(merged["runs"]) == {"budget-10min", "budget-60min"}
    assert {"budget-10min-knn", "budget-60min-knn", "pixels-knn"} == set(merged["evals"])
    with pytest.raises(SystemExit, match="measured on 'epyc'"):
        merge(curve(10, "epyc"), curve(60, "xeon"))
    with pytest.raises(SystemExit, match="seed"):
        merge(curve(10, "epyc"), {**curve(60, "epyc"), "seed": 1})


def test_budget_verdict_compares_with_pixels_and_the_targets():
    from benchmarks.render.budget import render_budget

    def lowshot(acc, std=0.0):
        return {"results": [{"setting": f"{k}imgs_class", "mean": acc, "std": std} for k in (1, 2, 5)]}

    def knn(top1):
        return {"results": [{"top1": top1}]}

    run = {"steps": 1, "epochs": 0, "images_per_sec": 1.0, "wall_minutes": 1.0, "load_before": 0.0}
    evals = {"budget-10min-lowshot": lowshot(52.0, std=3.0), "budget-10min-knn": knn(86.0),
             "budget-30min-lowshot": lowshot(58.0), "budget-30min-knn": knn(87.0),
             "pixels-lowshot": lowshot(50.0), "pixels-knn": knn(85.7)}
    result = {"machine": "m", "config": "c", "seed": 0, "budgets": [10, 30],
              "runs": {"budget-10min": run, "budget-30min": run}, "evals": evals}
    text = render_budget(result)
    assert "- 10 min: 1/class 52.0 vs 50.0: met (inside one std);" in text
    assert "kNN 86.0 vs 85.7: met." in text
    assert "- 30 min: 1/class 58.0 vs 54.0: met; 2/class 58.0 vs 61.0: **missed**" in text
    assert "kNN 87.0 vs 88.0: **missed**" in text


def test_the_renderer_reproduces_the_committed_docs_from_the_stored_json(capsys):
    """docs/*.md are generated: rendering the stored JSON again changes nothing (edit the JSON or the renderer)."""
    from benchmarks.render import docs as render_docs

    assert render_docs.main(["--check"]) == 0, capsys.readouterr().out


def test_rendering_never_imports_measuring_code():
    """The renderer runs without torch or a server: it reads JSON and the few names a script and it share.
    (Import cycles anywhere under benchmarks/ are tests/test_import_rules.py's.)"""
    from tests.import_graph import import_graph, inside, violations

    shared = {"benchmarks", "benchmarks.common", "benchmarks.protocol", "benchmarks.training.recipe_trials"}
    bad = violations(import_graph(REPO, ("benchmarks",)), lambda a: inside(a, "benchmarks.render"),
                     lambda b: not inside(b, "benchmarks.render") and b not in shared)
    assert not bad, "benchmarks/render imports measuring code:\n" + "\n".join(bad)
