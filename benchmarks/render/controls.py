"""What `make demo`'s pretraining adds: the demo bundle beside its untrained twin and raw pixels, as `make demo`
prints them (its msn-eval calls write ``runs/demo/eval/*.json``; the measured set is kept under
``benchmarks/results/demo_controls/`` with the machine's ``lscpu``)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import table

ROWS = [("served", "trained", "served feature (`msn.json`), trained"),
        ("served", "untrained", "served feature, **untrained** (random init, seed 0)"),
        ("cls", "trained", "paper's CLS (`cls_pre_norm`), trained"),
        ("cls", "untrained", "paper's CLS, **untrained**"),
        ("pixels", None, "raw pixels")]
SHOTS = ("1imgs_class", "2imgs_class", "5imgs_class")


def _cell(run: dict, setting: str) -> str:
    row = next((r for r in run["results"] if r["setting"] == setting), None)
    return f"{row['mean']:.1f} ± {row['std']:.1f}" if row else "n/a"


def _machine(folder: Path) -> str:
    text = (folder / "machine.txt").read_text() if (folder / "machine.txt").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), [])
    keep = [f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")]
    run = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Demo run")), "")
    return f"{model or 'unknown CPU'} (flags {' '.join(keep) or 'not recorded'})" + (f"; {run}" if run else "")


def section(results: Path) -> str | None:
    """The section of ``docs/results.md``, or None when the demo's controls were not measured. One table per
    measured machine: ``demo_controls/`` and any ``demo_controls-NAME/`` beside it."""
    folders = [f for f in sorted(results.glob("demo_controls*")) if (f / "lowshot-served-trained.json").exists()]
    if not folders:
        return None
    served = json.loads((folders[0] / "lowshot-served-trained.json").read_text())
    parts = [
        "## What `make demo`'s 10 minutes add: the trained encoder beside the same network untrained", "",
        ("`make demo` as a user runs it, the machine to itself, 2 cores. Low-shot top-1 (%) on "
         "the 10,000 test images, mean ± std over the 3 shipped splits (the paper's protocol); weighted kNN-20 "
         f"against the 60k training images. The served feature is `{served['feature']}`; the untrained rows "
         "(`msn-eval lowshot --bundle bundles/demo --untrained 0`) are the bundle's architecture, preprocessing and "
         "feature with random weights: "
         "what training added is the difference."), ""]
    for folder in folders:
        parts += [f"{_machine(folder)}:", "", _table(folder), ""]
    return "\n".join(parts)


def _table(folder: Path) -> str:
    rows = []
    for feature, weights, label in ROWS:
        stem = f"{feature}-{weights}" if weights else feature
        lowshot, knn = folder / f"lowshot-{stem}.json", folder / f"knn-{stem}.json"
        if not lowshot.exists():
            continue
        run = json.loads(lowshot.read_text())
        knn_top1 = json.loads(knn.read_text())["results"][0]["top1"] if knn.exists() else None
        rows.append([label, *(_cell(run, s) for s in SHOTS), f"{knn_top1:.1f}" if knn_top1 is not None else "n/a"])
    return table(["feature", "1 / class", "2 / class", "5 / class", "kNN-20"], rows)
