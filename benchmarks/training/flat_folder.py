"""Fashion-MNIST as a user's own images: a flat folder of PNGs with no labels, pretrained with no config.

    python -m benchmarks.training.flat_folder --dry-run               # print the plan, run nothing
    python -m benchmarks.training.flat_folder                          # 10-minute budget (about 20 min in all)
    python -m benchmarks.training.flat_folder --budget 30m --seed 1
    python -m benchmarks.training.flat_folder --write-only --limit 300 # only write (the first 300 of) the folder

What a new user does with a folder of their own images, measured where labels exist to score it:

1. The 60,000 Fashion-MNIST training images (Debian's idx files, ``training.data.FashionMNIST``) are written to
   ``WORK/images/00000.png`` ... as 28 x 28 greyscale PNGs: one flat folder, no class folders, no label file.
   Idempotent: a file is written through a temporary name and renamed, existing files are kept, and
   ``WORK/images.json`` (outside the folder) records a finished folder.
2. ``torchrun --standalone --nproc_per_node=1 training/pretrain.py --data WORK/images --budget B --output-dir
   WORK/run``: no ``--config`` and no ``--set``; whatever the trainer decides from the data and the machine is
   what is measured (the resolved config is copied into the result).
3. ``msn-export`` of the checkpoint, then ``msn-eval lowshot --shots 1 2 5 --splits 3`` (the shipped splits, the
   official protocol) and ``msn-eval knn`` (kNN-20 against all 60,000 training images) on ``fashion-mnist``, for the
   bundle's served feature and for raw pixels (``--backend pixels``) under the same preprocessing.

Steps whose outputs exist are skipped (an interrupted pretraining run starts again: its budget is wall-clock time).
The pretraining run is timed: give it the machine to itself. The result goes to
``benchmarks/results/flat_folder-<budget>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
BUNDLE = "flat"  # WORK/bundles/flat; the pixels baseline reads its preprocessing


# ------------------------------------------------------------------------------------------- the image folder


def write_flat_folder(out: Path, *, limit: int | None = None, root: str | None = None) -> int:
    """Write Fashion-MNIST's training images (the first ``limit``) as ``out/NNNNN.png``; returns how many exist.

    Safe to run again and to interrupt: complete files are kept, each new one appears only once it is whole, and
    the record ``out.with_suffix('.json')`` (beside the folder, so the folder holds images only) is written last.
    """
    from PIL import Image

    from training.data import FashionMNIST

    images = FashionMNIST(root, split="train").images
    count = len(images) if limit is None else min(limit, len(images))
    record = out.with_suffix(".json")
    if record.is_file() and json.loads(record.read_text()).get("images") == count:
        return count
    out.mkdir(parents=True, exist_ok=True)
    width = len(str(len(images) - 1))
    for i in range(count):
        path = out / f"{i:0{width}d}.png"
        if path.is_file():
            continue
        partial = out / f".{path.name}.partial"  # hidden: never listed as an image
        Image.fromarray(images[i]).save(partial, format="PNG")
        os.replace(partial, path)
    atomic_write_json(record, {"images": count, "source": "fashion-mnist train", "format": "28x28 L PNG",
                               "labels": None})
    return count


# ------------------------------------------------------------------------------------------------- the plan


def flat_run(work: Path, budget: str, seed: int) -> Step:
    run_dir = work / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node=1", "training/pretrain.py", "--data",
               str(work / "images"), "--budget", budget, "--output-dir", str(run_dir)]
    if seed:  # the default seed needs no --set: the measured command is exactly the user's
        command += ["--set", f"run.seed={seed}"]
    return pretrain_step(f"pretrain --data (budget {budget})", command, run_dir)


def build_plan(work: Path, budget: str, seed: int, limit: int | None) -> list[Step]:
    images = work / "images"
    steps = [Step("write the flat folder", ["(python) write_flat_folder", str(images)], [images.with_suffix(".json")],
                  lambda: print(f"{write_flat_folder(images, limit=limit)} images in {images}")),
             flat_run(work, budget, seed)]
    return [*steps, export_step(work, work / "run" / "checkpoint.pt", BUNDLE),
            *bundle_and_pixels_evals(work, BUNDLE, SHOTS)]


def collect(work: Path, budget: str, seed: int) -> dict:
    """The run (steps, throughput, wall time, skipped files, the resolved config) and every evaluation."""
    run_dir = work / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    run = {**run_record(run_dir), "skipped_files": records[-1].get("skipped_files")}
    evals = read_evals(work)
    summary = summarize_evals(evals, (BUNDLE, "pixels"))
    return {"machine": machine(), "budget": budget, "seed": seed, "images": json.loads(
        (work / "images.json").read_text())["images"], "command": flat_run(work, budget, seed).command,
        "config": config, "run": run, "summary": summary, "evals": evals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="10m", help="pretrain.py --budget (e.g. 10m, 30m, 1h)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="images, run, bundles, evaluations (default: runs/flat_folder)")
    parser.add_argument("--limit", type=int, help="write only the first N images (a smoke test of the plan)")
    parser.add_argument("--write-only", action="store_true", help="write the folder and stop")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    work = (args.workdir or REPO / "runs" / "flat_folder").resolve()
    if args.write_only:
        print(f"{write_flat_folder(work / 'images', limit=args.limit)} images in {work / 'images'}")
        return 0
    steps = build_plan(work, args.budget, args.seed, args.limit)
    if args.dry_run:
        print_plan(steps)
        return 0
    run_steps(steps, work)
    save_json(RESULTS / f"flat_folder-{args.budget}.json", collect(work, args.budget, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
