"""The MSN paper's experiments on Fashion-MNIST, measured into ``docs/results/<profile>.json``, and a t-SNE plot.

    python -m benchmarks.evaluation.paper_tables --dry-run       # print the plan, run nothing
    python -m benchmarks.evaluation.paper_tables                 # the shipped recipe, 10 min a run (100 min on 2 cores)
    python -m benchmarks.evaluation.paper_tables --profile cpu   # the pre-search config, 300 steps a run (< 1 h)
    python -m benchmarks.evaluation.paper_tables --profile gpu   # the pre-search config, 20 epochs a run

Every ablation is a pretraining run of its profile's config with the same length and seed, changed only by the
``--set`` overrides below; each run is exported with ``msn-export`` and evaluated with ``msn-eval`` on the bundle's
served feature (the ``demo`` profile's runs on the paper's CLS too). The ``demo`` profile is what ``make demo``
ships: ``configs/fmnist_vit_tiny.yaml`` and its 10-minute budget. That recipe has no focal views, so its ``msn`` run
is the random-masking row of the masking-strategy table and the focal rows add 4 focal views of 2 x 2 patches (the
paper's 96 / 224 of the side, rounded to whole patches). Every run gets the same wall-clock budget, not the same
number of steps: focal views make a step dearer, and each run's steps are recorded. A budgeted run interrupted
midway starts again (its budget is wall-clock time); the step-sized profiles resume. Steps whose outputs exist are
skipped (``--force`` redoes them) and every evaluation is kept as JSON, so an interrupted plan continues where it
stopped. Results of a profile are stored in ``docs/results/<profile>.json``; ``python -m benchmarks.render`` renders
``docs/results.md`` from all stored profiles (the hand-written discussion in ``docs/results-notes.md`` is included
verbatim).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import DOCS, REPO, cached_features, machine
from benchmarks.protocol import ABLATION_RATIOS, KNN_TRAIN, ROBUSTNESS_RATIOS, ratio_run, tsne_name
from benchmarks.training.recipe_trials import BASE_CONFIG
from benchmarks.training.steps import (
    PAPER_CLS,
    Step,
    eval_step,
    export_random_init,
    export_step,
    pretrain_step,
    print_plan,
    read_evals,
    run_record,
    run_steps,
    set_args,
    subprocess_action,
)
from msn_core.durable import atomic_write_json

# Pretraining config keys this script sets: owned by training/config.py, named only here.
RATIO, FOCAL, FOCAL_SIZE, SHARE_VIEW, SEED, MAX_STEPS, EPOCHS, PROGRESS = (
    "mask.ratio", "mask.num_focal", "mask.focal_size", "mask.share_target_view", "run.seed", "run.max_steps",
    "optim.epochs", "run.progress_bar")


@dataclass(frozen=True)
class Profile:
    config: str  # relative to the repository
    overrides: dict  # every run of the profile
    budgeted: bool = False  # runs end on the config's wall-clock budget (restart when interrupted), not on steps
    focal_views: dict | None = None  # what the focal-masking runs add, for a config without focal views


PROFILES: dict[str, Profile] = {
    "demo": Profile("configs/fmnist_vit_tiny.yaml", {SEED: 0, PROGRESS: False}, budgeted=True,
                    focal_views={FOCAL: 4, FOCAL_SIZE: 14}),  # 28 px / 4 patches a side: 2 x 2 patches
    "cpu": Profile(BASE_CONFIG, {SEED: 0, MAX_STEPS: 300}),  # 8 runs x ~5 min on 2 cores, evaluations included
    "gpu": Profile(BASE_CONFIG, {SEED: 0, EPOCHS: 20}),  # patch 4 + focal views: the ablations need both
}
SHOTS = ("1", "2", "5", "1percent")
TSNE_POINTS = 2000


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    overrides: dict = field(default_factory=dict)


def pretraining_runs(default_ratio: float, focal_views: dict | None = None) -> dict[str, Run]:
    """Every pretraining run the tables need; the default-ratio ablation row reuses ``msn``.

    ``focal_views``: the config has none, so ``msn`` is the random-only row and ``msn_focal`` adds these."""
    if focal_views is None:
        runs = [Run("msn", "MSN (random + focal masking)"),
                Run("focal_only", "no-mask baseline: anchor unmasked, focal views (DINO-like)", {RATIO: 0.0}),
                Run("no_mask", "no masking (no random mask, no focal views)", {RATIO: 0.0, FOCAL: 0}),
                Run("random_only", "random masking only (no focal views)", {FOCAL: 0})]
    else:
        views = f"{focal_views[FOCAL]} focal views"
        runs = [Run("msn", f"MSN as shipped (random masking {default_ratio:g}, no focal views)"),
                Run("msn_focal", f"random + focal masking ({views})", focal_views),
                Run("focal_only", f"no-mask baseline: anchor unmasked, {views} (DINO-like)",
                    {RATIO: 0.0, **focal_views}),
                Run("no_mask", "no masking (no random mask, no focal views)", {RATIO: 0.0})]
    runs.append(Run("shared_view", "anchor = masked copy of the target view", {SHARE_VIEW: True}))
    runs += [Run(ratio_run(r, default_ratio), f"mask ratio {r}", {RATIO: r}) for r in ABLATION_RATIOS
             if r != default_ratio]
    return {run.name: run for run in runs}


def strategy_runs(focal_views: dict | None) -> dict[str, str]:
    """The masking-strategy table's rows (none, focal, random, random + focal) -> the run that measures each."""
    random_only, both = ("random_only", "msn") if focal_views is None else ("msn", "msn_focal")
    return {"none": "no_mask", "focal only": "focal_only", "random only": random_only, "random + focal": both}


