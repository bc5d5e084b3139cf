"""The small-image recipe search: each trial is a config + a budget, pretrained, exported and evaluated.

    python -m benchmarks.training.recipe_search --list                   # the recorded trials, and which have run
    python -m benchmarks.training.recipe_search --stage focal --cpus 0   # run one stage's trials, pinned to core 0
    python -m benchmarks.training.recipe_search --trial my-idea --budget 5 --set mask.num_focal=2   # an ad-hoc trial
    python -m benchmarks.render                                          # docs/recipe_search.md (and the rest)

A trial runs ``training/pretrain.py`` with ``optim.budget_minutes`` (the schedules end when the budget does), or with a
fixed ``optim.total_steps`` when the trial names one, then ``msn-export`` and ``msn-eval``: low-shot at 1, 2 and 5
labels per class on the 3 shipped splits (the official protocol, fixed lambda) and weighted kNN-20 against the whole
training set. Results are appended to ``benchmarks/results/recipe_search.json`` as each trial finishes; a trial already
there is not run again, so an interrupted search continues. Wall time, images/s and the machine are recorded with every
row: a budget means little without the throughput it bought. ``--cpus``/``--threads`` pin a trial, so two can run side
by side on separate cores (each then has half the machine: compare trials run with the same pinning only).

Screening trials use fixed step counts rather than wall-clock budgets: on a machine whose other core is busy, a
budget buys a varying number of steps (up to a third more or less, measured), which would swamp the differences
being screened. Trials that change the cost of a step get the step count that costs the same time, from the
throughput ratio measured back to back (noted with the trial).
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
from dataclasses import asdict, dataclass, field

from benchmarks.common import REPO, machine, update_json
from benchmarks.protocol import RECIPE_JSON as RESULTS
from benchmarks.training.recipe_trials import BASE_CONFIG, SEARCH, Trial

WORK = REPO / "runs" / "recipe-search"


@dataclass
class Result:
    name: str
    stage: str
    overrides: list[str]
    budget: float | None
    config: str
    note: str
    machine: dict | str  # str in rows measured before the machine record became a dict
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
    update_json(RESULTS, lambda results: results.__setitem__(result.name, asdict(result)))


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
    subprocess.run(_command(pretrain, cpus), check=True, env=env, cwd=REPO)
    result.train_minutes = (time.monotonic() - start) / 60
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    result.total_steps = records[-1]["step"]
    rates = [r["images_per_sec"] for r in records[1:]] or [records[-1]["images_per_sec"]]
    result.images_per_sec = statistics.median(rates)

    start = time.monotonic()
    bundle = work / "bundle"
    export = [sys.executable, "-m", "training.bundle.export", "--checkpoint", str(work / "checkpoint.pt"), "--out",
              str(bundle)]
    subprocess.run(_command(export, cpus), check=True, env=env, cwd=REPO, capture_output=True)
    evaluate = [sys.executable, "-m", "training.evaluation.cli"]
    common = ["--bundle", str(bundle), "--data", data, "--no-progress", "--cache-dir", str(work / "features"),
              "--threads", str(threads)]
    lowshot_json, knn_json = work / "lowshot.json", work / "knn.json"
    subprocess.run(_command([*evaluate, "lowshot", *common, "--shots", "1", "2", "5", "--splits", "3", "--json",
                             str(lowshot_json)], cpus), check=True, env=env, cwd=REPO)
    subprocess.run(_command([*evaluate, "knn", *common, "--max-train", str(trial.knn_train), "--json",
                             str(knn_json)], cpus), check=True, env=env, cwd=REPO)
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
    args = parser.parse_args()

    done = load_results()
    if args.list:
        for trial in SEARCH:
            length = f"{trial.budget:g} min" if trial.budget is not None else "steps"
            print(f"{'done' if trial.name in done else '    '}  {trial.stage:12s} {trial.name:24s} "
                  f"{length:8s} {' '.join(trial.overrides)}")
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
