"""The frozen-feature choice (``benchmarks/evaluation/feature_choice.py``).

One table per bundle, held-out training images only.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line

SHOTS = (1, 2, 5)


def render_feature_choice(results: Path) -> str | None:
    """The section of ``docs/results.md``, or None when no ``feature_choice*.json`` exists."""
    files = sorted(results.glob("feature_choice*.json"))
    if not files:
        return None
    lines = ["## Which feature to serve: chosen on held-out training images", "",
             ("`python -m benchmarks.evaluation.feature_choice --bundle DIR`: each feature of the bundle's torch "
              "encoder on the "
              "60k training images; a seeded 10k of them are the validation set, low-shot draws (3 per setting, "
              "class-balanced) come from the other 50k; kNN-20 is pool against validation. The test set is not "
              "used. Score = mean of the four columns; the best MSN feature is the served default "
              "(`model.feature`)."), ""]
    for path in files:
        r = json.loads(path.read_text())
        lines += [f"### `{Path(r['bundle']).name}` ({r['model_id']})", "",
                  f"Machine: {machine_line(r['machine'])}. Chosen: **{r['chosen']}**.", "",
                  "| feature | dim | 1-shot | 2-shot | 5-shot | kNN-20 | score |", "|---|---|---|---|---|---|---|"]
        for name, row in r["features"].items():
            shots = " | ".join(f"{row[f'{s}shot']['mean']:.1f} ± {row[f'{s}shot']['std']:.1f}" for s in SHOTS)
            mark = "**" if name == r["chosen"] else ""
            lines.append(f"| {mark}{name}{mark} | {row['dim']} | {shots} | {row['knn20']:.1f} | {row['score']:.2f} |")
        lines.append("")
    return "\n".join(lines)
