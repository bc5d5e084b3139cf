"""A measuring plan as a list of resumable steps (pretrain, export, evaluate), shared by the paper tables and the
training benchmarks: a step whose outputs exist is skipped, so an interrupted plan continues where it stopped.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO as ROOT
from msn_core.durable import atomic_write_json

# msn-eval arguments for the paper's feature (the last block's CLS before the final norm), beside the served one
PAPER_CLS = ["--backend", "torch", "--feature", "cls_pre_norm"]


@dataclass
class Step:
    name: str
    command: list[str]  # what it runs (for a Python step, the equivalent command line)
    outputs: list[Path]
    action: Callable[[], None]

    def done(self) -> bool:
        return bool(self.outputs) and all(p.exists() for p in self.outputs)


def subprocess_action(command: list[str]) -> Callable[[], None]:
    return lambda: subprocess.run(command, cwd=ROOT, check=True)


def set_args(overrides: dict) -> list[str]:
    return [arg for k, v in overrides.items() for arg in ("--set", f"{k}={json.dumps(v)}")]


def eval_step(work: Path, bundle: str, command: str, args: list[str], tag: str | None = None,
              pixels_source: str = "msn", data: str = "fashion-mnist") -> Step:
    """``msn-eval COMMAND`` on ``work/bundles/BUNDLE``; ``pixels`` reads the preprocessing of ``pixels_source``."""
    out = work / "evals" / f"{bundle}-{tag or command}.json"
    source = pixels_source if bundle == "pixels" else bundle
    argv = [command, "--bundle", str(work / "bundles" / source), "--data", data,
            "--cache-dir", str(work / "feature-cache"), "--json", str(out), *args]

    def run() -> None:
        from training.evaluation.cli import main

        main(argv)

    return Step(f"eval {bundle} {tag or command}", ["msn-eval", *argv], [out], run)


def export_step(work: Path, checkpoint: Path, name: str) -> Step:
    """``msn-export`` of ``checkpoint`` to ``work/bundles/NAME``."""
    command = [sys.executable, "-m", "training.bundle.export", "--checkpoint", str(checkpoint),
               "--out", str(work / "bundles" / name)]
    return Step(f"export {name}", command, [work / "bundles" / name / "msn.json"], subprocess_action(command))


def bundle_and_pixels_evals(work: Path, bundle: str, shots: tuple[str, ...], data: str = "fashion-mnist") -> list[Step]:
    """Low-shot (the 3 seeded splits) and kNN-20 of ``bundle``'s served feature and of raw pixels under the same
    preprocessing: what ``summarize_evals`` reads."""
    steps = []
    for name in (bundle, "pixels"):
        extra = ["--backend", "pixels"] if name == "pixels" else []
        steps.append(eval_step(work, name, "lowshot", ["--shots", *shots, "--splits", "3", *extra],
                               pixels_source=bundle, data=data))
        steps.append(eval_step(work, name, "knn", extra, pixels_source=bundle, data=data))
    return steps


def read_evals(work: Path) -> dict[str, dict]:
    """Every ``msn-eval`` report of a plan, by file stem (``BUNDLE-TAG``)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((work / "evals").glob("*.json"))}


def summarize_evals(evals: dict[str, dict], bundles: tuple[str, ...]) -> dict[str, dict]:
    """``{bundle: {"1imgs_class": mean %, ..., "knn": top-1 %}}`` from ``bundle_and_pixels_evals``' reports."""
    summary = {}
    for bundle in bundles:
        lowshot = evals.get(f"{bundle}-lowshot", {}).get("results", [])
        knn = evals.get(f"{bundle}-knn", {}).get("results", [{}])
        summary[bundle] = {**{r["setting"]: round(r["mean"], 2) for r in lowshot}, "knn": knn[0].get("top1")}
    return summary


def pretrain_step(name: str, command: list[str], run_dir: Path, *, fresh: bool = True,
                  log: Path | None = None) -> Step:
    """A pretraining run by ``command`` into ``run_dir``, done when ``run_dir/done.json`` exists.

    ``fresh``: a budget is wall-clock time, so an interrupted budgeted run starts again from nothing; a run sized in
    steps passes ``--resume`` and ``fresh=False`` instead. ``done.json`` records torchrun's wall clock, the load
    average around it (a timed run needs the machine to itself) and the trainer's own account of its budget.
    ``log``: where the run's output goes (default: this process's).
    """
    def run() -> None:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        load_before, start = os.getloadavg()[0], time.monotonic()
        if log is None:
            subprocess.run(command, cwd=ROOT, check=True)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as out:
                subprocess.run(command, cwd=ROOT, check=True, stdout=out, stderr=subprocess.STDOUT)
        atomic_write_json(run_dir / "done.json", {"wall_minutes": (time.monotonic() - start) / 60,
                                                  "load_before": load_before, "load_after": os.getloadavg()[0],
                                                  **trainer_budget(run_dir / "checkpoint.pt")})

    return Step(name, command, [run_dir / "done.json"], run)


def trainer_budget(checkpoint: Path) -> dict:
    """The trainer's own account of its budget (the checkpoint's run length, read as ``--resume`` reads it): seconds
    used, the first length and how often it was resized, under the keys the stored results already use; empty values
    for a run sized in steps. torchrun's wall clock also counts start-up."""
    import torch

    from training.run.length import StoredLength

    length = StoredLength.read(torch.load(checkpoint, map_location="cpu", weights_only=False))
    if length is None:
        return {"trainer_budget_seconds_used": None, "planned_total_steps": None, "replans": 0}
    return {"trainer_budget_seconds_used": length.budget_seconds_used,
            "planned_total_steps": length.first_total_steps, "replans": len(length.resizes)}


def run_record(run_dir: Path) -> dict:
    """What a finished run did: its last step and epoch, median images/s after the first record, and ``done.json``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "step" in r] or [{}]
    rates = [r["images_per_sec"] for r in logged[1:] if "images_per_sec" in r] or [0.0]
    return {"steps": logged[-1].get("step", 0), "epochs": logged[-1].get("epoch"),
            "images_per_sec": statistics.median(rates), **json.loads((run_dir / "done.json").read_text())}


def export_random_init(reference: Path, out: Path, seed: int, feature: str = "cls_pre_norm") -> None:
    """A randomly initialised trunk of the same architecture and preprocessing as the MSN bundle
    (:func:`training.bundle.untrained.export_untrained`, the code of ``msn-eval --untrained``). ``feature``: the
    graph's output, ``cls_pre_norm`` as the stored ``random_init`` rows were measured; ``None``: the reference's."""
    from training.bundle.untrained import export_untrained

    export_untrained(reference, out, seed=seed, feature=feature)


def print_plan(steps: list[Step], force: bool = False) -> None:
    for i, step in enumerate(steps, 1):
        state = "done" if step.done() and not force else "todo"
        print(f"{i:2d}. [{state}] {step.name}\n      {shlex.join(step.command)}")


def run_steps(steps: list[Step], work: Path, force: bool = False) -> dict[str, float]:
    """Run the steps not done yet; return every step's duration in seconds (kept in ``work/timings.json``)."""
    timings_path = work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    for i, step in enumerate(steps, 1):
        if step.done() and not force:
            continue
        print(f"[{i}/{len(steps)}] {step.name}", flush=True)
        start = time.perf_counter()
        step.action()
        timings[step.name] = time.perf_counter() - start
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(timings_path, timings)
    return timings

