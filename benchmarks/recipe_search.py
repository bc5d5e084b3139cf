"""The small-image recipe search: each trial is a config + a budget, pretrained, exported and evaluated.

    python benchmarks/recipe_search.py --list                      # the recorded trials, and which have run
    python benchmarks/recipe_search.py --stage focal --cpus 0      # run one stage's trials, pinned to core 0
    python benchmarks/recipe_search.py --trial my-idea --budget 5 --set mask.num_focal=2   # an ad-hoc trial
    python benchmarks/recipe_search.py --render                    # docs/recipe_search.md from the JSON

A trial runs ``training/pretrain.py`` with ``optim.budget_minutes`` (the schedules end when the budget does), or
with a fixed ``optim.total_steps`` when the trial names one, then ``msn-export`` and ``msn-eval``: low-shot at 1, 2 and 5 labels per class on the 3 shipped splits (the official
protocol, fixed lambda) and weighted kNN-20 against the whole training set. Results are appended to
``benchmarks/results/recipe_search.json`` as each trial finishes; a trial already there is not run again, so an
interrupted search continues. Wall time, images/s and the machine are recorded with every row: a budget means
little without the throughput it bought. ``--cpus``/``--threads`` pin a trial, so two can run side by side on
separate cores (each then has half the machine: compare trials run with the same pinning only).

Screening trials use fixed step counts rather than wall-clock budgets: on a machine whose other core is busy, a
budget buys a varying number of steps (up to a third more or less, measured), which would swamp the differences
being screened. Trials that change the cost of a step get the step count that costs the same time, from the
throughput ratio measured back to back (noted with the trial).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_report import machine
from msn_core.durable import atomic_write, atomic_write_json

RESULTS = ROOT / "benchmarks" / "results" / "recipe_search.json"
DOC = ROOT / "docs" / "recipe_search.md"
WORK = ROOT / "runs" / "recipe-search"
BASE_CONFIG = "benchmarks/configs/recipe_search_base.yaml"  # the demo config before the search
# msn-eval --backend pixels (normalised pixels), the same protocol: low-shot, kNN-20 against 60k and 20k images
PIXELS = {"ls1": 49.06, "ls2": 55.89, "ls5": 64.88, "knn": 85.69, "knn20k": 83.33}


@dataclass(frozen=True)
class Trial:
    name: str
    stage: str
    overrides: tuple[str, ...] = ()
    budget: float | None = 10.0  # minutes of the training loop; None: the overrides fix optim.total_steps
    config: str = BASE_CONFIG
    knn_train: int = 20_000  # screening: kNN against the first 20k training images (0: all 60k)
    note: str = ""


def _stage(stage: str, common: tuple[str, ...], trials: dict[str, tuple[str, ...]], **kwargs) -> list[Trial]:
    return [Trial(name, stage, (*common, *extra), **kwargs) for name, extra in trials.items()]


# The recorded search, stage by stage; each stage starts from what the previous ones found. Screening budgets are
# 10 minutes on ONE core (--cpus 0 --threads 1), about 5 minutes of the 2-core machine; the conclusions are in
# docs/results-notes.md.
DEMO = ("optim.horizon_scale=1.0", "data.num_workers=0")  # the demo config, with schedules that end in the budget
P7 = ("model.patch_size=7", "mask.num_focal=0")
SEARCH: list[Trial] = [
    # What a step costs: patch size (49 vs 16 tokens at 28 px) and focal views (44 % of the demo's FLOPs).
    *_stage("cost", DEMO, {
        "demo": (),
        "p4-nofocal": ("mask.num_focal=0",),
        "p7-nofocal": ("model.patch_size=7", "mask.num_focal=0"),
        "p7-focal2x14": ("model.patch_size=7", "mask.num_focal=2", "mask.focal_size=14",
                         "mask.focal_crop_scale=[0.2,0.5]"),
    }),
    # From here on the reference is p7-nofocal: three times the images of the demo in the same time, and
    # better on every metric. Augmentations next: the official blur (sigma up to 2 px) is sized for 224 px views.
    # (These budget trials bought 1,361-2,176 steps as the other core's load changed: see the note at the top.)
    *_stage("augment (budget)", (*DEMO, *P7), {
        "blur-sized": ("augment.blur_sigma=[0.1,0.5]",),
        "noblur": ("augment.blur_p=0",),
        "crop-0.2": ("mask.rand_crop_scale=[0.2,1.0]",),
        "crop-0.5": ("mask.rand_crop_scale=[0.5,1.0]",),
    }),
    # Fixed step counts from here on. 1,500 steps of the reference take ~8 min on one core.
    *_stage("reference", (*DEMO, *P7), {
        "ref": ("optim.total_steps=1500",),
        "ref-seed1": ("optim.total_steps=1500", "run.seed=1"),
    }, budget=None),
    *_stage("augment", (*DEMO, *P7), {
        "crop-0.5-steps": ("optim.total_steps=1500", "mask.rand_crop_scale=[0.5,1.0]"),
        "jitter-1.0": ("optim.total_steps=1500", "augment.color_jitter_strength=1.0"),
        "solarize-0.2": ("optim.total_steps=1500", "augment.solarize_p=0.2"),
    }, budget=None),
    # Dropping more patches makes the anchor cheaper: equal-time step counts.
    *_stage("mask ratio", (*DEMO, *P7), {
        "ratio-0.15": ("optim.total_steps=1360", "mask.ratio=0.15"),
        "ratio-0.5": ("optim.total_steps=1620", "mask.ratio=0.5"),
        "ratio-0.7": ("optim.total_steps=1775", "mask.ratio=0.7"),
    }, budget=None),
    # me-max and Sinkhorn spread a batch of B over K prototypes: with B = 64 < K = 1024 no target or prediction
    # can be sharper than ~B / K. The official K = 1024 comes with a global batch of 1024.
    *_stage("prototypes and batch", (*DEMO, *P7), {
        "protos-64": ("optim.total_steps=1500", "model.num_prototypes=64"),
        "protos-256": ("optim.total_steps=1500", "model.num_prototypes=256"),
        "batch-256": ("optim.total_steps=375", "data.batch_size=256"),
        "batch-256-lr2e-3": ("optim.total_steps=375", "data.batch_size=256", "optim.lr=2e-3"),
    }, budget=None),
    *_stage("optimiser", (*DEMO, *P7), {
        "lr-5e-4": ("optim.total_steps=1500", "optim.lr=5e-4"),
        "lr-2e-3": ("optim.total_steps=1500", "optim.lr=2e-3"),
        "lr-2.5e-4": ("optim.total_steps=1500", "optim.lr=2.5e-4"),  # sqrt-scaled from the official 1e-3 at 1024
        "ema-0.996": ("optim.total_steps=1500", "optim.ema_start=0.996"),
        "ema-0.98": ("optim.total_steps=1500", "optim.ema_start=0.98"),
    }, budget=None),
    # Bigger models cost more per image: equal-time step counts (measured throughput ratios).
    *_stage("model", (*DEMO, *P7), {
        "width-256": ("optim.total_steps=770", "model.embed_dim=256", "model.num_heads=4"),
        "depth-6": ("optim.total_steps=1000", "model.depth=6"),
        "depth-8-width-128": ("optim.total_steps=1270", "model.depth=8", "model.embed_dim=128", "model.num_heads=2"),
        "head-2048": ("optim.total_steps=1250", "model.head_hidden_dim=2048"),
    }, budget=None),
]


@dataclass
class Result:
    name: str
    stage: str
    overrides: list[str]
    budget: float | None
    config: str
    note: str
    machine: str
    cpus: str
    threads: int
    total_steps: int = 0
    train_minutes: float = 0.0
    images_per_sec: float = 0.0
    lowshot: dict[str, dict] = field(default_factory=dict)  # "1" -> {"mean", "std", "accuracies"}
    knn: float | None = None
    knn_train: int = 0  # training images the kNN votes from (0: all)
    eval_minutes: float = 0.0
    finished: str = ""


def load_results() -> dict[str, dict]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save_result(result: Result) -> None:
    """Read-modify-write under a lock: two searches pinned to different cores may finish at the same time."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results()
        results[result.name] = asdict(result)
        atomic_write_json(RESULTS, results)


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def _command(cmd: list[str], cpus: str | None) -> list[str]:
    return (["taskset", "-c", cpus] if cpus else []) + cmd


