"""The label-efficient loop's section of docs/results.md and its plot.

Both come from benchmarks/evaluation/label_efficiency.py's JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import describe_machine
from benchmarks.protocol import LABEL_JSON, LABEL_PNG

FEATURES = {"onnx": "MSN", "pixels": "raw pixels"}
HEADER = "## The label-efficient loop: which images to label"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colours = {"random": "tab:grey", "select": "tab:blue", "select+suggest": "tab:green"}
    for backend, by_strategy in report["accuracy"].items():
        for strategy, rows in by_strategy.items():
            budgets = sorted(int(b) for b in rows)
            mean = [rows[str(b)]["mean"] for b in budgets]
            std = [rows[str(b)]["std"] for b in budgets]
            style = "-" if backend == "onnx" else "--"
            ax.errorbar(budgets, mean, yerr=std, fmt=style + "o", ms=3, capsize=2, color=colours.get(strategy),
                        label=f"{FEATURES.get(backend, backend)}: {strategy}")
    ax.set_xlabel("labels given")
    ax.set_ylabel("Fashion-MNIST test accuracy (%)")
    ax.set_title(f"Label-efficient loop ({report['seeds']} seeds, mean ± std)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _cell(v: dict | None) -> str:
    return "n/a" if v is None else f"{v['mean']:.1f} ± {v['std']:.1f}"


def render_label_efficiency(report: dict) -> str:
    budgets = [str(b) for b in report["budgets"]]
    lines = [HEADER, "",
             (f"`python -m benchmarks.evaluation.label_efficiency` on {describe_machine(report['machine'])} "
              "(pinned to core(s) "
              f"{report.get('cores_used', '?')}), bundle `{report['bundle']}` "
              f"(`{report.get('bundle_model_id', '?')}`). The 60,000 Fashion-MNIST training images are the "
              "unlabelled pool, the 10,000 test images score the classifier; labels are revealed only for picked "
              f"ids, {report['round']} per round. `random` draws uniformly from the pool (not class-balanced); "
              f"`select` calls the service's cold-start selector (`{report['selector']}`) every round, the "
              f"labelled ids excluded; `select+suggest` selects the first round and then takes the service's "
              f"suggestions (`{report['suggester']}`) from the classifier fitted so far. Selection and suggestions "
              f"see a seeded sample of {report['candidates']} candidates, as the endpoints do. Classifier: the "
              f"service's low-shot logistic regression (default lambda). Top-1 %, mean ± std over "
              f"{report['seeds']} seeds."), "",
             "| features | strategy | " + " | ".join(f"{b} labels" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    for backend, by_strategy in report["accuracy"].items():
        for strategy, rows in by_strategy.items():
            lines.append(f"| {FEATURES.get(backend, backend)} | {strategy} | "
                         + " | ".join(_cell(rows.get(b)) for b in budgets) + " |")
    lines += ["", "Targets (the label-loop issue):", ""]
    t = report.get("targets", {})
    if "selector_beats_random_by_10_at_10" in t:
        g = t["selector_beats_random_by_10_at_10"]
        lines.append(f"- selector beats random by ≥ 10 points at 10 labels (MSN): +{g['gain']:.1f} points, "
                     f"{'met' if g['met'] else '**missed**'}.")
    if "suggest_reaches_random_100_with_30" in t:
        g = t["suggest_reaches_random_100_with_30"]
        first = g["first_budget_reaching"]
        lines.append(f"- select+suggest reaches random's accuracy at 100 labels ({g['random_100']:.1f} %) with ≤ 30 "
                     f"labels: {g['at_30']:.1f} % at 30; first reached at "
                     f"{first if first is not None else 'no budget measured'}; "
                     f"{'met' if g['met'] else '**missed**'}.")
    if "msn_beats_pixels_10_20_50" in t:
        g = t["msn_beats_pixels_10_20_50"]
        pairs = ", ".join(f"{b}: {m:.1f} vs {p:.1f}" for b, (m, p) in g["msn_vs_pixels"].items())
        lines.append(f"- MSN beats raw pixels at 10, 20 and 50 labels ({g['strategy']}): {pairs}; "
                     f"{'met' if g['met'] else '**missed**'}.")
    sel = report.get("selectors")
    if sel:
        rounds = sorted({b for rows in next(iter(sel.values())).values() for b in rows}, key=int)
        lines += ["", ("Cold-start selectors (`select` strategy of `POST /index/{name}/select`, every round; "
                       "top-1 %, mean ± std over the same seeds):"), "",
                  "| features | selector | " + " | ".join(f"{b} labels" for b in rounds) + " |",
                  "|---|---|" + "---|" * len(rounds)]
        for backend, by_selector in sel.items():
            for selector, rows in by_selector.items():
                lines.append(f"| {FEATURES.get(backend, backend)} | {selector} | "
                             + " | ".join(_cell(rows.get(b)) for b in rounds) + " |")
    lat = report.get("latency")
    if lat:
        lines += ["", (f"Endpoint latency at a {lat['items']:,}-item `{lat['index']}` index of {lat['dim']}-d "
                       f"vectors, one client, server and client pinned to CPU core(s) {lat['cores']} of this machine "
                       f"({lat['server']}); target ≤ 200 ms:"), "",
                  "| call | p50 ms | p95 ms |", "|---|---|---|"]
        for name, row in lat.items():
            if isinstance(row, dict) and "p50_ms" in row:
                lines.append(f"| {name} | {row['p50_ms']:.0f} | {row.get('p95_ms', row['max_ms']):.0f} |")
    lines += ["", f"![accuracy against labels given; raw pixels dashed]({LABEL_PNG.name})", "",
              ("How to read it: which images get labelled matters more than the features at 10 labels"
               + _coverage(report) + ". The selector's gain holds "
               "on both feature sets; whether MSN features beat raw pixels in this loop depends on the encoder "
               "(see the pretraining-budget section): the bundle measured here is a short pretraining run. "
               "Suggestions (uncertain, kept diverse) add little over the selector at these budgets: a classifier "
               "fitted on 10 to 30 labels is not yet a good judge of its own uncertainty."), ""]
    return "\n".join(lines)


def _coverage(report: dict) -> str:
    cov = report.get("coverage", {}).get("onnx")
    if not cov:
        return ""
    mean = {k: sum(v) / len(v) for k, v in cov.items()}
    return (f" (on MSN features the first {report['round']} labels hold {mean['random']:.1f} of the 10 classes when "
            f"drawn uniformly, {mean['select']:.1f} when selected; mean over {len(cov['random'])} seeds)")


def section(docs: Path) -> str | None:
    """The section, when the JSON exists beside ``docs`` (``docs/../benchmarks/results``)."""
    path = docs.parent / "benchmarks" / "results" / LABEL_JSON.name
    return render_label_efficiency(json.loads(path.read_text())) if path.exists() else None
