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
              "used. Score = mean of the four columns. Each feature's *untrained* row is the same feature of the "
              "bundle's random-init twin (same architecture, seed 0): the choice weighs what training added (a "
              "feature must beat pixels and gain the margin over its untrained row at each of 1, 2 and 5 labels); "
              "tables "
              "measured before that rule have no untrained rows."), ""]
    for path in files:
        r = json.loads(path.read_text())
        lines += [f"### `{Path(r['bundle']).name}` ({r['model_id']})", "",
                  f"Machine: {machine_line(r['machine'])}. Chosen: **{r['chosen']}**"
                  + (f": {r['reason']}." if r.get("reason") else "."), "",
                  "| feature | dim | 1-shot | 2-shot | 5-shot | kNN-20 | score |", "|---|---|---|---|---|---|---|"]
        for name, row in r["features"].items():
            shots = " | ".join(f"{row[f'{s}shot']['mean']:.1f} ± {row[f'{s}shot']['std']:.1f}" for s in SHOTS)
            mark = "**" if name == r["chosen"] else ""
            lines.append(f"| {mark}{name}{mark} | {row['dim']} | {shots} | {row['knn20']:.1f} | {row['score']:.2f} |")
            if "untrained" in row:
                u = row["untrained"]
                cells = " | ".join(f"{u[f'{s}shot']['mean']:.1f} ± {u[f'{s}shot']['std']:.1f}" for s in SHOTS)
                lines.append(f"| &nbsp;&nbsp;untrained | | {cells} | {u['knn20']:.1f} | {u['score']:.2f} |")
        lines.append("")
    return "\n".join(lines)