def run_trial(trial: Trial, *, cpus: str | None, threads: int, data: str, keep: bool) -> Result:
    work = WORK / trial.name
    if work.exists():
        shutil.rmtree(work)  # a half-finished trial starts again: its clock must cover the whole run
    work.mkdir(parents=True)
    result = Result(trial.name, trial.stage, list(trial.overrides), trial.budget, trial.config, trial.note,
                    machine(), cpus or "all", threads)
    env = _env(threads)
    length = [f"optim.budget_minutes={trial.budget}"] if trial.budget is not None else []
    sets = [*length, "run.progress_bar=false", "run.checkpoint_every_steps=1000000", *trial.overrides]
    pretrain = [sys.executable, "-m", "training.pretrain", "--config", trial.config, "--output-dir", str(work)]
    for item in sets:
        pretrain += ["--set", item]
    start = time.monotonic()
    subprocess.run(_command(pretrain, cpus), check=True, env=env, cwd=ROOT)
    result.train_minutes = (time.monotonic() - start) / 60
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    result.total_steps = records[-1]["step"]
    rates = [r["images_per_sec"] for r in records[1:]] or [records[-1]["images_per_sec"]]
    result.images_per_sec = statistics.median(rates)

    start = time.monotonic()
    bundle = work / "bundle"
    export = [sys.executable, "-m", "training.bundle.export", "--checkpoint", str(work / "checkpoint.pt"), "--out",
              str(bundle)]
    subprocess.run(_command(export, cpus), check=True, env=env, cwd=ROOT, capture_output=True)
    evaluate = [sys.executable, "-m", "training.evaluation.cli"]
    common = ["--bundle", str(bundle), "--data", data, "--no-progress", "--cache-dir", str(work / "features"),
              "--threads", str(threads)]
    lowshot_json, knn_json = work / "lowshot.json", work / "knn.json"
    subprocess.run(_command([*evaluate, "lowshot", *common, "--shots", "1", "2", "5", "--splits", "3", "--json",
                             str(lowshot_json)], cpus), check=True, env=env, cwd=ROOT)
    subprocess.run(_command([*evaluate, "knn", *common, "--max-train", str(trial.knn_train), "--json",
                             str(knn_json)], cpus), check=True, env=env, cwd=ROOT)
    result.eval_minutes = (time.monotonic() - start) / 60
    for row in json.loads(lowshot_json.read_text())["results"]:
        shots = row["setting"].split("imgs_class")[0]
        result.lowshot[shots] = {"mean": row["mean"], "std": row["std"], "accuracies": row["accuracies"]}
    knn_row = json.loads(knn_json.read_text())["results"][0]
    result.knn, result.knn_train = knn_row["top1"], knn_row["train"]
    result.finished = time.strftime("%Y-%m-%d %H:%M")
    if not keep:  # the checkpoint and features are large; the bundle is kept for reuse
        for path in (work / "checkpoint.pt", work / "features"):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return result


