"""Markdown for ``docs/results.md``: the paper-table profiles (``benchmarks/paper_tables.py``) and the RCDM check
(``benchmarks/rcdm_eval.py``), rendered from their stored JSON so the document can be rebuilt without rerunning."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

ABLATION_RATIOS = (0.15, 0.3, 0.5, 0.7)
ROBUSTNESS_RATIOS = (0.15, 0.3, 0.5, 0.7, 0.9)
KNN_TRAIN = 10_000  # first 10k training images: a kNN over all 60k costs minutes per model on 2 cores


def ratio_run(ratio: float, default_ratio: float) -> str:
    return "msn" if ratio == default_ratio else f"ratio_{ratio:g}"


def tsne_name(profile: str) -> str:
    return f"tsne_fmnist_{profile}.png"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    text = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return text


def _acc(evals: dict, key: str, setting: str) -> str:
    for row in evals.get(key, {}).get("results", []):
        if row.get("setting") == setting:
            return f"{row['mean']:.1f} ± {row['std']:.1f}"
    return "n/a"


def mean_accuracy(evals: dict, key: str, setting: str) -> float | None:
    rows = [r for r in evals.get(key, {}).get("results", []) if r.get("setting") == setting]
    return rows[0]["mean"] if rows else None


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


SETTINGS = [("1imgs_class", "1/class"), ("2imgs_class", "2/class"), ("5imgs_class", "5/class"), ("1percent", "1 %")]


def _lowshot_rows(evals: dict, rows: list[tuple[str, str]], extra: Callable[[str], list[str]] = lambda b: []):
    return [[label, *(_acc(evals, f"{b}-lowshot", s) for s, _ in SETTINGS), *extra(b)] for b, label in rows]


def _knn(evals: dict, bundle: str) -> list[str]:
    rows = evals.get(f"{bundle}-knn", {}).get("results", [])
    return [f"{rows[0]['top1']:.1f}" if rows else "n/a"]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("agrees" if ok else "**disagrees**")


def render_profile(result: dict) -> str:
    ev, runs = result["evals"], result["runs"]
    label = {name: run["label"] for name, run in runs.items()}
    head = ["model", *(s for _, s in SETTINGS)]
    m = {b: mean_accuracy(ev, f"{b}-lowshot", "5imgs_class") for b in [*runs, "random_init", "pixels"]}
    beats = [mean_accuracy(ev, "msn-lowshot", s) for s, _ in SETTINGS[:3]]
    out = [f"## Profile `{result['profile']}`: {result['machine']}",
           (f"Overrides `{result['overrides']}`; run time of all steps {result['seconds'] / 60:.1f} min. "
            "Low-shot top-1 (%) on the 10,000 test images, mean ± std over the 3 shipped splits; "
            f"logistic regression λ = {result['lambd']} (paper default)."), "",
           f"![t-SNE of test features, MSN vs random init]({tsne_name(result['profile'])})", ""]
    out += ["### 1. Low-shot: MSN vs baselines", _table([*head, f"kNN k=20 ({KNN_TRAIN // 1000}k train)"],
            _lowshot_rows(ev, [("msn", label["msn"]), ("random_init", "random-init ViT (same architecture)"),
                               ("pixels", "raw pixels"), ("focal_only", label["focal_only"])],
                          lambda b: _knn(ev, b))), ""]
    for base in ("random_init", "pixels", "focal_only"):
        others = [mean_accuracy(ev, f"{base}-lowshot", s) for s, _ in SETTINGS[:3]]
        ok = None if None in beats + others else all(a > b for a, b in zip(beats, others))
        out.append(f"- MSN above {base} at 1, 2 and 5 images per class: {_verdict(ok)} (paper: yes).")
    strategy = [("no_mask", "none", 49.3), ("focal_only", "focal only", 39.3), ("random_only", "random only", 52.3),
                ("msn", "random + focal", 59.8)]
    out += ["", "### 2. Masking strategy", _table(
        ["masking", *(s for _, s in SETTINGS), "paper (IN-1k 1 %)"],
        [[name, *(_acc(ev, f"{b}-lowshot", s) for s, _ in SETTINGS), f"{p}"] for b, name, p in strategy]), ""]
    ours = [m[b] for b, _, _ in strategy]
    ok = None if None in ours else (ours[3] == max(ours) and ours[2] > ours[0] > ours[1])
    out.append(f"- Ordering random + focal > random > none > focal at 5/class: {_verdict(ok)}.")
    ratio_rows = [(ratio_run(r, result["default_ratio"]), f"{r}") for r in ABLATION_RATIOS]
    out += ["", "### 3. Masking ratio", _table(["ratio", *(s for _, s in SETTINGS)], _lowshot_rows(ev, ratio_rows)),
            "", ("- Paper: the best ratio grows with model size (0.15 for ViT-S/16, 0.3 for B/16, 0.7 for L/7); "
                 "a tiny ViT on 49 patches is expected to prefer a low ratio."), ""]
    out += ["### 4. Masking robustness", _robustness_table(ev), ""]
    out += ["### 5. View sharing", _table([*head, "kNN"], _lowshot_rows(
        ev, [("msn", label["msn"]), ("shared_view", label["shared_view"])], lambda b: _knn(ev, b))), ""]
    ok = None if None in (m["msn"], m["shared_view"]) else m["shared_view"] < m["msn"] - 10
    out += [f"- Sharing the view collapses the representation (paper: 7 % on IN-1k 1 %): {_verdict(ok)}.", ""]
    out += ["### Solver check: cyanure vs scikit-learn on the MSN features", _solver_table(ev), ""]
    return "\n".join(out)


def _robustness_table(ev: dict) -> str:
    rows = []
    for bundle, name, paper in (("msn", "MSN", "0.97"), ("focal_only", "no-mask baseline", "0.56 (DINO)")):
        res = ev.get(f"{bundle}-robustness", {}).get("results", [])
        cos = {r["ratio"]: r["value"] for r in res if r["metric"] == "cosine"}
        shot5 = {r["ratio"]: r["mean"] for r in res if r["metric"] == "lowshot" and r["setting"] == "5imgs_class"}
        rows.append([f"{name}: cosine(masked, unmasked)", *(f"{cos[r]:.3f}" if r in cos else "n/a"
                                                           for r in ROBUSTNESS_RATIOS), paper])
        rows.append([f"{name}: 5/class acc., masked train", *(f"{shot5[r]:.1f}" if r in shot5 else "n/a"
                                                              for r in ROBUSTNESS_RATIOS), ""])
    return _table(["", *(f"ratio {r}" for r in ROBUSTNESS_RATIOS), "paper at 0.9"], rows)


def _solver_table(ev: dict) -> str:
    rows = []
    for key, solver in (("msn-lowshot", "cyanure 1.2.2, official stop (gap 1e-3, 300 epochs)"),
                        ("msn-lowshot-cyanure-tight", "cyanure 1.2.2, gap 1e-6, 3000 epochs"),
                        ("msn-lowshot-sklearn", "sklearn lbfgs (tol 1e-6)")):
        res = {r["setting"]: r for r in ev.get(key, {}).get("results", [])}
        rows.append([solver, *(f"{res[s]['mean']:.2f} ({statistics.median(res[s]['fit_seconds']):.3f} s)"
                               if s in res else "n/a" for s, _ in SETTINGS)])
    return _table(["solver", *(f"{s}: acc. (median fit time)" for _, s in SETTINGS)], rows)


def render_rcdm(result: dict) -> str:
    """The visualizer's check (``benchmarks/rcdm_eval.py`` writes ``docs/rcdm_eval.json``)."""
    head = ["mask ratio", "MSN decoder: class consistency", "random-encoder decoder", "MSN: cos(sample, cond.)",
            "random: cos(sample, cond.)"]
    rows = [[ratio, f"{r['msn']['consistent']:.3f}", f"{r['random']['consistent']:.3f}", f"{r['msn']['cos_msn']:.3f}",
             f"{r['random']['cos_msn']:.3f}"] for ratio, r in result["ratios"].items()]
    clf = result["classifier"]
    return "\n".join([
        "## What the representation keeps: RCDM samples", "",
        (f"`python benchmarks/rcdm_eval.py` on {result.get('machine_name', result['machine'])} (script run "
         f"{result['seconds'] / 60:.1f} min; decoders that already existed are not retrained). Two decoders with the same config and {result['msn']['decoder_steps']} "
         f"training steps, one conditioned on the MSN bundle `{result['msn']['bundle']}`, one on a random-init "
         f"encoder of the same architecture. {result['images']} class-balanced test images x "
         f"{result['samples_per_image']} samples ({result['sampling_steps']} {result['sampler'].upper()} steps) per "
         f"mask ratio. Class "
         f"consistency: a sample's class, predicted by a logistic classifier on MSN features "
         f"({clf['train_images']} labelled images, {100 * clf['accuracy_on_originals']:.1f} % on the unmasked "
         f"originals), equals the conditioning image's (chance {result['chance']:.2f}). Cosines are between MSN "
         f"embeddings of the sample and of the masked conditioning image (unrelated test pairs: "
         f"{result['cos_unrelated']:.3f})."), "",
        _table(head, rows), "",
        f"![original, masked, 4 MSN samples, 4 random-encoder samples]({result['grid']['file']})", ""])