# ----------------------------------------------------------------------------------------------------- plan


def torchrun_command(nproc: int) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--standalone", f"--nproc_per_node={nproc}"]


def profile_runs(spec: Profile):
    """The profile's resolved config and its pretraining runs (the plan and the collected result both need them)."""
    from training.config import load_config

    config = load_config(REPO / spec.config)
    return config, pretraining_runs(config.mask.ratio, spec.focal_views)


def build_plan(work: Path, profile: str, nproc: int, docs: Path = DOCS) -> list[Step]:
    spec = PROFILES[profile]
    _, runs = profile_runs(spec)
    steps: list[Step] = []
    for run in runs.values():
        out = work / "runs" / run.name
        cmd = [*torchrun_command(nproc), "training/pretrain.py", "--config", spec.config, "--output-dir", str(out),
               *([] if spec.budgeted else ["--resume"]), *set_args({**spec.overrides, **run.overrides})]
        steps.append(pretrain_step(f"pretrain {run.name}", cmd, out, fresh=spec.budgeted))
        steps.append(export_step(work, out / "checkpoint.pt", run.name))
    random_dir = work / "bundles" / "random_init"
    seed = spec.overrides[SEED]
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
    for bundle in [*runs, "random_init", "pixels"]:
        extra = ["--backend", "pixels"] if bundle == "pixels" else []
        steps.append(eval_step(work, bundle, "knn", ["--max-train", str(KNN_TRAIN), *extra]))
    if spec.budgeted:  # the paper's feature too: the served one adds the patch-token map to the CLS
        for bundle in runs:
            steps.append(eval_step(work, bundle, "lowshot", [*lowshot, *PAPER_CLS], tag="cls-lowshot"))
            steps.append(eval_step(work, bundle, "knn", ["--max-train", str(KNN_TRAIN), *PAPER_CLS], tag="cls-knn"))
    for bundle in ("msn", "focal_only"):
        steps.append(eval_step(work, bundle, "robustness", ["--ratios", *map(str, ROBUSTNESS_RATIOS),
                                                             "--shots", "1", "2", "5", "--splits", "3"]))
    png = docs / tsne_name(profile)
    # Its own interpreter: once, after all the evaluations in this process, scipy's sparse code crashed in TSNE.
    tsne = [sys.executable, "-m", "benchmarks.evaluation.paper_tables", "--plot-tsne", str(png), "--workdir", str(work)]
    steps.append(Step("t-SNE plot", tsne, [png], subprocess_action(tsne)))
    return steps


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
    from training.evaluation.lowshot import DEFAULT_LAMBD

    spec = PROFILES[profile]
    config, planned = profile_runs(spec)
    runs = {n: {"label": r.label, "overrides": r.overrides, **run_record(work / "runs" / n)}
            for n, r in planned.items()}
    return {"profile": profile, "machine": machine(), "seconds": seconds, "config": spec.config,
            "overrides": spec.overrides, "budgeted": spec.budgeted, "default_ratio": config.mask.ratio,
            "patches": (config.model.image_size // config.model.patch_size) ** 2,
            "lambd": DEFAULT_LAMBD, "runs": runs, "strategy": strategy_runs(spec.focal_views),
            "evals": read_evals(work)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="demo")
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
