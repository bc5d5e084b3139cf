"""Low-shot and kNN accuracy against a wall-clock pretraining budget: one run per budget.

    python benchmarks/budget_curve.py --dry-run                 # print the plan, run nothing
    python benchmarks/budget_curve.py                           # 10, 30 and 60 min of the demo recipe (~2 h)
    python benchmarks/budget_curve.py --budgets 10 --seed 1     # another seed of one point

Each budget is its own pretraining run of ``configs/fmnist_vit_tiny.yaml`` with ``optim.budget_minutes`` set, so
every schedule (learning rate, weight decay, EMA) ends when its budget does: the points are what a user gets from
``--set optim.budget_minutes=B``, not checkpoints of one long run. Each run is exported and evaluated with
``msn-eval``: low-shot at 1, 2 and 5 labels per class and 1 % on the 3 shipped splits (the official protocol, fixed
lambda) and weighted kNN-20 against all 60,000 training images. Raw pixels and a random-init ViT of the same
architecture are the baselines. Runs are timed: give them the machine to themselves (the load average before and
after each run is recorded beside its throughput).

Steps whose outputs exist are skipped, so an interrupted curve continues (a pretraining run interrupted midway
starts again: its budget is wall-clock time). The result is ``docs/budget_curve.json`` and
``docs/budget_curve.png``, and ``docs/results.md`` is re-rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.paper_tables import (
    DOCS,
    SEED,
    Step,
    eval_step,
    export_random_init,
    print_plan,
    run_steps,
    set_args,
    subprocess_action,
)
from benchmarks.results_report import (
    BUDGET_JSON,
    BUDGET_PNG,
    SETTINGS,
    budget_bundle,
    machine,
    mean_accuracy,
    render,
)
from msn_core.durable import atomic_write, atomic_write_json

CONFIG = ROOT / "configs" / "fmnist_vit_tiny.yaml"  # the small-image recipe, as `make demo` trains it
BUDGET = "optim.budget_minutes"
SHOTS = ("1", "2", "5", "1percent")


def pretrain_step(work: Path, config: Path, minutes: float, seed: int) -> Step:
    run_dir = work / "runs" / budget_bundle(minutes)
    cmd = [sys.executable, "-m", "training.pretrain", "--config", str(config), "--output-dir", str(run_dir),
           *set_args({SEED: seed, BUDGET: minutes, "run.progress_bar": False})]

    def run() -> None:
        shutil.rmtree(run_dir, ignore_errors=True)  # a budget is wall-clock time: an interrupted run restarts
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, check=True)
        timing = {"wall_minutes": (time.monotonic() - start) / 60, "load_before": load_before,
                  "load_after": os.getloadavg()[0]}
        atomic_write_json(run_dir / "done.json", timing)

    return Step(f"pretrain {minutes:g} min", cmd, [run_dir / "done.json"], run)


def build_plan(work: Path, config: Path, budgets: list[float], seed: int) -> list[Step]:
    steps: list[Step] = []
    for minutes in budgets:
        name = budget_bundle(minutes)
        steps.append(pretrain_step(work, config, minutes, seed))
        export = [sys.executable, "-m", "training.bundle.export", "--checkpoint", str(work / "runs" / name / "checkpoint.pt"),
                  "--out", str(work / "bundles" / name)]
        steps.append(Step(f"export {name}", export, [work / "bundles" / name / "msn.json"],
                          subprocess_action(export)))
    first = budget_bundle(budgets[0])
    random_dir = work / "bundles" / "random_init"
    steps.append(Step("export random_init", [f"(python) export_bundle(VisionTransformer(**arch), seed {seed})"],
                      [random_dir / "msn.json"], lambda: export_random_init(work / "bundles" / first, random_dir, seed)))
    for bundle in [*map(budget_bundle, budgets), "random_init", "pixels"]:
        extra = ["--backend", "pixels"] if bundle == "pixels" else []
        steps.append(eval_step(work, bundle, "lowshot", ["--shots", *SHOTS, "--splits", "3", *extra],
                               pixels_source=first))
        steps.append(eval_step(work, bundle, "knn", extra, pixels_source=first))
    return steps


def run_record(run_dir: Path) -> dict:
    """Steps, measured throughput and wall time of one budget run, from its metrics and timing files."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["images_per_sec"] for r in records[1:]] or [records[-1]["images_per_sec"]]
    return {"steps": records[-1]["step"], "epochs": records[-1]["epoch"], "images_per_sec": statistics.median(rates),
            **json.loads((run_dir / "done.json").read_text())}


def collect(work: Path, config: Path, budgets: list[float], seed: int) -> dict:
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((work / "evals").glob("*.json"))}
    return {"machine": machine(), "config": str(config.relative_to(ROOT)), "seed": seed, "budgets": budgets,
            "runs": {budget_bundle(b): run_record(work / "runs" / budget_bundle(b)) for b in budgets},
            "evals": evals}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev, budgets = result["evals"], result["budgets"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (setting, label), colour in zip(SETTINGS[:3], ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(budgets, [mean_accuracy(ev, f"{budget_bundle(b)}-lowshot", setting) for b in budgets], "o-",
                color=colour, label=f"MSN, {label}")
        pixels = mean_accuracy(ev, "pixels-lowshot", setting)
        if pixels is not None:
            ax.axhline(pixels, color=colour, linestyle="--", linewidth=1, label=f"raw pixels, {label}")
    knn = [ev.get(f"{budget_bundle(b)}-knn", {}).get("results", [{}])[0].get("top1") for b in budgets]
    ax.plot(budgets, knn, "s-", color="tab:purple", label="MSN, kNN-20 (60k)")
    pixels_knn = ev.get("pixels-knn", {}).get("results", [{}])[0].get("top1")
    if pixels_knn is not None:
        ax.axhline(pixels_knn, color="tab:purple", linestyle="--", linewidth=1, label="raw pixels, kNN-20")
    ax.set_xlabel("pretraining budget (minutes of the training loop)")
    ax.set_ylabel("top-1 (%), low-shot: mean of 3 splits")
    ax.set_title(f"Fashion-MNIST, {result['config']}, one run per budget\n{result['machine']}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(png, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[10, 30, 60], help="minutes, one run each")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="runs, bundles, evaluations (default: runs/budget/seed<S>)")
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    budgets = sorted(set(args.budgets))
    work = (args.workdir or ROOT / "runs" / "budget" / f"seed{args.seed}").resolve()
    config, docs = args.config.resolve(), args.docs.resolve()
    steps = build_plan(work, config, budgets, args.seed)
    if args.dry_run:
        print_plan(steps)
        return 0
    run_steps(steps, work)
    result = collect(work, config, budgets, args.seed)
    atomic_write_json(docs / BUDGET_JSON, result)
    plot(result, docs / BUDGET_PNG)
    atomic_write(docs / "results.md", render(docs).encode())
    print(f"wrote {docs / BUDGET_JSON}, {docs / BUDGET_PNG} and {docs / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
