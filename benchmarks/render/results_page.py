"""docs/results.md: the paper-table profiles (docs/results/*.json), the budget curve, the RCDM check and the
label-efficient loop, each rendered from its stored JSON; the hand-written discussion is appended verbatim."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import describe_machine
from benchmarks.protocol import (
    ABLATION_RATIOS,
    BUDGET_JSON,
    KNN_TRAIN,
    RCDM_JSON,
    ROBUSTNESS_RATIOS,
    SETTINGS,
    ratio_run,
    tsne_name,
)
from benchmarks.render import controls, decoder, own_images, stall
from benchmarks.render.budget import render_budget
from benchmarks.render.evals import accuracy_cell, lowshot_rows, mean_accuracy
from benchmarks.render.features import render_feature_choice
from benchmarks.render.label import section as label_section
from benchmarks.render.text import table


def _knn(evals: dict, bundle: str) -> list[str]:
    rows = evals.get(f"{bundle}-knn", {}).get("results", [])
    return [f"{rows[0]['top1']:.1f}" if rows else "n/a"]


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("agrees" if ok else "**disagrees**")


DEFAULT_STRATEGY = {"none": "no_mask", "focal only": "focal_only", "random only": "random_only",
                    "random + focal": "msn"}  # the step-sized profiles' runs; a profile JSON may name its own
PAPER_STRATEGY = {"none": 49.3, "focal only": 39.3, "random only": 52.3, "random + focal": 59.8}  # IN-1k 1 %


def _heading(result: dict) -> list[str]:
    name, machine = result["profile"], describe_machine(result["machine"])
    if result.get("budgeted"):
        title = f"## The paper's tables on the shipped recipe (profile `{name}`): {machine}"
        length = ("every run is the recipe `make demo` trains "
                  f"(`{result['config']}`) for its wall-clock budget, changed only by its row's overrides")
    else:
        title = f"## Profile `{name}`: {machine}"
        length = f"every run is `{result.get('config', 'the pre-search demo config')}` with the overrides"
    runs = result["runs"]
    steps = ", ".join(f"{n} {r['steps']:,}" for n, r in runs.items() if r.get("steps"))
    return [title, (f"Overrides `{result['overrides']}`; {length}; run time of all steps "
                    f"{result['seconds'] / 60:.1f} min. Low-shot top-1 (%) on the 10,000 test images, mean ± std "
                    f"over the 3 shipped splits; logistic regression λ = {result['lambd']} (paper default)."
                    + (f" Optimiser steps per run: {steps}." if steps else "")), ""]


def render_profile(result: dict) -> str:
    ev, runs = result["evals"], result["runs"]
    label = {name: run["label"] for name, run in runs.items()}
    head = ["model", *(s for _, s in SETTINGS)]
    m = {b: mean_accuracy(ev, f"{b}-lowshot", "5imgs_class") for b in [*runs, "random_init", "pixels"]}
    beats = [mean_accuracy(ev, "msn-lowshot", s) for s, _ in SETTINGS[:3]]
    out = [*_heading(result), f"![t-SNE of test features, MSN vs random init]({tsne_name(result['profile'])})", ""]
    out += ["### 1. Low-shot: MSN vs baselines", table([*head, f"kNN k=20 ({KNN_TRAIN // 1000}k train)"],
            lowshot_rows(ev, [("msn", label["msn"]), ("random_init", "random-init ViT (same architecture)"),
                               ("pixels", "raw pixels"), ("focal_only", label["focal_only"])],
                          lambda b: _knn(ev, b))), ""]
    for base in ("random_init", "pixels", "focal_only"):
        others = [mean_accuracy(ev, f"{base}-lowshot", s) for s, _ in SETTINGS[:3]]
        ok = None if None in beats + others else all(a > b for a, b in zip(beats, others))
        out.append(f"- MSN above {base} at 1, 2 and 5 images per class: {_verdict(ok)} (paper: yes).")
    strategy = result.get("strategy", DEFAULT_STRATEGY)
    knn_cols = _knn_columns(ev, strategy.values())
    out += ["", "### 2. Masking strategy", table(
        ["masking", "run", *(s for _, s in SETTINGS), *knn_cols, "paper (IN-1k 1 %)"],
        [[row, f"`{b}`", *(accuracy_cell(ev, f"{b}-lowshot", s) for s, _ in SETTINGS),
          *(_knn(ev, b) if knn_cols else []), f"{PAPER_STRATEGY[row]}"] for row, b in strategy.items()]), ""]
    ours = [m.get(b) for b in strategy.values()]
    ok = None if None in ours else (ours[3] == max(ours) and ours[2] > ours[0] > ours[1])
    out.append(f"- Ordering random + focal > random > none > focal at 5/class: {_verdict(ok)}.")
    ratio_rows = [(ratio_run(r, result["default_ratio"]), f"{r}") for r in ABLATION_RATIOS]
    knn_cols = _knn_columns(ev, [b for b, _ in ratio_rows])
    out += ["", "### 3. Masking ratio", table(["ratio", *(s for _, s in SETTINGS), *knn_cols],
                                              lowshot_rows(ev, ratio_rows, lambda b: _knn(ev, b) if knn_cols else [])),
            "", ("- Paper: the best ratio grows with model size (0.15 for ViT-S/16, 0.3 for B/16, 0.7 for L/7); "
                 f"a tiny ViT on {result.get('patches', 49)} patches is expected to prefer a low ratio."), ""]
    out += ["### 4. Masking robustness", _robustness_table(ev), ""]
    out += ["### 5. View sharing", table([*head, "kNN"], lowshot_rows(
        ev, [("msn", label["msn"]), ("shared_view", label["shared_view"])], lambda b: _knn(ev, b))), ""]
    ok = None if None in (m["msn"], m["shared_view"]) else m["shared_view"] < m["msn"] - 10
    out += [f"- Sharing the view collapses the representation (paper: 7 % on IN-1k 1 %): {_verdict(ok)}.", ""]
    if any(k.endswith("-cls-lowshot") for k in ev):
        out += ["### 6. Every run on the paper's feature (the last block's CLS before the final norm)",
                table(["run", *(s for _, s in SETTINGS), f"kNN k=20 ({KNN_TRAIN // 1000}k train)"],
                      [[f"`{b}`: {label[b]}", *(accuracy_cell(ev, f"{b}-cls-lowshot", s) for s, _ in SETTINGS),
                        *_knn(ev, f"{b}-cls")] for b in runs]), ""]
    out += ["### Solver check: cyanure vs scikit-learn on the MSN features", _solver_table(ev), ""]
    return "\n".join(out)


def _knn_columns(ev: dict, bundles) -> list[str]:
    """The kNN column of a table, when any of its rows was measured."""
    return [f"kNN k=20 ({KNN_TRAIN // 1000}k train)"] if any(f"{b}-knn" in ev for b in bundles) else []


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
    return table(["", *(f"ratio {r}" for r in ROBUSTNESS_RATIOS), "paper at 0.9"], rows)


def _solver_table(ev: dict) -> str:
    rows = []
    for key, solver in (("msn-lowshot", "cyanure 1.2.2, official stop (gap 1e-3, 300 epochs)"),
                        ("msn-lowshot-cyanure-tight", "cyanure 1.2.2, gap 1e-6, 3000 epochs"),
                        ("msn-lowshot-sklearn", "sklearn lbfgs (tol 1e-6)")):
        res = {r["setting"]: r for r in ev.get(key, {}).get("results", [])}
        rows.append([solver, *(f"{res[s]['mean']:.2f} ({statistics.median(res[s]['fit_seconds']):.3f} s)"
                               if s in res else "n/a" for s, _ in SETTINGS)])
    return table(["solver", *(f"{s}: acc. (median fit time)" for _, s in SETTINGS)], rows)


def render_rcdm(result: dict) -> str:
    """The visualizer's check (``benchmarks/evaluation/rcdm_eval.py`` writes ``docs/rcdm_eval.json``)."""
    head = ["mask ratio", "MSN decoder: class consistency", "random-encoder decoder", "MSN: cos(sample, cond.)",
            "random: cos(sample, cond.)"]
    rows = [[ratio, f"{r['msn']['consistent']:.3f}", f"{r['random']['consistent']:.3f}", f"{r['msn']['cos_msn']:.3f}",
             f"{r['random']['cos_msn']:.3f}"] for ratio, r in result["ratios"].items()]
    clf = result["classifier"]
    return "\n".join([
        "## What the representation keeps: RCDM samples", "",
        (f"`python -m benchmarks.evaluation.rcdm_eval` on "
         f"{describe_machine(result.get('machine_name', result['machine']))} (script run "
         f"{result['seconds'] / 60:.1f} min; decoders that already existed are not retrained). "
         f"Two decoders with the same config and {result['msn']['decoder_steps']} "
         f"training steps, one conditioned on the MSN bundle `{result['msn']['bundle']}`, one on a random-init "
         f"encoder of the same architecture. {result['images']} class-balanced test images x "
         f"{result['samples_per_image']} samples ({result['sampling_steps']} {result['sampler'].upper()} steps) per "
         f"mask ratio. Class "
         f"consistency: a sample's class, predicted by a logistic classifier on MSN features "
         f"({clf['train_images']} labelled images, {100 * clf['accuracy_on_originals']:.1f} % on the unmasked "
         f"originals), equals the conditioning image's (chance {result['chance']:.2f}). Cosines are between MSN "
         f"embeddings of the sample and of the masked conditioning image (unrelated test pairs: "
         f"{result['cos_unrelated']:.3f})."), "",
        table(head, rows), "",
        f"![original, masked, 4 MSN samples, 4 random-encoder samples]({result['grid']['file']})", ""])


