"""Does a warm start keep what the source learned and add to it? A further budget from the demo's checkpoint.

    python -m benchmarks.training.warm_start --dry-run          # print the plan, run nothing
    python -m benchmarks.training.warm_start                    # 10 more minutes from runs/demo/checkpoint.pt
    python -m benchmarks.training.warm_start --checkpoint runs/x/checkpoint.pt --minutes 30 --seed 1

The source is a finished pretraining run (by default the one ``make demo`` trains for 10 minutes). A new run of the
same recipe (``configs/fmnist_vit_tiny.yaml``), on the same data, starts from it with ``--init-from`` (fresh
optimiser, schedules over the new budget) and trains for ``--minutes``. Both are exported by ``msn-export`` and
evaluated by ``msn-eval`` on the feature their bundle serves and on the paper's protocol (the last block's CLS
before the final norm): low-shot at 1, 2 and 5 labels per class on the 3 shipped splits, and weighted kNN-20 against
all 60,000 training images. The pretraining run is timed: give it the machine to itself.

Steps whose outputs exist are skipped, so an interrupted plan continues (an interrupted pretraining run starts
again: its budget is wall-clock time). The result, with each metric's change over the source, goes to
``benchmarks/results/warm_start.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import REPO, RESULTS, machine, save_json
from benchmarks.training.steps import (
    PAPER_CLS,
    Step,
    eval_step,
    export_step,
    pretrain_step,
    print_plan,
    read_evals,
    run_record,
    run_steps,
    set_args,
)

CHECKPOINT = REPO / "runs" / "demo" / "checkpoint.pt"  # make demo's DEMO_RUN
CONFIG = REPO / "configs" / "fmnist_vit_tiny.yaml"  # the recipe make demo trains
OUT = RESULTS / "warm_start.json"
SHOTS = ("1", "2", "5")
PROTOCOLS = {"served": [], "cls": PAPER_CLS}  # eval tag prefix -> msn-eval arguments


def warm_name(minutes: float) -> str:
    return f"warm-{minutes:g}min"


def warm_run(work: Path, config: Path, checkpoint: Path, minutes: float, seed: int, overrides: list[str]) -> Step:
    run_dir = work / "runs" / warm_name(minutes)
    command = [sys.executable, "-m", "training.pretrain", "--config", str(config), "--output-dir", str(run_dir),
               "--init-from", str(checkpoint),
               *set_args({"optim.budget_minutes": minutes, "run.seed": seed, "run.progress_bar": False}),
               *[arg for pair in overrides for arg in ("--set", pair)]]
    return pretrain_step(f"pretrain {warm_name(minutes)} from {checkpoint}", command, run_dir)


def build_plan(work: Path, config: Path, checkpoint: Path, minutes: float, seed: int,
               overrides: list[str] = ()) -> list[Step]:
    warm = warm_name(minutes)
    steps = [export_step(work, checkpoint, "source"),
             warm_run(work, config, checkpoint, minutes, seed, list(overrides)),
             export_step(work, work / "runs" / warm / "checkpoint.pt", warm)]
    for bundle in ("source", warm):
        for prefix, extra in PROTOCOLS.items():
            steps.append(eval_step(work, bundle, "lowshot", ["--shots", *SHOTS, "--splits", "3", *extra],
                                   tag=f"{prefix}-lowshot"))
            steps.append(eval_step(work, bundle, "knn", extra, tag=f"{prefix}-knn"))
    return steps


def headline(report: dict) -> dict[str, float]:
    """An msn-eval JSON report as ``{metric: accuracy %}``: ``lowshot-1imgs_class``, ..., ``knn``."""
    if report["command"] == "knn":
        return {"knn": report["results"][0]["top1"]}
    return {f"lowshot-{row['setting']}": row["mean"] for row in report["results"]}


def compare(evals: dict[str, dict], warm: str) -> dict:
    """Each metric of the warm-started bundle beside the source's, and whether it is at least the source's."""
    rows, at_least = {}, True
    for prefix in PROTOCOLS:
        for command in ("lowshot", "knn"):
            tag = f"{prefix}-{command}"
            source, after = evals.get(f"source-{tag}"), evals.get(f"{warm}-{tag}")
            if source is None or after is None:
                continue
            source_metrics, warm_metrics = headline(source), headline(after)
            for metric, value in source_metrics.items():
                if metric in warm_metrics:
                    delta = warm_metrics[metric] - value
                    rows[f"{prefix}/{metric}"] = {"source": value, "warm": warm_metrics[metric], "delta": delta}
                    at_least = at_least and delta >= 0
    return {"metrics": rows, "warm_at_least_source": at_least and bool(rows)}


def collect(work: Path, config: Path, checkpoint: Path, minutes: float, seed: int, overrides: list[str]) -> dict:
    from training.checkpoint import file_sha256

    evals = read_evals(work)
    warm = warm_name(minutes)
    return {"machine": machine(), "source_checkpoint": str(checkpoint), "source_sha256": file_sha256(checkpoint),
            "config": str(config), "minutes": minutes, "seed": seed, "overrides": overrides,
            "run": run_record(work / "runs" / warm), "evals": evals, "comparison": compare(evals, warm)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training.warm_start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="the source run's checkpoint.pt")
    parser.add_argument("--minutes", type=float, default=10.0, help="budget of the warm-started run")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the recipe (the source's, for the same data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config overrides for the warm-started run, as pretrain.py takes them: "
                             "--set optim.warm_lr_scale=0.5 optim.warm_ema_start=0.996 (repeatable)")
    parser.add_argument("--workdir", type=Path, help="runs, bundles, evaluations (default: runs/warm_start/seed<S>)")
    parser.add_argument("--out", type=Path, default=OUT, help="the results file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes {args.minutes:g}: must be positive")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if not args.dry_run and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file (make demo trains runs/demo/checkpoint.pt)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = (args.workdir or REPO / "runs" / "warm_start" / f"seed{args.seed}").resolve()
    checkpoint, config = args.checkpoint.resolve(), args.config.resolve()
    steps = build_plan(work, config, checkpoint, args.minutes, args.seed, args.overrides)
    if args.dry_run:
        print_plan(steps)
        return 0
    run_steps(steps, work)
    result = save_json(args.out, collect(work, config, checkpoint, args.minutes, args.seed, args.overrides))
    verdict = "at least" if result["comparison"]["warm_at_least_source"] else "NOT at least"
    print(f"the warm-started bundle scores {verdict} the source's on every metric")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
