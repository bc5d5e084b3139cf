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


def budget_bundle(epoch: int) -> str:
    """Name of the bundle (and eval prefix) of the budget curve's checkpoint after ``epoch`` epochs."""
    return f"ep{epoch:04d}"


def render_budget(result: dict) -> str:
    """``benchmarks/budget_curve.py``: low-shot accuracy after each epoch of one long run, with the baselines."""
    ev = result["evals"]
    rows = [(budget_bundle(e), f"MSN after {e} epoch{'s' if e > 1 else ''}") for e in result["eval_epochs"]]
    rows += [("random_init", "random-init ViT"), ("pixels", "raw pixels")]
    return "\n".join([
        "## Low-shot accuracy against pretraining budget", "",
        (f"`python benchmarks/budget_curve.py` on {result['machine']}: `{result['config']}` trained for "
         f"{result['epochs']} epochs as one cosine schedule ({result['pretrain_step_seconds'] / 60:.0f} min of "
         f"optimiser steps), the target encoder exported and evaluated after the listed epochs "
         f"({result['eval_seconds'] / 60:.0f} min to export and evaluate). Low-shot top-1 (%), mean ± std over the 3 "
         "shipped splits; kNN on the first 10k training images. An early epoch is a checkpoint of the long "
         "schedule, not a run of that length."), "",
        _table(["model", *(s for _, s in SETTINGS), f"kNN k=20 ({KNN_TRAIN // 1000}k train)"],
               _lowshot_rows(ev, rows, lambda b: _knn(ev, b))), "",
        *(_budget_verdict(ev, result["eval_epochs"], base, name) for base, name in
          (("random_init", "the random-init ViT"), ("pixels", "raw pixels"))), "",
        f"![low-shot accuracy against pretraining epochs, raw pixels dashed]({BUDGET_PNG})", ""])


def _budget_verdict(ev: dict, epochs: list[int], base: str, name: str) -> str:
    """From which evaluated epoch on MSN stays above ``base`` at 1, 2 and 5 labels per class."""
    shots = [s for s, _ in SETTINGS[:3]]
    others = [mean_accuracy(ev, f"{base}-lowshot", s) for s in shots]
    above = []
    for epoch in epochs:
        ours = [mean_accuracy(ev, f"{budget_bundle(epoch)}-lowshot", s) for s in shots]
        if None in ours + others:
            return f"- MSN above {name} at 1, 2 and 5 images per class: n/a."
        above.append(all(a > b for a, b in zip(ours, others)))
    first = next((e for i, e in enumerate(epochs) if all(above[i:])), None)
    if first is None:
        return f"- MSN above {name} at 1, 2 and 5 images per class: **not by epoch {epochs[-1]}**."
    return f"- MSN above {name} at 1, 2 and 5 images per class: from epoch {first} on (paper: yes)."


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
    if notes.exists():
        parts += ["## Discussion", "", notes.read_text()]
    return "\n".join(parts).rstrip() + "\n"
