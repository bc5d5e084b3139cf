"""Low-shot and kNN accuracy against a wall-clock pretraining budget: one run per budget.

    python -m benchmarks.training.budget_curve --dry-run               # print the plan, run nothing
    python -m benchmarks.training.budget_curve                         # 10, 30 and 60 min of the demo recipe (~2 h)
    python -m benchmarks.training.budget_curve --budgets 10 --seed 1   # another seed of one point
    python -m benchmarks.training.budget_curve --budgets 60 --merge    # one more budget added to the existing curve

Each budget is its own pretraining run of ``configs/fmnist_vit_tiny.yaml`` with ``optim.budget_minutes`` set, so
every schedule (learning rate, weight decay, EMA) ends when its budget does: the points are what a user gets from
``--set optim.budget_minutes=B``, not checkpoints of one long run. Each run is exported and evaluated with
``msn-eval``: low-shot at 1, 2 and 5 labels per class and 1 % on the 3 shipped splits (the official protocol, fixed
lambda) and weighted kNN-20 against all 60,000 training images. Raw pixels and a random-init ViT of the same
architecture are the baselines. Runs are timed: give them the machine to themselves (the load average before and
after each run is recorded beside its throughput).

Steps whose outputs exist are skipped, so an interrupted curve continues (a pretraining run interrupted midway
starts again: its budget is wall-clock time). The result is ``docs/budget_curve.json``;
``python -m benchmarks.render --plots`` draws ``docs/budget_curve.png`` and its section of ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import DOCS, REPO, machine
from benchmarks.protocol import BUDGET_JSON, budget_bundle
from benchmarks.training.steps import (
    PAPER_CLS,
    Step,
    eval_step,
    export_random_init,
    export_step,
    pretrain_step,
    print_plan,
    run_record,
    run_steps,
    set_args,
)
from msn_core.durable import atomic_write_json

CONFIG = REPO / "configs" / "fmnist_vit_tiny.yaml"  # the small-image recipe, as `make demo` trains it
BUDGET, SEED = "optim.budget_minutes", "run.seed"  # pretraining config keys (training/config.py)
SHOTS = ("1", "2", "5", "1percent")


def budget_run(work: Path, config: Path, minutes: float, seed: int) -> Step:
    run_dir = work / "runs" / budget_bundle(minutes)
    cmd = [sys.executable, "-m", "training.pretrain", "--config", str(config), "--output-dir", str(run_dir),
           *set_args({SEED: seed, BUDGET: minutes, "run.progress_bar": False})]
    return pretrain_step(f"pretrain {minutes:g} min", cmd, run_dir)


def build_plan(work: Path, config: Path, budgets: list[float], seed: int) -> list[Step]:
    steps: list[Step] = []
    for minutes in budgets:
        name = budget_bundle(minutes)
        steps.append(budget_run(work, config, minutes, seed))
        steps.append(export_step(work, work / "runs" / name / "checkpoint.pt", name))
    first = budget_bundle(budgets[0])
    random_dir = work / "bundles" / "random_init"
    steps.append(Step("export random_init", [f"(python) export_bundle(VisionTransformer(**arch), seed {seed})"],
                      [random_dir / "msn.json"],
                      lambda: export_random_init(work / "bundles" / first, random_dir, seed)))
    for bundle in [*map(budget_bundle, budgets), "random_init", "pixels"]:
        extra = ["--backend", "pixels"] if bundle == "pixels" else []
        steps.append(eval_step(work, bundle, "lowshot", ["--shots", *SHOTS, "--splits", "3", *extra],
                               pixels_source=first))
        steps.append(eval_step(work, bundle, "knn", extra, pixels_source=first))
    for bundle in map(budget_bundle, budgets):  # the paper's protocol beside the served feature (msn.json's)
        steps.append(eval_step(work, bundle, "lowshot", ["--shots", *SHOTS, "--splits", "3", *PAPER_CLS],
                               tag="cls-lowshot"))
        steps.append(eval_step(work, bundle, "knn", PAPER_CLS, tag="cls-knn"))
    return steps


def collect(work: Path, config: Path, budgets: list[float], seed: int) -> dict:
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((work / "evals").glob("*.json"))}
    return {"machine": machine(), "config": str(config.relative_to(REPO)), "seed": seed, "budgets": budgets,
            "runs": {budget_bundle(b): run_record(work / "runs" / budget_bundle(b)) for b in budgets},
            "evals": evals}


def merge(old: dict, new: dict) -> dict:
    """``new``'s budgets added to ``old``'s curve; the baselines (pixels, random init) are ``new``'s measurements.

    Refused unless both ran the same config and seed on the same CPU model: a curve mixes no machines."""
    for key, value in (("config", new["config"]), ("seed", new["seed"])):
        if old.get(key) != value:
            raise SystemExit(f"--merge: the existing curve has {key} {old.get(key)!r}, this run {value!r}")
    if old["machine"].get("cpu") != new["machine"].get("cpu"):
        raise SystemExit(f"--merge: the existing curve was measured on {old['machine'].get('cpu')!r}, this run on "
                         f"{new['machine'].get('cpu')!r}")
    budgets = sorted(set(old["budgets"]) | set(new["budgets"]))
    return {**old, "budgets": budgets, "runs": {**old["runs"], **new["runs"]},
            "evals": {**old["evals"], **new["evals"]}, "merged": [*old.get("merged", []), new["machine"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[10, 30, 60], help="minutes, one run each")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="runs, bundles, evaluations (default: runs/budget/seed<S>)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where budget_curve.json goes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--merge", action="store_true",
                        help="add these budgets to the existing budget_curve.json (same config, seed and CPU model) "
                             "instead of replacing it: a long budget can be run on its own, later")
    args = parser.parse_args(argv)
    budgets = sorted(set(args.budgets))
    work = (args.workdir or REPO / "runs" / "budget" / f"seed{args.seed}").resolve()
    config, docs = args.config.resolve(), args.docs.resolve()
    steps = build_plan(work, config, budgets, args.seed)
    if args.dry_run:
        print_plan(steps)
        return 0
    run_steps(steps, work)
    result = collect(work, config, budgets, args.seed)
    if args.merge and (docs / BUDGET_JSON).is_file():
        result = merge(json.loads((docs / BUDGET_JSON).read_text()), result)
    atomic_write_json(docs / BUDGET_JSON, result)
    print(f"wrote {docs / BUDGET_JSON}; docs and plot: python -m benchmarks.render --plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
