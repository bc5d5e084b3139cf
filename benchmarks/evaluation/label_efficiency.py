"""The label-efficient loop on Fashion-MNIST: accuracy against the number of labels a person gives.

    python -m benchmarks.evaluation.label_efficiency --bundle runs/label-bundle    # ~45 min on one core
    python -m benchmarks.evaluation.label_efficiency --bundle B --parts latency    # the 100k-item latencies
    python -m benchmarks.evaluation.label_efficiency --bundle B --seeds 1 --budgets 10 20 --parts accuracy
                                                                                   # a quick look

The 60,000 training images are the unlabelled pool and the 10,000 test images score the classifier; a label is
revealed only for ids a strategy picked. Budgets are reached in rounds of ``--round`` labels, as a person would:
``random`` labels uniform draws from the pool (not class-balanced: the user does not know the classes),
``select`` calls the service's cold-start selector each round (already-labelled ids excluded, as the endpoint's
``exclude_ids``), ``select+suggest`` uses the selector for the first round and the service's suggestions (from the
classifier fitted so far) afterwards. Selection and suggestion run the service's own code
(:mod:`msn_serve.classifiers.label_strategies`, on a seeded ``select_candidates`` sample of the pool, as the endpoints
do); fits are the service's low-shot classifier (:mod:`msn_core.lowshot`, default lambda). The same loop on raw pixels
is the control. ``--parts selectors`` compares every cold-start selector; ``--parts latency`` times the four endpoints
over HTTP against a real ``msn-serve`` holding a 100k-item index. Writes ``benchmarks/results/label_efficiency.json``;
``python -m benchmarks.render --plots`` turns it into ``docs/label_efficiency.png`` and a section of
``docs/results.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import FEATURE_CACHE, REPO, machine, save_json, train_test_features
from benchmarks.protocol import LABEL_JSON
from msn_core.lowshot import DEFAULT_LAMBD, fit_logistic
from msn_serve.classifiers import label_strategies
from msn_serve.config import Settings

STRATEGIES = ("random", "select", "select+suggest")
PARTS = ("accuracy", "selectors", "coverage", "latency")


class Loop:
    """One (features, strategy, seed) run: labels revealed round by round, accuracy at each budget."""

    def __init__(self, data: dict[str, np.ndarray], candidates: int, selector: str, suggester: str):
        self.data, self.candidates = data, candidates
        self.selector, self.suggester = selector, suggester
        self.space = label_strategies.as_space(data["x_train"])

    def pick(self, strategy: str, labelled: list[int], n: int, seed: int, rnd: int,
             model) -> list[int]:
        pool = len(self.space)
        if strategy == "random":
            order = np.random.default_rng(seed).permutation(pool)
            return [int(i) for i in order[len(labelled): len(labelled) + n]]
        cand = label_strategies.candidate_positions(pool, self.candidates, seed + 7919 * rnd, exclude=labelled)
        covered = self.space[labelled] if labelled else None
        if strategy == "select" or model is None:
            pos = label_strategies.select(self.space[cand], n, self.selector, seed + rnd, covered)
        else:
            probs = model.probabilities(self.data["x_train"][cand])
            pos = label_strategies.suggest(self.space[cand], probs, n, self.suggester, seed + rnd, covered)
        return [int(i) for i in cand[pos]]

    def run(self, strategy: str, seed: int, budgets: list[int], step: int) -> dict[int, float]:
        labelled: list[int] = []
        model, acc, rnd = None, {}, 0
        y, xt, yt = self.data["y_train"], self.data["x_test"], self.data["y_test"]
        while len(labelled) < max(budgets):
            labelled += self.pick(strategy, labelled, min(step, max(budgets) - len(labelled)), seed, rnd, model)
            rnd += 1
            classes = np.unique(y[labelled])
            model = None
            if len(classes) >= 2:
                model = fit_logistic(self.data["x_train"][labelled], y[labelled], lambd=DEFAULT_LAMBD, n_threads=1)
            if len(labelled) in budgets:
                acc[len(labelled)] = 100.0 * (model.accuracy(xt, yt) if model else float(np.mean(yt == classes[0])))
        return acc


def summarise(runs: dict[int, dict[int, float]], budgets: list[int]) -> dict[str, dict[str, float]]:
    out = {}
    for b in budgets:
        vals = [runs[s][b] for s in sorted(runs)]
        out[str(b)] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                       "runs": vals}
    return out


def accuracy_study(args: argparse.Namespace) -> dict:
    results: dict = {}
    for backend in args.features:
        data = train_test_features(args.bundle, backend, args.cache_dir)
        loop = Loop(data, args.candidates, args.selector, args.suggester)
        results[backend] = {}
        for strategy in args.strategies:
            t0 = time.perf_counter()
            runs = {seed: loop.run(strategy, seed, args.budgets, args.round) for seed in range(args.seeds)}
            results[backend][strategy] = summarise(runs, args.budgets)
            row = "  ".join(f"{b}: {v['mean']:.1f} ± {v['std']:.1f}" for b, v in results[backend][strategy].items())
            print(f"{backend:6s} {strategy:15s} {row}   ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


def selector_study(args: argparse.Namespace) -> dict:
    """Every cold-start selector (and uniform random) at the first two rounds, to choose the default."""
    out: dict = {}
    for backend in args.features:
        data = train_test_features(args.bundle, backend, args.cache_dir)
        out[backend] = {}
        for selector in label_strategies.SELECT_STRATEGIES:
            loop = Loop(data, args.candidates, selector, args.suggester)
            budgets = [args.round, 2 * args.round]
            runs = {seed: loop.run("select", seed, budgets, args.round) for seed in range(args.seeds)}
            out[backend][selector] = summarise(runs, budgets)
            row = "  ".join(f"{b}: {v['mean']:.1f} ± {v['std']:.1f}" for b, v in out[backend][selector].items())
            print(f"{backend:6s} selector {selector:8s} {row}", flush=True)
    return out


def coverage_study(args: argparse.Namespace) -> dict:
    """Classes among the first round's labels (what a uniform draw misses and the selector finds)."""
    out: dict = {}
    for backend in args.features:
        data = train_test_features(args.bundle, backend, args.cache_dir)
        loop = Loop(data, args.candidates, args.selector, args.suggester)
        y = data["y_train"]
        out[backend] = {s: [len(set(y[loop.pick(s, [], args.round, seed, 0, None)].tolist()))
                            for seed in range(args.seeds)] for s in ("random", "select")}
        print(f"{backend:6s} classes in the first {args.round} labels: {out[backend]}", flush=True)
    return out


