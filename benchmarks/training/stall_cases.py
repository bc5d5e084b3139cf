"""Does the run say when it learns nothing? Six runs, healthy and failed, with the label-free signals they log.

    python -m benchmarks.training.stall_cases                    # every case, then the table
    python -m benchmarks.training.stall_cases --cases demo digits-good
    python -m benchmarks.training.stall_cases --dry-run          # print the commands, run nothing
    python -m benchmarks.training.stall_cases --collect-only     # the table from the runs on disk

The cases, each a real ``training/pretrain.py`` run:

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
steps are about what a 10-minute budget (2 for ``planted-small``) ran on a 2-core Zen 4 (a Zen 5 runs ~9,500 in 10
minutes: the ``-10m`` cases). Each finished run is
exported and scored (``msn-eval lowshot --shots 1 2 5 --splits 3``, ``msn-eval knn``), with raw pixels. The table
(stdout and ``benchmarks/results/stall_cases.json``): per case the view signals at the start, at 10 % and at the
end, the loss, whether and when the stall detector warned and what it named (``warned_as_run``: the code that ran
the run; ``warned_at``: this code's detector read over the same records, ``replay``), and the low-shot figures.
Nothing is timed. Steps whose outputs exist are skipped; the runs live under ``runs/stall_cases/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, machine
from benchmarks.training.digit_forms import write_form_folders
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
    trainer_budget,
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
    healthy: bool | None = True  # a healthy run should not be warned; None: neither (the glyphs' plateau)
    budget: str | None = None  # a timed case: --budget instead of ``steps`` (give it the machine to itself)


CASES = (
    Case("planted-small", "fmnist2000", 1_500, PLANT, healthy=False),
    Case("planted-demo", "demo", 5_000, PLANT, stop_at=1_000, healthy=False),
    Case("digits-hard", "digits28", 5_000, OFFICIAL_VIEWS, healthy=False),
    Case("digits-good", "digits28", 5_000),
    Case("glyphs", "glyphs", 5_000, healthy=None),
    Case("demo", "demo", 5_000),
)
# The stall warning's targets as a user runs them: wall-clock budgets, run.precision auto, the machine to itself.
# ``steps`` only sizes the stall check's 10 % (the planned length is read back from the run).
TIMED = (
    Case("planted-small-2m", "fmnist2000", 0, PLANT, healthy=False, budget="2m"),
    Case("planted-demo-10m", "demo", 0, PLANT, stop_at=1_000, healthy=False, budget="10m"),
    Case("digits28-nearest-10m", "digits28-nearest", 0, budget="10m"),
    Case("demo-10m", "demo", 0, budget="10m"),
)


def _precision() -> str:
    from msn_core.hardware import cpu_info

    return cpu_info().auto_precision


def data_steps(root: Path) -> dict[str, tuple[Step, Path | None, str]]:
    """Per data name: the step writing it, the unlabelled folder (None: the recipe's own source) and the labelled
    data the evaluations read."""
    flat, digits, glyphs = root / "fmnist2000" / "images", root / "digits28", data_dir(root, (16, 28, 32))
    nearest = root / "digits28-nearest"
    return {
        "fmnist2000": (Step("write 2,000 Fashion-MNIST images", ["(python) write_flat_folder", str(flat)],
                            [flat.with_suffix(".json")], lambda: write_flat_folder(flat, limit=2000)),
                       flat, "fashion-mnist"),
        "demo": (Step("the demo's data", ["(none)"], [], lambda: None), None, "fashion-mnist"),
        "digits28": (Step("write the 28 px digits", ["(python) write_folders", str(digits)],
                          [digits / "images.json"], lambda: write_folders(digits, 28)),
                     digits / "flat", str(digits / "labelled")),
        "digits28-nearest": (Step("write the 28 px digits, resized nearest", ["(python) write_form_folders",
                                                                              str(nearest)],
                                  [nearest / "images.json"], lambda: write_form_folders(nearest, "nearest")),
                             nearest / "flat", str(nearest / "labelled")),
        "glyphs": (Step("write the glyph folders", ["(python) write_glyph_folders", str(glyphs)],
                        [glyphs / "images.json"], lambda: write_glyph_folders(glyphs)),
                   glyphs / "flat", str(glyphs / "labelled")),
    }


def case_plan(case: Case, root: Path) -> list[Step]:
    write, folder, labelled = data_steps(root)[case.data]
    work, run_dir = root / case.name, root / case.name / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    source = ["--data", str(folder)] if folder is not None else ["--config", "configs/fmnist_vit_tiny.yaml"]
    if case.budget is None:
        sets = {**case.sets, "optim.total_steps": case.steps, "optim.budget_minutes": None,
                "run.max_steps": case.stop_at or case.steps, "run.precision": _precision()}
        length = []
    else:
        sets = {**case.sets, **({"run.max_steps": case.stop_at} if case.stop_at else {})}
        length = ["--budget", case.budget]
    command = [torchrun, "--standalone", "--nproc_per_node=1", "training/pretrain.py", *source, *length,
               "--output-dir", str(run_dir), *set_args({**sets, "run.progress_bar": False})]
    steps = [write, pretrain_step(f"pretrain {case.name}", command, run_dir, log=work / "pretrain.log")]
    if case.stop_at is None:
        steps += [export_step(work, run_dir / "checkpoint.pt", "msn"),
                  *bundle_and_pixels_evals(work, "msn", SHOTS, data=labelled)]
    return steps


def replay(run_dir: Path, records: list[dict], planned_steps: int):
    """The stall detector of this code read over a finished run's records (it reads nothing else): the warning it
    gives now, whatever the code that ran the run gave. The images' detail is re-surveyed for a planned run."""
    from training.config import load_config
    from training.run.stall import StallDetector, StallSettings
    from training.run.survey import survey_data

    cfg = load_config(run_dir / "config.yaml")
    detail = None
    if cfg.data.root is not None:
        detail = survey_data(cfg.data.source, cfg.data.root, image_root=cfg.data.image_root).detail_side
    detector = StallDetector(StallSettings.from_config(cfg, cfg.data.batch_size, detail), total_steps=planned_steps)
    return next((stall for r in records if (stall := detector.update(r["step"], r)) is not None), None)


def collect(case: Case, root: Path) -> dict:
    """The case's signals, warning and scores, from its ``metrics.jsonl`` and evaluations."""
    work = root / case.name
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in records if "view_top1" in r]
    stall = next((r for r in records if "stall" in r), None)
    planned = case.steps or trainer_budget(work / "run" / "checkpoint.pt")["planned_total_steps"]
    now = replay(work / "run", records, planned)
    last = records[-1]
    tenth = min(probes, key=lambda r: abs(r["step"] - 0.1 * planned)) if probes else {}
    row = {"case": case.name, "healthy": case.healthy, "budget": case.budget, "steps": last["step"],
           "planned_steps": planned,
           "loss_first": records[0]["loss"], "loss_last": last["loss"],
           "warned_as_run": {"step": stall["step"], "cause": stall["stall"]} if stall else None,
           "warned_at": now.step if now else None, "cause": now.cause if now else None,
           "message": now.message if now else None,
           "start": {k: probes[0].get(f"{k}_start") for k in SIGNALS} if probes else {},
           "at_10pct": {"step": tenth.get("step"), **{k: tenth.get(k) for k in SIGNALS}},
           "end": {k: probes[-1].get(k) for k in SIGNALS} if probes else {},
           "trace": [{"step": r["step"], "loss": r["loss"], **{k: r.get(k) for k in SIGNALS}} for r in probes]}
    if case.stop_at is None and (work / "evals").is_dir():
        row["scores"] = summarize_evals(read_evals(work), ("msn", "pixels"))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES + TIMED],
                        default=[c.name for c in CASES], help="default: the six step-sized cases; the timed ones "
                        "(" + ", ".join(c.name for c in TIMED) + ") by name")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--collect-only", action="store_true")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES + TIMED if c.name in args.cases]
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