def render() -> str:
    results = load_results()
    lines = ["# The small-image recipe search", "",
             "Generated by `python benchmarks/recipe_search.py --render` from `benchmarks/results/recipe_search.json`;",
             "the reasoning is in [results-notes.md](results-notes.md) and the recipe in [training.md](training.md).",
             "Each row is one pretraining run on Fashion-MNIST, of `budget` minutes of its training loop or of a fixed",
             "number of steps (`steps`), from `benchmarks/configs/recipe_search_base.yaml` (the demo config before the",
             "search) with the row's changes, exported and evaluated with the official low-shot protocol (1 / 2 / 5",
             "labels per class, the 3 shipped splits, mean ± std over splits) and weighted kNN-20 against the first",
             ("20,000 training images (screening) or all 60,000. Raw pixels score "
             f"{PIXELS['ls1']:.1f} / {PIXELS['ls2']:.1f} / {PIXELS['ls5']:.1f}, kNN {PIXELS['knn']:.1f} (60k) and "
              f"{PIXELS['knn20k']:.1f} (20k)."),
             "`cpus` says how the run was pinned: rows run on one core had half the machine.", ""]
    stages = list(dict.fromkeys(r["stage"] for r in results.values()))
    for stage in stages:
        rows = [r for r in results.values() if r["stage"] == stage]
        lines += [f"## {stage}", "", ("| trial | changes | budget (min) | train (min) | cpus | steps | img/s | 1/class | "
                  "2/class | 5/class | kNN-20 (train images) |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ls = [f"{r['lowshot'][s]['mean']:.1f} ± {r['lowshot'][s]['std']:.1f}" if s in r["lowshot"] else "n/a"
                  for s in ("1", "2", "5")]
            changes = "<br>".join(f"`{o}`" for o in r["overrides"]) or "reference"
            knn = f"{r['knn']:.1f} ({r['knn_train'] // 1000}k)" if r["knn"] is not None else "n/a"
            budget = f"{r['budget']:g}" if r["budget"] is not None else "steps"
            lines.append(f"| {r['name']} | {changes} | {budget} | {r['train_minutes']:.1f} | {r['cpus']} | "
                         f"{r['total_steps']} | "
                         f"{r['images_per_sec']:.0f} | {' | '.join(ls)} | {knn} |")
        lines.append("")
    not_run = [t.name for t in SEARCH if t.name not in results]
    if not_run:
        lines += ["Recorded in the script but not run (the session's time went to the trials above): "
                  + ", ".join(f"`{name}`" for name in not_run) + ".", ""]
    machines = sorted({r["machine"] for r in results.values()})
    lines += ["Machines: " + "; ".join(machines) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", action="append", default=[], help="run the recorded trials of this stage")
    parser.add_argument("--only", action="append", default=[], help="run this recorded trial")
    parser.add_argument("--trial", help="an ad-hoc trial's name (with --set, --budget, --config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--budget", type=float, default=10.0,
                        help="ad-hoc trial: minutes of training loop (0: --set optim.total_steps=N gives the length)")
    parser.add_argument("--knn-train", type=int, default=20_000, help="ad-hoc trial: kNN training images (0: all)")
    parser.add_argument("--config", default=BASE_CONFIG, help="ad-hoc trial: the base config")
    parser.add_argument("--data", default="fashion-mnist", help="msn-eval --data (an image folder for others)")
    parser.add_argument("--cpus", help="taskset CPU list for every process of the trial (e.g. 0)")
    parser.add_argument("--threads", type=int, default=2, help="OMP/torch threads per process")
    parser.add_argument("--keep", action="store_true", help="keep checkpoints and cached features")
    parser.add_argument("--rerun", action="store_true", help="run trials that already have results")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()

    done = load_results()
    if args.list:
        for trial in SEARCH:
            length = f"{trial.budget:g} min" if trial.budget is not None else "steps"
            print(f"{'done' if trial.name in done else '    '}  {trial.stage:12s} {trial.name:24s} "
                  f"{length:8s} {' '.join(trial.overrides)}")
        return
    if args.render:
        atomic_write(DOC, render().encode())
        print(f"wrote {DOC}")
        return
    trials = [t for t in SEARCH if t.stage in args.stage or t.name in args.only]
    if args.trial:
        trials.append(Trial(args.trial, "ad hoc", tuple(args.overrides), args.budget or None, args.config,
                            args.knn_train))
    if not trials:
        parser.error("nothing to run: give --stage, --only or --trial (see --list)")
    for trial in trials:
        if trial.name in done and not args.rerun:
            print(f"{trial.name}: done, skipped")
            continue
        print(f"== {trial.name}: {' '.join(trial.overrides) or 'reference'}", flush=True)
        result = run_trial(trial, cpus=args.cpus, threads=args.threads, data=args.data, keep=args.keep)
        save_result(result)
        ls = " / ".join(f"{result.lowshot[s]['mean']:.1f}" for s in ("1", "2", "5"))
        print(f"{trial.name}: {result.total_steps} steps, {result.images_per_sec:.0f} img/s, low-shot {ls}, "
              f"kNN {result.knn:.1f} (train {result.train_minutes:.1f} min, eval {result.eval_minutes:.1f} min)",
              flush=True)


if __name__ == "__main__":
    main()
