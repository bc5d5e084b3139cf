"""The own-images section of docs/results.md, from ``benchmarks/results/flat_folder-*.json``
(``python -m benchmarks.training.flat_folder``)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line

SETTINGS = [("1imgs_class", "1 label"), ("2imgs_class", "2 labels"), ("5imgs_class", "5 labels")]


def _row(name: str, evals: dict, which: str) -> str:
    lowshot = {r["setting"]: r for r in evals[f"{which}-lowshot"]["results"]}
    cells = [f"{lowshot[s]['mean']:.1f} ± {lowshot[s]['std']:.1f}" for s, _ in SETTINGS]
    knn = evals[f"{which}-knn"]["results"][0]["top1"]
    return f"| {name} | " + " | ".join(cells) + f" | {knn:.1f} |"


def _used(run: dict, budget_min: float) -> str:
    used = run.get("trainer_budget_seconds_used")
    own = (f"the trainer counted {used / 60:.2f} min ({100 * used / 60 / budget_min:.1f} %; first plan "
           f"{run['planned_total_steps']:,} steps, re-planned {run['replans']} times), " if used else "")
    return own + f"torchrun's wall clock {run['wall_minutes']:.2f} min (process start and imports included)"


def section(results: Path) -> str:
    reports = sorted(results.glob("flat_folder-*.json"), key=lambda p: json.loads(p.read_text())["run"]
                     .get("wall_minutes", 0))
    if not reports:
        return ""
    lines = ["## Your own images: a flat folder, no config", "",
             ("`python -m benchmarks.training.flat_folder --budget B`: the 60,000 Fashion-MNIST training images "
              "written as one flat folder of PNGs with no labels, then `torchrun --nproc_per_node=1 "
              "training/pretrain.py --data DIR --budget B` with no config and no `--set` (the run is planned from the "
              "images and the machine), `msn-export`, and the official low-shot protocol (3 splits, the full 10k "
              "test set) and kNN-20 against the 60k, on the feature the bundle serves and on raw pixels under the "
              "same preprocessing. One run per budget."), ""]
    for path in reports:
        r = json.loads(path.read_text())
        run = r["run"]
        budget_min = float(r["budget"].rstrip("m"))
        lines += [f"### Budget {r['budget']}", "", machine_line(r["machine"]), "",
                  (f"{run['steps']:,} steps at {run['images_per_sec']:.0f} images/s. Budget "
                   f"{budget_min:g} min: {_used(run, budget_min)}. Served feature: "
                   f"`{r['evals']['flat-lowshot'].get('feature', 'as msn.json says')}`."), "",
                  "| | " + " | ".join(label for _, label in SETTINGS) + " | kNN-20 |",
                  "|---|---|---|---|---|",
                  _row("MSN, flat folder, planned", r["evals"], "flat"),
                  _row("raw pixels", r["evals"], "pixels"), ""]
    return "\n".join(lines)
