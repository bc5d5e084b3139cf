"""The MSN paper's experiments on Fashion-MNIST, measured into ``docs/results/<profile>.json``, and a t-SNE plot.

    python -m benchmarks.evaluation.paper_tables --dry-run       # print the plan, run nothing
    python -m benchmarks.evaluation.paper_tables                 # CPU schedule (< 1 h on 2 cores)
    python -m benchmarks.evaluation.paper_tables --profile gpu   # longer schedule; both profiles end up in the doc

Every ablation is a pretraining run of ``benchmarks/training/configs/recipe_search_base.yaml`` (the demo config these tables
were measured with, before the recipe search changed the demo) with the same budget and seed, changed only
by the ``--set`` overrides below; each run is exported with ``msn-export`` and evaluated with ``msn-eval``. Steps whose
outputs exist are skipped (``--force`` redoes them), pretraining is always resumable, and every evaluation is kept as
JSON, so an interrupted run continues where it stopped. Results of a profile are stored in
``docs/results/<profile>.json``; ``python -m benchmarks.render`` renders ``docs/results.md`` from all stored
profiles (a hand-written discussion in ``docs/results-notes.md`` is included verbatim when present).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import DOCS, REPO, cached_features, machine
from benchmarks.protocol import ABLATION_RATIOS, KNN_TRAIN, ROBUSTNESS_RATIOS, ratio_run, tsne_name
from benchmarks.training.recipe_trials import BASE_CONFIG
from benchmarks.training.steps import (
    Step,
    eval_step,
    export_random_init,
    export_step,
    print_plan,
    run_steps,
    set_args,
    subprocess_action,
)
from msn_core.durable import atomic_write_json

CONFIG = REPO / BASE_CONFIG  # patch 4 + focal views: the ablations need both

# Pretraining config keys this script sets: owned by training/config.py, named only here.
RATIO, FOCAL, SHARE_VIEW, SEED, MAX_STEPS, EPOCHS = (
    "mask.ratio", "mask.num_focal", "mask.share_target_view", "run.seed", "run.max_steps", "optim.epochs")

PROFILES: dict[str, dict] = {
    "cpu": {SEED: 0, MAX_STEPS: 300},  # 8 runs x ~5 min on 2 cores, evaluations included: < 1 h
    "gpu": {SEED: 0, EPOCHS: 20},
}
SHOTS = ("1", "2", "5", "1percent")
TSNE_POINTS = 2000


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    overrides: dict = field(default_factory=dict)


def pretraining_runs(default_ratio: float) -> dict[str, Run]:
    """Every pretraining run the tables need; the default-ratio ablation row reuses ``msn``."""
    runs = [
        Run("msn", "MSN (random + focal masking)"),
        Run("focal_only", "no-mask baseline: anchor unmasked, focal views (DINO-like)", {RATIO: 0.0}),
        Run("no_mask", "no masking (no random mask, no focal views)", {RATIO: 0.0, FOCAL: 0}),
        Run("random_only", "random masking only (no focal views)", {FOCAL: 0}),
        Run("shared_view", "anchor = masked copy of the target view", {SHARE_VIEW: True}),
    ]
    runs += [Run(ratio_run(r, default_ratio), f"mask ratio {r}", {RATIO: r}) for r in ABLATION_RATIOS
             if r != default_ratio]
    return {run.name: run for run in runs}


# ----------------------------------------------------------------------------------------------------- plan


def torchrun_command(nproc: int) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--standalone", f"--nproc_per_node={nproc}"]


def build_plan(work: Path, profile: str, nproc: int, docs: Path = DOCS) -> list[Step]:
    from training.config import load_config

    default_ratio = load_config(CONFIG).mask.ratio
    runs = pretraining_runs(default_ratio)
    steps: list[Step] = []
    for run in runs.values():
        out = work / "runs" / run.name
        cmd = [*torchrun_command(nproc), "training/pretrain.py", "--config", str(CONFIG.relative_to(REPO)),
               "--output-dir", str(out), "--resume", *set_args({**PROFILES[profile], **run.overrides})]
        steps.append(Step(f"pretrain {run.name}", cmd, [out / "done"], pretrain_action(cmd, out)))
        steps.append(export_step(work, out / "checkpoint.pt", run.name))
    random_dir = work / "bundles" / "random_init"
    seed = PROFILES[profile][SEED]
    steps.append(Step("export random_init", [f"(python) export_bundle(VisionTransformer(**msn arch), seed {seed})"],
                      [random_dir / "msn.json"],
                      lambda: export_random_init(work / "bundles" / "msn", random_dir, seed)))

    lowshot = ["--shots", *SHOTS, "--splits", "3"]
    for bundle in [*runs, "random_init"]:
        steps.append(eval_step(work, bundle, "lowshot", lowshot))
    steps.append(eval_step(work, "pixels", "lowshot", [*lowshot, "--backend", "pixels"]))
    steps.append(eval_step(work, "msn", "lowshot", [*lowshot, "--solver", "sklearn"], tag="lowshot-sklearn"))
    steps.append(eval_step(work, "msn", "lowshot", [*lowshot, "--tol", "1e-6", "--max-iter", "3000"],
                            tag="lowshot-cyanure-tight"))
    for bundle in ("msn", "random_init", "focal_only", "shared_view", "pixels"):
        extra = ["--backend", "pixels"] if bundle == "pixels" else []
        steps.append(eval_step(work, bundle, "knn", ["--max-train", str(KNN_TRAIN), *extra]))
    for bundle in ("msn", "focal_only"):
        steps.append(eval_step(work, bundle, "robustness", ["--ratios", *map(str, ROBUSTNESS_RATIOS),
                                                             "--shots", "1", "2", "5", "--splits", "3"]))
    png = docs / tsne_name(profile)
    # Its own interpreter: once, after all the evaluations in this process, scipy's sparse code crashed in TSNE.
    tsne = [sys.executable, "-m", "benchmarks.evaluation.paper_tables", "--plot-tsne", str(png), "--workdir", str(work)]
    steps.append(Step("t-SNE plot", tsne, [png], subprocess_action(tsne)))
    return steps


def pretrain_action(cmd: list[str], out: Path) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(cmd, cwd=REPO, check=True)
        (out / "done").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))

    return run


def plot_tsne(work: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from sklearn.manifold import TSNE

    from training.data import FashionMNIST

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, name in zip(axes, ("msn", "random_init")):
        bundle = work / "bundles" / name
        feats = cached_features(bundle, "test", cache_dir=work / "feature-cache", indices=np.arange(TSNE_POINTS))
        # Duplicate images give duplicate rows, which break sklearn's neighbour search: keep one of each.
        _, unique = np.unique(feats.features, axis=0, return_index=True)
        unique = np.sort(unique)
        xy = TSNE(n_components=2, init="pca", perplexity=30, random_state=0).fit_transform(feats.features[unique])
        scatter = ax.scatter(xy[:, 0], xy[:, 1], c=feats.labels[unique], cmap="tab10", s=4)
        ax.set_title(f"{name}: t-SNE of {TSNE_POINTS} test features")
        ax.set_xticks([]), ax.set_yticks([])
    fig.legend(scatter.legend_elements()[0], FashionMNIST.classes, loc="lower center", ncol=10, fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")


def collect(work: Path, profile: str, seconds: float) -> dict:
    from training.config import load_config

    default_ratio = load_config(CONFIG).mask.ratio
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((work / "evals").glob("*.json"))}
    runs = {n: {"label": r.label, "overrides": r.overrides} for n, r in pretraining_runs(default_ratio).items()}
    from training.evaluation.lowshot import DEFAULT_LAMBD

    return {"profile": profile, "machine": machine(), "seconds": seconds, "overrides": PROFILES[profile],
            "default_ratio": default_ratio, "lambd": DEFAULT_LAMBD, "runs": runs, "evals": evals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--workdir", type=Path, help="runs, bundles, caches (default: runs/paper_tables/<profile>)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per pretraining run (torchrun)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--force", action="store_true", help="redo steps whose outputs exist")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where results/<profile>.json and the t-SNE plot go")
    parser.add_argument("--plot-tsne", type=Path, metavar="PNG", help=argparse.SUPPRESS)  # the plan's t-SNE step
    args = parser.parse_args(argv)
    docs = args.docs.resolve()
    work = (args.workdir or REPO / "runs" / "paper_tables" / args.profile).resolve()
    if args.plot_tsne:
        plot_tsne(work, args.plot_tsne)
        return 0
    steps = build_plan(work, args.profile, args.nproc, docs)
    if args.dry_run:
        print_plan(steps, args.force)
        print(f"then: {docs / 'results' / (args.profile + '.json')}; docs: python -m benchmarks.render")
        return 0
    timings = run_steps(steps, work, args.force)
    result = collect(work, args.profile, sum(timings.values()))
    atomic_write_json(docs / "results" / f"{args.profile}.json", result)
    print(f"wrote {docs / 'results' / (args.profile + '.json')}; all steps took {result['seconds'] / 60:.1f} min; "
          "docs: python -m benchmarks.render")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
