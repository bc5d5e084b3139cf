import json

import numpy as np
import pytest

from training.evaluation.cli import format_table, main


@pytest.fixture
def run(tiny_bundle, tmp_path, capsys):
    def _run(*argv: str) -> dict:
        out = tmp_path / "result.json"
        common = ["--bundle", str(tiny_bundle), "--data", "synthetic", "--synthetic-size", "60", "--max-test", "30",
                  "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--json", str(out)]
        assert main([*argv, *common]) == 0
        assert capsys.readouterr().out.strip()  # a table was printed
        return json.loads(out.read_text())

    return _run


def test_lowshot_end_to_end(run):
    report = run("lowshot", "--shots", "1", "2", "1percent", "--splits", "2")
    rows = report["results"]
    assert report["feature"] == "cls_pre_norm" and report["backend"] == "onnx"
    assert [r["setting"] for r in rows] == ["1imgs_class", "2imgs_class", "1percent"]
    for row in rows:
        assert len(row["accuracies"]) == 2 and 0 <= row["mean"] <= 100
        assert row["mean"] == pytest.approx(np.mean(row["accuracies"]))


def test_lowshot_sweep_torch_backend_and_subset_file(run, tmp_path):
    subset = tmp_path / "mine.txt"
    subset.write_text("\n".join(str(i) for i in range(20)) + "\n")  # 2 per class of the 10 synthetic classes
    report = run("lowshot", "--subset-file", str(subset), "--lambd-sweep", "--backend", "torch")
    assert {r["setting"] for r in report["results"]} == {"mine"}
    assert len(report["results"]) == 5  # one row per lambd of the sweep


def test_knn_linear_and_pixels(run):
    assert run("knn", "--k", "5")["results"][0]["test"] == 30
    linear = run("linear", "--epochs", "3")["results"][0]
    assert 0 <= linear["test_accuracy"] <= 100 and linear["train"] == 60
    pixels = run("knn", "--backend", "pixels")["results"][0]
    assert pixels["top1"] > 50  # synthetic gratings are easy from raw pixels too


def test_robustness_end_to_end(run):
    rows = run("robustness", "--ratios", "0.5", "0.9", "--shots", "1", "--splits", "1", "--max-images", "10")["results"]
    cosine = {r["ratio"]: r["value"] for r in rows if r["metric"] == "cosine"}
    assert set(cosine) == {0.5, 0.9} and all(-1 <= v <= 1 for v in cosine.values())
    assert {r["ratio"] for r in rows if r["metric"] == "lowshot"} == {0.0, 0.5, 0.9}


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        main(["lowshot", "--bundle", "b", "--data", "synthetic", "--shots", "0"])
    with pytest.raises(SystemExit):
        main(["nonsense"])
    with pytest.raises(SystemExit, match="not an MSN bundle|msn.json"):
        main(["knn", "--bundle", "/nonexistent", "--data", "synthetic"])


def test_format_table():
    table = format_table([{"setting": "1imgs_class", "mean": 50.0, "std": 1.25, "accuracies": [1, 2]}])
    assert "50.00 ± 1.25" in table and "accuracies" not in table