def render(docs: Path) -> str:
    """The whole of ``docs/results.md``, from the JSON under ``docs``.

    The label loop's JSON is read from under benchmarks/results.
    """
    profiles = [json.loads(p.read_text()) for p in sorted((docs / "results").glob("*.json"))]
    rcdm = docs / RCDM_JSON
    notes = docs / "results-notes.md"
    parts = ["# MSN on Fashion-MNIST: the paper's experiments at small scale", "",
             ("Generated by `python -m benchmarks.render`; do not edit by hand (discussion goes in "
              "`docs/results-notes.md`). Paper numbers are ViT on ImageNet-1k and are shown for the direction of "
              "each effect, not for the values."), ""]
    results = docs.parent / "benchmarks" / "results"
    # What the demo's pretraining adds, then the shipped recipe's tables: what a researcher reads first.
    demo = controls.section(results)
    if demo:
        parts.append(demo)
    parts += [render_profile(p) for p in profiles if p.get("budgeted")]
    for own in (own_images.section(results), own_images.other_folders_section(results),
                own_images.glyph_folders_section(results), own_images.warm_start_section(results),
                stall.section(results)):
        if own:
            parts.append(own)
    parts += [render_profile(p) for p in profiles if not p.get("budgeted")]
    budget = docs / BUDGET_JSON
    if budget.exists():
        parts.append(render_budget(json.loads(budget.read_text())))
    if rcdm.exists():
        parts.append(render_rcdm(json.loads(rcdm.read_text())))
    harness = decoder.section(results)
    if harness:
        parts.append(harness)
    features = render_feature_choice(docs.parent / "benchmarks" / "results")
    if features:
        parts.append(features)
    label = label_section(docs)
    if label:
        parts.append(label)
    if notes.exists():
        parts += ["## Discussion", "", notes.read_text()]
    return "\n".join(parts).rstrip() + "\n"
