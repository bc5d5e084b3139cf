"""docs/results.md, "Does a run say when it learns nothing": ``benchmarks/results/stall_cases.json``."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import describe_machine
from benchmarks.render.text import table


def _margin(row: dict, where: str) -> str:
    value = row.get(where, {}).get("view_margin_cls")
    return "" if value is None else f"{value:.2f}"


def _scores(summary: dict | None) -> tuple[str, str]:
    if not summary:
        return "", ""
    shots = " / ".join(f"{summary[k]:.1f}" if summary.get(k) is not None else "-"
                       for k in ("1imgs_class", "2imgs_class", "5imgs_class"))
    knn = summary.get("knn")
    return shots, "" if knn is None else f"{knn:.1f}"


def section(results: Path) -> str:
    path = results / "stall_cases.json"
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    head = ["case", "healthy", "steps (planned)", "loss first → last", "view margin: start / 10 % / end",
            "warned (as run)", "warned now (cause)", "within 10 %", "served 1 / 2 / 5 labels", "served kNN-20",
            "pixels 1 / 2 / 5", "pixels kNN-20"]
    rows = []
    for row in data["cases"]:
        served, served_knn = _scores((row.get("scores") or {}).get("msn"))
        pixels, pixels_knn = _scores((row.get("scores") or {}).get("pixels"))
        as_run = row.get("warned_as_run")
        warned = row["warned_at"]
        within = "" if warned is None else ("yes" if warned <= 0.1 * row["planned_steps"] else "no")
        healthy = {True: "yes", False: "no", None: "plateau"}[row["healthy"]]
        rows.append([row["case"], healthy, f"{row['steps']:,} ({row['planned_steps']:,})",
                     f"{row['loss_first']:.2f} → {row['loss_last']:.2f}",
                     f"{_margin(row, 'start')} / {_margin(row, 'at_10pct')} / {_margin(row, 'end')}",
                     f"step {as_run['step']} ({as_run['cause']})" if as_run else "no",
                     f"step {warned} ({row['cause']})" if warned is not None else "no", within,
                     served, served_knn, pixels, pixels_knn])
    lines = ["## Does a run say when it learns nothing: the stall warning on six runs", "",
             ("`python -m benchmarks.training.stall_cases` (" + describe_machine(data["machine"]) + "): the six "
              f"cases sized in optimiser steps ({data['precision']}, nothing timed), then the targets as a "
              "user runs them (`--budget`, `run.precision` auto, the machine to itself; `-2m`/`-10m`): healthy and "
              "failed runs, the view "
              "probe's CLS view margin (how far two views of an image stand above other images, in standard "
              "deviations; `training/run/view_probe.py`) at the start, at 10 % of the steps and at the end; the stall "
              "warning the run gave as it ran and the one this code's detector gives on the same records; the served "
              "feature's low-shot (3 splits) and kNN-20 figures against raw pixels. Why these signals and "
              "thresholds: results-notes.md, \"A label-free signal of learning\"."), "",
             table(head, rows), ""]
    return "\n".join(lines)
