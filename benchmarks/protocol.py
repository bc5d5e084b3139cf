"""Names a measuring script and the renderer must agree on: run names, protocol constants, results file names.

They live here, not in either side, so that the scripts and the renderer import this small module instead of each
other.
"""
from __future__ import annotations

from benchmarks.common import DOCS, RESULTS

# --- benchmarks/evaluation/paper_tables.py -> docs/results/<profile>.json
ABLATION_RATIOS = (0.15, 0.3, 0.5, 0.7)
ROBUSTNESS_RATIOS = (0.15, 0.3, 0.5, 0.7, 0.9)
KNN_TRAIN = 10_000  # first 10k training images: a kNN over all 60k costs minutes per model on 2 cores
# Low-shot settings as msn-eval names them, and their column titles.
SETTINGS = [("1imgs_class", "1/class"), ("2imgs_class", "2/class"), ("5imgs_class", "5/class"), ("1percent", "1 %")]


def ratio_run(ratio: float, default_ratio: float) -> str:
    """Run name of a masking-ratio ablation; the default ratio is the ``msn`` run itself."""
    return "msn" if ratio == default_ratio else f"ratio_{ratio:g}"


def tsne_name(profile: str) -> str:
    return f"tsne_fmnist_{profile}.png"


# --- benchmarks/training/budget_curve.py -> docs/budget_curve.json (plotted to docs/budget_curve.png by the renderer)
BUDGET_JSON, BUDGET_PNG = "budget_curve.json", "budget_curve.png"


def budget_bundle(minutes: float) -> str:
    """Name of the budget curve's run, bundle and eval prefix for a budget of ``minutes``."""
    return f"budget-{minutes:g}min"


# --- benchmarks/evaluation/rcdm_eval.py -> docs/rcdm_eval.json (+ the sample grid it draws)
RCDM_JSON = "rcdm_eval.json"

# --- benchmarks/evaluation/label_efficiency.py -> benchmarks/results/label_efficiency.json (plotted by the renderer)
LABEL_JSON = RESULTS / "label_efficiency.json"
LABEL_PNG = DOCS / "label_efficiency.png"

# --- benchmarks/training/recipe_search.py -> benchmarks/results/recipe_search.json
RECIPE_JSON = RESULTS / "recipe_search.json"
