"""Is the plan sound off Fashion-MNIST? Other small images, pretrained from an unlabelled folder with no config.

    python -m benchmarks.training.other_folders --dry-run                 # print the plans, run nothing
    python -m benchmarks.training.other_folders                           # 8 px and 32 px, 10 minutes each
    python -m benchmarks.training.other_folders --sizes 8 --budget 30m

The images: scikit-learn's handwritten digits (1,797 grey 8 x 8 images, 10 classes, installed with scikit-learn,
so no download; the only labelled image set besides Fashion-MNIST this machine has), written at their own 8 px and
resampled (bicubic) to 32 px. Nothing about them was used to tune the trainer's plan. For each size:

1. A fixed stratified split (2/3 train, 1/3 test, seed 0). The training images go to ``WORK/flat/NNNN.png``, one
   flat folder with no labels, for pretraining; both parts go to ``WORK/labelled/{train,val}/<digit>/NNNN.png`` for
   evaluation only.
2. ``torchrun --standalone --nproc_per_node=1 training/pretrain.py --data WORK/flat --budget B --output-dir
   WORK/run``: no ``--config``, no ``--set``. The run's collapse detector is on (it is by default); the step it
   confirms a collapse at, if any, is copied from the run's ``metrics.jsonl`` into the result.
3. ``msn-export``, then ``msn-eval lowshot --shots 1 2 5 --splits 3`` (seeded per-class samples of the training
   part) and ``msn-eval knn`` (weighted kNN-20 against the whole training part), on the test part, for the bundle's
   served feature and for raw pixels (``--backend pixels``) under the same preprocessing.

Steps whose outputs exist are skipped (an interrupted pretraining run starts again: its budget is wall-clock time).
The pretraining runs are timed: give them the machine to themselves. The result goes to
``benchmarks/results/other_folders-<budget>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import REPO, RESULTS, machine, save_json
from benchmarks.training.steps import (
    Step,
    bundle_and_pixels_evals,
    export_step,
    pretrain_step,
    print_plan,
    read_evals,
    run_record,
    run_steps,
    summarize_evals,
)
from msn_core.durable import atomic_write_json

SHOTS = ("1", "2", "5")
BUNDLE = "flat"


def digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_images, train_labels, test_images, test_labels)``: uint8 8 x 8, a stratified 2/3 : 1/3 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(digits.images * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        test[members[: len(members) // 3]] = True
    return images[~test], labels[~test], images[test], labels[test]


def _save(image: np.ndarray, path: Path, size: int) -> None:
    from PIL import Image

    if path.is_file():
        return
    picture = Image.fromarray(image, mode="L")
    if size != picture.width:
        picture = picture.resize((size, size), Image.Resampling.BICUBIC)
    partial = path.with_name(f".{path.name}.partial")  # hidden: never listed as an image
    picture.save(partial, format="PNG")
    os.replace(partial, path)


def write_folders(work: Path, size: int) -> int:
    """The unlabelled training folder and the labelled train/val tree; idempotent, recorded in ``WORK/images.json``."""
    record = work / "images.json"
    if record.is_file():
        return json.loads(record.read_text())["train"]
    train_x, train_y, test_x, test_y = digits_split()
    for part, xs, ys in (("train", train_x, train_y), ("val", test_x, test_y)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            folder = work / "labelled" / part / str(int(y))
            folder.mkdir(parents=True, exist_ok=True)
            _save(x, folder / f"{i:04d}.png", size)
            if part == "train":
                (work / "flat").mkdir(parents=True, exist_ok=True)
                _save(x, work / "flat" / f"{i:04d}.png", size)
    atomic_write_json(record, {"train": len(train_x), "test": len(test_x), "size": size,
                               "source": "sklearn.datasets.load_digits", "split": "stratified 2/3 : 1/3, seed 0"})
    return len(train_x)


def folder_run(work: Path, budget: str, data: Path | None = None, sets: Sequence[str] = ()) -> Step:
    """Pretraining on the unlabelled folder ``data`` (default ``WORK/flat``) into ``WORK/run``; ``sets``: the
    ``--set KEY=VALUE`` overrides of the plan, if any."""
    run_dir = work / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node=1", "training/pretrain.py", "--data",
               str(data or work / "flat"), "--budget", budget, "--output-dir", str(run_dir),
               *(["--set", *sets] if sets else [])]
    # the run's own output, kept beside it
    return pretrain_step(f"pretrain --data (budget {budget})", command, run_dir, log=work / "pretrain.log")


def folder_plan(work: Path, write: Step, budget: str, data: Path, labelled: Path,
                sets: Sequence[str] = ()) -> list[Step]:
    """``write`` (the images), pretraining on ``data``, export, and the evaluations on the ``labelled`` tree."""
    return [write, folder_run(work, budget, data, sets), export_step(work, work / "run" / "checkpoint.pt", BUNDLE),
            *bundle_and_pixels_evals(work, BUNDLE, SHOTS, data=str(labelled))]


def build_plan(work: Path, size: int, budget: str) -> list[Step]:
    write = Step(f"write the {size} px folders", ["(python) write_folders", str(work)], [work / "images.json"],
                 lambda: print(f"{write_folders(work, size)} training images in {work / 'flat'}"))
    return folder_plan(work, write, budget, work / "flat", work / "labelled")


def collect_run(work: Path, budget: str, images: Path, data: Path | None = None, sets: Sequence[str] = ()) -> dict:
    """A finished plan's record: the images' record (``images``), the command, the planned config, the run (with
    the step a collapse was confirmed at, if any) and the evaluations."""
    run_dir = work / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    flagged = [r for r in records if r.get("collapse")]  # the detector's record (training/run/monitor.py)
    collapse = {"step": flagged[0]["step"], "message": flagged[0].get("collapse_message")} if flagged else None
    run = {**run_record(run_dir), "collapse": collapse}
    evals = read_evals(work)
    summary = summarize_evals(evals, (BUNDLE, "pixels"))
    return {"images": json.loads(images.read_text()), "command": folder_run(work, budget, data, sets).command,
            "config": yaml.safe_load((run_dir / "config.yaml").read_text()), "run": run, "summary": summary,
            "evals": evals}


def collect(work: Path, size: int, budget: str) -> dict:
    return {"size": size, **collect_run(work, budget, work / "images.json")}


def execute(plans: dict[Path, list[Step]], *, dry_run: bool, pretrain_only: bool) -> bool:
    """Print (``dry_run``) or run each plan in its work folder (``pretrain_only``: its first two steps, the images
    and the timed run); True when every plan ran to the end and its results can be collected."""
    if dry_run:
        for steps in plans.values():
            print_plan(steps)
        return False
    for work, steps in plans.items():
        run_steps(steps[:2] if pretrain_only else steps, work)
    return not pretrain_only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32], help="image sizes to write and train")
    parser.add_argument("--budget", default="10m", help="pretrain.py --budget (e.g. 10m, 30m)")
    parser.add_argument("--workdir", type=Path, help="one folder per size under it (default: runs/other_folders)")
    parser.add_argument("--pretrain-only", action="store_true", help="stop each plan after pretraining (the timed "
                        "part), so evaluations can run later")
    parser.add_argument("--dry-run", action="store_true", help="print the plans and exit")
    args = parser.parse_args(argv)
    root = (args.workdir or REPO / "runs" / "other_folders").resolve()
    works = {size: root / f"digits{size}-{args.budget}" for size in args.sizes}
    plans = {work: build_plan(work, size, args.budget) for size, work in works.items()}
    if not execute(plans, dry_run=args.dry_run, pretrain_only=args.pretrain_only):
        return 0
    report = {"machine": machine(), "budget": args.budget,
              "folders": {f"digits{size}": collect(work, size, args.budget) for size, work in works.items()}}
    save_json(RESULTS / f"other_folders-{args.budget}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
