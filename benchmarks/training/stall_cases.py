"""Does the run say when it learns nothing? Six runs, healthy and failed, with the label-free signals they log.

    python -m benchmarks.training.stall_cases                    # every case, then the table
    python -m benchmarks.training.stall_cases --cases demo digits-good
    python -m benchmarks.training.stall_cases --dry-run          # print the commands, run nothing
    python -m benchmarks.training.stall_cases --collect-only     # the table from the runs on disk

The cases (issue 50), each a real ``training/pretrain.py`` run:

- ``planted-small``: 2,000 Fashion-MNIST training images as a flat folder, planned (``--data``), with the
  learning rate 100x below the rule (``optim.lr=2.5e-6 optim.start_lr=2e-6``);
- ``planted-demo``: the demo recipe (``configs/fmnist_vit_tiny.yaml``, 60,000 images) with the same plant, stopped
  at 20 % of its steps (a stall warning must come within the first 10 %);
- ``digits-hard``: scikit-learn's digits at 28 px (bicubic; ``other_folders.py``'s split) planned, with the
  official views put back by ``--set`` (crops from 30 %, 30 % masked, colour jitter, grey, blur): views too hard;
- ``digits-good``: the same folder, the plan (its low-detail views learn);
- ``glyphs``: the rendered glyphs (``glyph_folders.py``), the plan: the loss plateaus ~7 % below log K;
- ``demo``: the demo recipe unchanged.

Runs are sized in optimiser steps (``optim.total_steps``; ``run.max_steps`` to stop early) with ``run.precision=bf16``
where the CPU has bf16 units (else fp32), so what is learned does not depend on a shared machine's speed; the
steps are about what a 10-minute budget (2 for ``planted-small``) runs on a 2-core Zen 4/5. Each finished run is
exported and scored (``msn-eval lowshot --shots 1 2 5 --splits 3``, ``msn-eval knn``), with raw pixels. The table
(stdout and ``benchmarks/results/stall_cases.json``): per case the view signals at the start, at 10 % and at the
end, the loss, whether and when the stall detector warned and what it named, and the low-shot figures. Nothing is
timed. Steps whose outputs exist are skipped; the runs live under ``runs/stall_cases/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, machine
from benchmarks.training.flat_folder import write_flat_folder
from benchmarks.training.glyph_folders import data_dir, write_glyph_folders
from benchmarks.training.other_folders import write_folders
from benchmarks.training.steps import (
    Step,
    bundle_and_pixels_evals,
    export_step,
    pretrain_step,
    print_plan,
    read_evals,
    run_steps,
    set_args,
    summarize_evals,
)
from msn_core.durable import atomic_write_json

ROOT = REPO / "runs" / "stall_cases"
OUT = REPO / "benchmarks" / "results" / "stall_cases.json"
SHOTS = ("1", "2", "5")
PLANT = {"optim.lr": 2.5e-6, "optim.start_lr": 2e-6}
OFFICIAL_VIEWS = {"mask.rand_crop_scale": [0.3, 1.0], "mask.ratio": 0.3, "augment.color_jitter_p": 0.8,
                  "augment.grayscale_p": 0.2, "augment.blur_p": 0.5}
SIGNALS = ("view_top1_cls", "view_margin_cls", "view_top1", "view_margin", "feature_rank")


@dataclass(frozen=True)
class Case:
    name: str
    data: str  # "fmnist2000" | "demo" | "digits28" | "glyphs"
    steps: int
    sets: dict = field(default_factory=dict)
    stop_at: int | None = None  # run.max_steps: stop early, the schedules still sized for ``steps``
    healthy: bool = True  # what the warning should say: nothing for a healthy run


CASES = (
    Case("planted-small", "fmnist2000", 1_500, PLANT, healthy=False),
    Case("planted-demo", "demo", 5_000, PLANT, stop_at=1_000, healthy=False),
    Case("digits-hard", "digits28", 5_000, OFFICIAL_VIEWS, healthy=False),
    Case("digits-good", "digits28", 5_000),
    Case("glyphs", "glyphs", 5_000),
    Case("demo", "demo", 5_000),
)


def _precision() -> str:
    from msn_core.hardware import cpu_info

    return cpu_info().auto_precision


def data_steps(root: Path) -> dict[str, tuple[Step, Path | None, str]]:
    """Per data name: the step writing it, the unlabelled folder (None: the recipe's own source) and the labelled
    data the evaluations read."""
    flat, digits, glyphs = root / "fmnist2000" / "images", root / "digits28", data_dir(root, (16, 28, 32))
    return {
        "fmnist2000": (Step("write 2,000 Fashion-MNIST images", ["(python) write_flat_folder", str(flat)],
                            [flat.with_suffix(".json")], lambda: write_flat_folder(flat, limit=2000)),
                       flat, "fashion-mnist"),
        "demo": (Step("the demo's data", ["(none)"], [], lambda: None), None, "fashion-mnist"),
        "digits28": (Step("write the 28 px digits", ["(python) write_folders", str(digits)],
                          [digits / "images.json"], lambda: write_folders(digits, 28)),
                     digits / "flat", str(digits / "labelled")),
        "glyphs": (Step("write the glyph folders", ["(python) write_glyph_folders", str(glyphs)],
                        [glyphs / "images.json"], lambda: write_glyph_folders(glyphs)),
                   glyphs / "flat", str(glyphs / "labelled")),
    }


def case_plan(case: Case, root: Path) -> list[Step]:
    write, folder, labelled = data_steps(root)[case.data]
    work, run_dir = root / case.name, root / case.name / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    source = ["--data", str(folder)] if folder is not None else ["--config", "configs/fmnist_vit_tiny.yaml"]
    sets = {**case.sets, "optim.total_steps": case.steps, "optim.budget_minutes": None,
            "run.max_steps": case.stop_at or case.steps, "run.precision": _precision(), "run.progress_bar": False}
    command = [torchrun, "--standalone", "--nproc_per_node=1", "training/pretrain.py", *source,
               "--output-dir", str(run_dir), *set_args(sets)]
    steps = [write, pretrain_step(f"pretrain {case.name}", command, run_dir, log=work / "pretrain.log")]
    if case.stop_at is None:
        steps += [export_step(work, run_dir / "checkpoint.pt", "msn"),
                  *bundle_and_pixels_evals(work, "msn", SHOTS, data=labelled)]
    return steps


def collect(case: Case, root: Path) -> dict:
    """The case's signals, warning and scores, from its ``metrics.jsonl`` and evaluations."""
    work = root / case.name
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in records if "view_top1" in r]
    stall = next((r for r in records if "stall" in r), None)
    last = records[-1]
    tenth = min(probes, key=lambda r: abs(r["step"] - 0.1 * case.steps)) if probes else {}
    row = {"case": case.name, "healthy": case.healthy, "steps": last["step"], "planned_steps": case.steps,
           "loss_first": records[0]["loss"], "loss_last": last["loss"],
           "warned_at": stall["step"] if stall else None, "cause": stall["stall"] if stall else None,
           "message": stall["stall_message"] if stall else None,
           "start": {k: probes[0].get(f"{k}_start") for k in SIGNALS} if probes else {},
           "at_10pct": {"step": tenth.get("step"), **{k: tenth.get(k) for k in SIGNALS}},
           "end": {k: probes[-1].get(k) for k in SIGNALS} if probes else {},
           "trace": [{"step": r["step"], "loss": r["loss"], **{k: r.get(k) for k in SIGNALS}} for r in probes]}
    if case.stop_at is None and (work / "evals").is_dir():
        row["scores"] = summarize_evals(read_evals(work), ("msn", "pixels"))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=[c.name for c in CASES])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--collect-only", action="store_true")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if c.name in args.cases]
    for case in chosen:
        steps = case_plan(case, args.root)
        if args.dry_run:
            print_plan(steps)
        elif not args.collect_only:
            run_steps(steps, args.root / case.name)
    if args.dry_run:
        return 0
    rows = [collect(c, args.root) for c in chosen if (args.root / c.name / "run" / "metrics.jsonl").is_file()]
    previous = json.loads(OUT.read_text())["cases"] if OUT.is_file() else []
    kept = [r for r in previous if r["case"] not in {row["case"] for row in rows}]
    atomic_write_json(OUT, {"machine": machine(), "precision": _precision(), "cases": kept + rows})
    for row in rows:
        print(f"{row['case']:14s} steps {row['steps']:5d} loss {row['loss_first']:.2f} -> {row['loss_last']:.2f} "
              f"warned {row['warned_at']} ({row['cause']}) start {row['start']} 10% {row['at_10pct']} "
              f"end {row['end']} scores {row.get('scores')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
