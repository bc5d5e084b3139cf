"""benchmarks/evaluation/label_efficiency.py on tiny synthetic data: the loop, its targets and its report.

No dataset is needed.
"""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.evaluation.label_efficiency import Loop, summarise, targets
from benchmarks.render.label import plot, render_label_efficiency


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    """10 Gaussian classes of very unequal size (a uniform draw misses the small ones), 16-d."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(10, 16)) * 3
    sizes = np.array([400, 300, 200, 100, 60, 40, 30, 30, 20, 20])

    def draw(scale: float) -> tuple[np.ndarray, np.ndarray]:
        y = np.repeat(np.arange(10), (sizes * scale).astype(int))
        return (centres[y] + rng.normal(size=(len(y), 16))).astype(np.float32), y

    (xtr, ytr), (xte, yte) = draw(1.0), draw(0.5)
    return {"x_train": xtr, "y_train": ytr, "x_test": xte, "y_test": yte}


def test_loop_is_deterministic_and_reveals_only_picked_labels(data):
    loop = Loop(data, candidates=600, selector="typical", suggester="margin")
    runs = {s: loop.run("select+suggest", s, [10, 20], 10) for s in range(2)}
    assert runs[0] == loop.run("select+suggest", 0, [10, 20], 10)
    assert set(runs[0]) == {10, 20} and all(0 <= a <= 100 for r in runs.values() for a in r.values())
    picked = loop.pick("random", [], 10, seed=3, rnd=0, model=None)
    assert picked == np.random.default_rng(3).permutation(len(data["y_train"]))[:10].tolist()
    more = loop.pick("select", picked, 10, seed=3, rnd=1, model=None)
    assert len(set(more)) == 10 and not set(more) & set(picked)


def test_selector_covers_classes_a_uniform_draw_misses(data):
    loop = Loop(data, candidates=2000, selector="typical", suggester="margin")
    y = data["y_train"]
    covered = {s: (len(set(y[loop.pick("select", [], 10, s, 0, None)])),
                   len(set(y[loop.pick("random", [], 10, s, 0, None)]))) for s in range(3)}
    assert np.mean([c[0] for c in covered.values()]) > np.mean([c[1] for c in covered.values()])


def test_targets_and_report(tmp_path):
    acc = {"onnx": {"random": summarise({0: {10: 30.0, 100: 60.0}, 1: {10: 32.0, 100: 62.0}}, [10, 100]),
                    "select": summarise({0: {10: 45.0, 100: 63.0}, 1: {10: 43.0, 100: 64.0}}, [10, 100])}}
    t = targets(acc)
    assert t["selector_beats_random_by_10_at_10"] == {"gain": 13.0, "met": True}
    report = {"accuracy": acc, "targets": t, "seeds": 2, "budgets": [10, 100], "round": 10, "selector": "typical",
              "suggester": "margin", "candidates": 20000, "machine": "test machine", "bundle": "b"}
    text = render_label_efficiency(report)
    assert "| MSN | select | 44.0 ± 1.4 | 63.5 ± 0.7 |" in text and "+13.0 points, met" in text
    plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 5000
