"""Low-shot accuracy against pretraining budget: one long MSN run, evaluated after each epoch.

    python benchmarks/budget_curve.py --dry-run            # print the plan, run nothing
    python benchmarks/budget_curve.py                      # 10 epochs of the demo config (~80 min on 2 cores)
    python benchmarks/budget_curve.py --epochs 40 --nproc 8   # a longer schedule on 8 GPUs

The CPU profile of ``paper_tables.py`` stops every run after 300 steps, where MSN is still below raw pixels on
Fashion-MNIST. This script answers whether the gap is a matter of budget. It trains ``configs/fmnist_vit_tiny.yaml``
for ``--epochs`` epochs (one cosine schedule, ``run.keep_epoch_checkpoints=1``), exports the target encoder after
each evaluated epoch and runs ``msn-eval lowshot`` (1/2/5 per class and 1 %, 3 splits) and ``msn-eval knn`` on it.
Raw pixels and a random-init ViT are evaluated once as baselines. The points are checkpoints of one schedule, not
separate runs per budget: at an early epoch the learning rate is still high and the EMA target is far from frozen.

Steps whose outputs exist are skipped, so an interrupted run continues. The result is ``docs/budget_curve.json``
and ``docs/budget_curve.png``, and ``docs/results.md`` is re-rendered with the curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.paper_tables import (
    CONFIG,
    DOCS,
    EPOCHS,
    SEED,
    SHOTS,
    Step,
    eval_step,
    export_random_init,
    pretrain_action,
    print_plan,
    run_steps,
    set_args,
    subprocess_action,
    torchrun_command,
)
from benchmarks.results_report import (
    BUDGET_JSON,
    BUDGET_PNG,
    KNN_TRAIN,
    SETTINGS,
    budget_bundle,
    machine,
    mean_accuracy,
    render,
)
from training.checkpoint import atomic_write_bytes, atomic_write_json

KEEP_EPOCHS = "run.keep_epoch_checkpoints"


def evaluated_bundles(eval_epochs: list[int]) -> list[str]:
    """The bundles the curve evaluates: one per evaluated epoch, then the two baselines."""
    return [*map(budget_bundle, eval_epochs), "random_init", "pixels"]


def build_plan(work: Path, epochs: int, eval_epochs: list[int], nproc: int, seed: int) -> list[Step]:
    run_dir = work / "run"
    cmd = [*torchrun_command(nproc), "training/pretrain.py", "--config", str(CONFIG.relative_to(ROOT)),
           "--output-dir", str(run_dir), "--resume", *set_args({SEED: seed, EPOCHS: epochs, KEEP_EPOCHS: 1})]
    steps = [Step(f"pretrain {epochs} epochs", cmd, [run_dir / "done"], pretrain_action(cmd, run_dir))]
    for epoch in eval_epochs:
        name = budget_bundle(epoch)
        export = [sys.executable, "-m", "training.export", "--checkpoint", str(run_dir / f"checkpoint-{name}.pt"),
                  "--out", str(work / "bundles" / name)]
        steps.append(Step(f"export epoch {epoch}", export, [work / "bundles" / name / "msn.json"],
                          subprocess_action(export)))
    first = budget_bundle(eval_epochs[0])
    random_dir = work / "bundles" / "random_init"
    steps.append(Step("export random_init", [f"(python) export_bundle(VisionTransformer(**arch), seed {seed})"],
                      [random_dir / "msn.json"],
                      lambda: export_random_init(work / "bundles" / first, random_dir, seed)))
    lowshot, knn = ["--shots", *SHOTS, "--splits", "3"], ["--max-train", str(KNN_TRAIN)]
    for bundle in evaluated_bundles(eval_epochs):
        extra = ["--backend", "pixels"] if bundle == "pixels" else []
        steps.append(eval_step(work, bundle, "lowshot", [*lowshot, *extra], pixels_source=first))
        steps.append(eval_step(work, bundle, "knn", [*knn, *extra], pixels_source=first))
    return steps


def step_seconds(run_dir: Path) -> float:
    """Time spent in optimiser steps, summed from the monitor's throughput records.

    Unlike the step's wall time this stays right when the run was resumed or started outside this script."""
    from training.checkpoint import load_checkpoint

    state = load_checkpoint(run_dir / "checkpoint.pt")
    global_batch = state["config"]["data"]["batch_size"] * state["world_size"]
    seconds, last_step = 0.0, 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "images_per_sec" in record:
            seconds += max(record["step"] - last_step, 0) * global_batch / record["images_per_sec"]
            last_step = record["step"]
    return seconds


def collect(work: Path, epochs: int, eval_epochs: list[int], seconds: dict[str, float]) -> dict:
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((work / "evals").glob("*.json"))}
    keep = {f"{b}-{c}" for b in evaluated_bundles(eval_epochs) for c in ("lowshot", "knn")}
    return {"machine": machine(), "config": str(CONFIG.relative_to(ROOT)), "epochs": epochs,
            "eval_epochs": eval_epochs, "pretrain_step_seconds": step_seconds(work / "run"),
            "eval_seconds": sum(v for k, v in seconds.items() if not k.startswith("pretrain")),
            "evals": {k: v for k, v in evals.items() if k in keep}}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev, epochs = result["evals"], result["eval_epochs"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (setting, label), colour in zip(SETTINGS[:3], ("tab:blue", "tab:orange", "tab:green")):
        msn = [mean_accuracy(ev, f"{budget_bundle(e)}-lowshot", setting) for e in epochs]
        ax.plot(epochs, msn, "o-", color=colour, label=f"MSN, {label}")
        pixels = mean_accuracy(ev, "pixels-lowshot", setting)
        if pixels is not None:
            ax.axhline(pixels, color=colour, linestyle="--", linewidth=1, label=f"raw pixels, {label}")
    ax.set_xlabel("pretraining epochs (checkpoints of one schedule)")
    ax.set_ylabel("low-shot top-1 (%), mean of 3 splits")
    ax.set_title(f"Fashion-MNIST, {result['config']}, {result['epochs']}-epoch schedule\n{result['machine']}",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(png, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="length of the one pretraining schedule")
    parser.add_argument("--eval-epochs", type=int, nargs="+", help="epochs to evaluate (default: 1, 2, 4, ... last)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=1, help="processes per pretraining run (torchrun)")
    parser.add_argument("--workdir", type=Path, help="run, bundles, evaluations (default: runs/budget/<E>ep-seed<S>)")
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    eval_epochs = sorted(set(args.eval_epochs or [1, *range(2, args.epochs + 1, 2), args.epochs]))
    if not 1 <= eval_epochs[0] <= eval_epochs[-1] <= args.epochs:
        parser.error(f"--eval-epochs must lie in 1..{args.epochs}")
    work = (args.workdir or ROOT / "runs" / "budget" / f"{args.epochs}ep-seed{args.seed}").resolve()
    docs = args.docs.resolve()
    steps = build_plan(work, args.epochs, eval_epochs, args.nproc, args.seed)
    if args.dry_run:
        print_plan(steps)
        return 0
    timings = run_steps(steps, work)
    result = collect(work, args.epochs, eval_epochs, timings)
    atomic_write_json(docs / BUDGET_JSON, result)
    plot(result, docs / BUDGET_PNG)
    atomic_write_bytes(docs / "results.md", lambda f: f.write(render(docs).encode()))
    print(f"wrote {docs / BUDGET_JSON}, {docs / BUDGET_PNG} and {docs / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