BUDGET_JSON, BUDGET_PNG = "budget_curve.json", "budget_curve.png"


def budget_bundle(minutes: float) -> str:
    """Name of the budget curve's run, bundle and eval prefix for a budget of ``minutes``."""
    return f"budget-{minutes:g}min"


# The time-to-accuracy targets: (budget in minutes, {setting or "knn": least accuracy}); pixels are added below.
BUDGET_TARGETS = {10: {}, 30: {"1imgs_class": 54.0, "2imgs_class": 61.0, "5imgs_class": 70.0, "knn": 88.0},
                  60: {"1imgs_class": 60.0, "knn": 90.0}}


def _knn_top1(evals: dict, bundle: str) -> float | None:
    rows = evals.get(f"{bundle}-knn", {}).get("results", [])
    return rows[0]["top1"] if rows else None


def _std(evals: dict, key: str, setting: str) -> float | None:
    for row in evals.get(key, {}).get("results", []):
        if row.get("setting") == setting:
            return row["std"]
    return None


def render_budget(result: dict) -> str:
    """``benchmarks/budget_curve.py``: one pretraining run per wall-clock budget, with the baselines."""
    ev, budgets = result["evals"], result["budgets"]
    rows = []
    for minutes in budgets:
        name = budget_bundle(minutes)
        run = result["runs"][name]
        label = (f"MSN, {minutes:g} min ({run['steps']} steps, {run['images_per_sec']:.0f} img/s, "
                 f"{run['epochs']} epochs)")
        rows.append((name, label))
    rows += [("random_init", "random-init ViT"), ("pixels", "raw pixels")]

    def knn(bundle: str) -> list[str]:
        top1 = _knn_top1(ev, bundle)
        return [f"{top1:.1f}" if top1 is not None else "n/a"]

    load = ", ".join(f"{m:g} min: {result['runs'][budget_bundle(m)]['load_before']:.2f}" for m in budgets)
    lines = [
        "## Accuracy against a wall-clock pretraining budget", "",
        (f"`python benchmarks/budget_curve.py` on {result['machine']}: `{result['config']}` pretrained once per "
         f"budget with `--set optim.budget_minutes=B` (seed {result['seed']}), so each run's schedules end with its "
         "budget; the budget covers the training loop (calibration, steps, checkpoints), not export and "
         "evaluation. Low-shot top-1 (%), mean ± std over the 3 shipped splits with the official protocol (fixed "
         "lambda); kNN-20 against all 60,000 training images. Load average before each run (nothing else "
         f"running): {load}."), "",
        _table(["model", *(s for _, s in SETTINGS), "kNN-20 (60k)"], _lowshot_rows(ev, rows, knn)), "",
        "Targets (the time-to-accuracy issue): above raw pixels at 1, 2 and 5 labels per class and on kNN-20 at",
        "every budget; at 30 min at least pixels + 5 points (54 / 61 / 70 %) and kNN-20 ≥ 88 %; at 60 min",
        "kNN-20 ≥ 90 % and 1 label per class ≥ 60 %.", "",
        *(_budget_verdict(ev, minutes) for minutes in budgets), "",
        f"![accuracy against pretraining budget, raw pixels dashed]({BUDGET_PNG})", ""]
    return "\n".join(lines)