def targets(acc: dict) -> dict:
    """The issue's targets, each with the figures it was judged on."""
    msn = acc.get("onnx", {})
    out: dict = {}
    if {"random", "select"} <= set(msn) and "10" in msn["random"]:
        gain = msn["select"]["10"]["mean"] - msn["random"]["10"]["mean"]
        out["selector_beats_random_by_10_at_10"] = {"gain": gain, "met": gain >= 10.0}
    if {"random", "select+suggest"} <= set(msn) and "100" in msn["random"]:
        bar = msn["random"]["100"]["mean"]
        reach = [int(b) for b, v in msn["select+suggest"].items() if v["mean"] >= bar]
        first = min(reach) if reach else None
        out["suggest_reaches_random_100_with_30"] = {"random_100": bar, "first_budget_reaching": first,
                                                     "at_30": msn["select+suggest"].get("30", {}).get("mean"),
                                                     "met": first is not None and first <= 30}
    if "pixels" in acc and msn:
        strat = "select+suggest" if "select+suggest" in msn else next(iter(msn))
        cmp = {b: (msn[strat][b]["mean"], acc["pixels"][strat][b]["mean"]) for b in ("10", "20", "50")
               if b in msn[strat] and b in acc["pixels"].get(strat, {})}
        out["msn_beats_pixels_10_20_50"] = {"strategy": strat, "msn_vs_pixels": cmp,
                                           "met": bool(cmp) and all(m > p for m, p in cmp.values())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=REPO / "runs" / "label-bundle")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--budgets", type=int, nargs="+", default=[10, 20, 30, 50, 100])
    p.add_argument("--round", type=int, default=10, help="labels per round")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--selector", default="typical", choices=label_strategies.SELECT_STRATEGIES)
    p.add_argument("--suggester", default="margin", choices=label_strategies.SUGGEST_STRATEGIES)
    p.add_argument("--features", nargs="+", default=["onnx", "pixels"], choices=["onnx", "pixels"])
    p.add_argument("--candidates", type=int, default=Settings.model_fields["select_candidates"].default)
    p.add_argument("--cache-dir", type=Path, default=FEATURE_CACHE)
    p.add_argument("--parts", nargs="+", default=["accuracy", "selectors", "coverage"], choices=PARTS,
                   help="accuracy: the strategies table; selectors: every cold-start selector at 10 and 20 labels; "
                        "coverage: classes among the first round's labels; "
                        "latency: the endpoints at a --latency-items index (run it on a quiet machine). Parts not "
                        "run keep their figures from --out")
    p.add_argument("--latency-items", type=int, default=100_000)
    p.add_argument("--out", type=Path, default=LABEL_JSON)
    args = p.parse_args(argv)
    if any(b % args.round for b in args.budgets):
        p.error("every budget must be a multiple of --round")
    from msn_core.bundle import load_bundle_info

    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.pop("command", None)
    report.setdefault("commands", {})
    for part in args.parts:
        report["commands"][part] = " ".join(sys.argv)
    if report.get("bundle_model_id") not in (None, load_bundle_info(args.bundle).model_id) and \
            "accuracy" not in args.parts:
        p.error(f"{args.out} holds figures of bundle {report['bundle']}; rerun the accuracy part for this one")
    bundle = args.bundle.resolve()
    shown = str(bundle.relative_to(REPO)) if bundle.is_relative_to(REPO) else str(bundle)
    report.update({"machine": machine(), "cores_used": sorted(os.sched_getaffinity(0)), "bundle": shown,
                   "bundle_model_id": load_bundle_info(args.bundle).model_id})
    def save() -> None:  # after each part, so a later part's failure loses nothing
        save_json(args.out, report)

    if "accuracy" in args.parts:
        report.update({"seeds": args.seeds, "budgets": args.budgets, "round": args.round,
                       "selector": args.selector, "suggester": args.suggester, "candidates": args.candidates,
                       "pool": 60_000, "test": 10_000, "accuracy": accuracy_study(args)})
        report["targets"] = targets(report["accuracy"])
        save()
    if "selectors" in args.parts:
        report["selectors"] = selector_study(args)
        save()
    if "coverage" in args.parts:
        report["coverage"] = coverage_study(args)
        save()
    if "latency" in args.parts:
        from benchmarks.serving.label_latency import measure

        report["latency"] = measure(args.bundle, args.latency_items)
    print(json.dumps(report.get("targets", {}), indent=1))
    if "latency" in report:
        print(json.dumps(report["latency"], indent=1))
    save()
    print("docs: python -m benchmarks.render --plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