def _budget_verdict(ev: dict, minutes: float) -> str:
    """Met / missed for each target of this budget, with the margin and whether it is inside one split std."""
    name = budget_bundle(minutes)
    checks = []
    for setting, label in SETTINGS[:3]:
        ours, pixels = mean_accuracy(ev, f"{name}-lowshot", setting), mean_accuracy(ev, "pixels-lowshot", setting)
        bar = max(pixels or 0.0, BUDGET_TARGETS.get(minutes, {}).get(setting, 0.0))
        if ours is None or pixels is None:
            checks.append(f"{label} n/a")
            continue
        std = _std(ev, f"{name}-lowshot", setting) or 0.0
        inside = " (inside one std)" if ours > bar and ours - bar <= std else ""
        checks.append(f"{label} {ours:.1f} vs {bar:.1f}: {'met' if ours > bar else '**missed**'}{inside}")
    ours, pixels = _knn_top1(ev, name), _knn_top1(ev, "pixels")
    if ours is not None and pixels is not None:
        bar = max(pixels, BUDGET_TARGETS.get(minutes, {}).get("knn", 0.0))
        checks.append(f"kNN {ours:.1f} vs {bar:.1f}: {'met' if ours > bar else '**missed**'}")
    return f"- {minutes:g} min: " + "; ".join(checks) + "."


def render(docs: Path) -> str:
    profiles = [json.loads(p.read_text()) for p in sorted((docs / "results").glob("*.json"))]
    rcdm = docs / "rcdm_eval.json"
    notes = docs / "results-notes.md"
    parts = ["# MSN on Fashion-MNIST: the paper's experiments at small scale", "",
             ("Generated by `python benchmarks/paper_tables.py`; do not edit by hand (discussion goes in "
              "`docs/results-notes.md`). Paper numbers are ViT on ImageNet-1k and are shown for the direction of "
              "each effect, not for the values."), ""]
    parts += [render_profile(p) for p in profiles]
    budget = docs / BUDGET_JSON
    if budget.exists():
        parts.append(render_budget(json.loads(budget.read_text())))
    if rcdm.exists():
        parts.append(render_rcdm(json.loads(rcdm.read_text())))
    from benchmarks.label_report import section  # benchmarks/label_efficiency.py

    label = section(docs)
    if label:
        parts.append(label)
    if notes.exists():
        parts += ["## Discussion", "", notes.read_text()]
    return "\n".join(parts).rstrip() + "\n"
