"""Why does the planned run stall on the digit folders? One change at a time against the plan, at equal steps.

    python -m benchmarks.training.digit_stall --steps 600                      # every variant, 32 px digits
    python -m benchmarks.training.digit_stall --steps 600 --variants baseline protos64 --splits 3
    python -m benchmarks.training.digit_stall --steps 600 --variants baseline candidate --data fashion-mnist
    python -m benchmarks.training.digit_stall --steps 600 --stop-at 150 --variants crop0.6 noflip   # a screen
    python -m benchmarks.training.digit_stall --steps 600 --dry-run            # print the commands, run nothing

(The fashion-mnist form has not been run yet.)

The digits are the ones ``benchmarks/training/other_folders.py`` writes (scikit-learn's 1,797 8 x 8 digits, the
same stratified 2/3 : 1/3 split, seed 0, resampled to 32 px), under ``runs/digit_stall/digits32``. Each variant is
the planned run (``--data DIR``, no config) sized in optimiser steps rather than minutes, so a shared machine
cannot change what is learned: ``--set optim.total_steps=N --set run.max_steps=N`` (the schedules end with the
run, as a planned budget's do) and ``--set run.precision=fp32`` (``auto`` times fp32 against bf16 on CPUs with bf16
units, so contention could pick either), plus the variant's own ``--set``s. Then ``msn-export``, ``msn-eval knn``
(kNN-20) and ``msn-eval lowshot --shots 5`` for the bundle, and the same two for raw pixels once, as other_folders.py
does. From each run's ``metrics.jsonl``: the loss, target entropy and mean max target probability of the first and last
logged records. Steps whose outputs exist are skipped. Nothing here is timed.

Before each pretraining run the script waits while ``/tmp/msn_machine_busy`` exists (a shared machine's flag).
The table goes to stdout and ``runs/digit_stall/<data>-<steps>.json`` (rows of earlier invocations kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.training.other_folders import write_folders
from benchmarks.training.steps import eval_step, export_step, pretrain_step, print_plan, run_steps, set_args
from msn_core.durable import atomic_write_json

BUSY = Path("/tmp/msn_machine_busy")
ROOT = REPO / "runs" / "digit_stall"

# one change at a time against the plan (whose values are in benchmarks/results/other_folders-10m.json)
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "protos256": {"model.num_prototypes": 256},
    "protos64": {"model.num_prototypes": 64},
    "sharpen0.1": {"loss.sharpen_start": 0.1, "loss.sharpen_end": 0.1},
    "crop0.6": {"mask.rand_crop_scale": [0.6, 1.0]},
    "noflip": {"augment.flip_p": 0.0},
    "mask0.15": {"mask.ratio": 0.15},
    "lr_x2": {"optim.lr": 5e-4},
    "lr_x4": {"optim.lr": 1e-3},
    "ema0.996": {"optim.ema_start": 0.996},
    "ema0.98": {"optim.ema_start": 0.98},
}
# combinations: views that keep more of a low-resolution glyph
PHOTOMETRIC_OFF = {"augment.color_jitter_p": 0.0, "augment.grayscale_p": 0.0, "augment.blur_p": 0.0}
EASY_VIEWS = {**PHOTOMETRIC_OFF, "mask.rand_crop_scale": [0.6, 1.0], "mask.ratio": 0.15}
VARIANTS |= {
    "photometric_off": PHOTOMETRIC_OFF,
    "easy_views": EASY_VIEWS,
    "easy_views_sharp": {**EASY_VIEWS, "loss.sharpen_start": 0.1, "loss.sharpen_end": 0.1},
    "larger_views": {"mask.rand_crop_scale": [0.6, 1.0], "mask.ratio": 0.15},  # easy_views, photometric kept
    "easy_views_lr_x2": {**EASY_VIEWS, "optim.lr": 5e-4},
    "easy_views_noflip": {**EASY_VIEWS, "augment.flip_p": 0.0},
    # glyphs: views whose grey levels say nothing about the image's own (its background and ink levels vary)
    "strong_jitter": {"augment.color_jitter_p": 1.0, "augment.color_jitter_strength": 1.0},
    "levels": {"augment.levels_p": 1.0},
    "levels_shape_larger": {"augment.levels_p": 1.0, "augment.affine_p": 0.8, "augment.stroke_p": 0.8,
                            "mask.rand_crop_scale": [0.6, 1.0], "mask.ratio": 0.15},
    "levels_shape_easy": {**EASY_VIEWS, "augment.levels_p": 1.0, "augment.affine_p": 0.8, "augment.stroke_p": 0.8},
    # digits: the plan's views (EASY_VIEWS) with the glyphs' pose and stroke jitter
    "easy_views_shape": {**EASY_VIEWS, "augment.affine_p": 0.8, "augment.stroke_p": 0.8},
    # glyphs: views that vary what varies within a class (pose and stroke width), not only crops
    "shape_jitter": {"augment.affine_p": 0.8, "augment.stroke_p": 0.8},
    "shape_jitter_larger": {"augment.affine_p": 0.8, "augment.stroke_p": 0.8, "mask.rand_crop_scale": [0.6, 1.0],
                            "mask.ratio": 0.15},
    # the views of the plan before it read the images' detail (the 32-px digits now plan EASY_VIEWS)
    "official_views": {"mask.rand_crop_scale": [0.3, 1.0], "mask.ratio": 0.3, "augment.color_jitter_p": 0.8,
                       "augment.grayscale_p": 0.2, "augment.blur_p": 0.5},
}


def data_args(data: str) -> tuple[str, str]:
    """``(pretrain --data, msn-eval --data)`` for ``digits32``/``digits8``, ``glyphs`` or ``fashion-mnist``."""
    if data == "fashion-mnist":
        return "fashion-mnist", "fashion-mnist"
    if data == "glyphs":  # benchmarks/training/glyph_folders.py's rendered digits, 16, 28 and 32 px mixed
        from benchmarks.training.glyph_folders import SIZES, data_dir, write_glyph_folders

        work = data_dir(REPO / "runs" / "glyph_folders", SIZES)
        write_glyph_folders(work, SIZES)
        return str(work / "flat"), str(work / "labelled")
    work = ROOT / data
    write_folders(work, int(data.removeprefix("digits")))
    return str(work / "flat"), str(work / "labelled")


def wait_for_machine() -> None:
    while BUSY.exists():
        time.sleep(20)


def variant_steps(work: Path, name: str, overrides: dict, steps: int, data: str, splits: int,
                  stop_at: int | None = None) -> list:
    pretrain_data, eval_data = data_args(data)
    run_dir = work / "run"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node=1", "training/pretrain.py", "--data", pretrain_data,
               "--output-dir", str(run_dir), *set_args({"optim.total_steps": steps, "run.max_steps": stop_at or steps,
                                                        "run.progress_bar": False, "run.precision": "fp32",
                                                        **overrides})]
    length = f"{steps} steps" if stop_at is None else f"first {stop_at} of {steps} steps"
    pretrain = pretrain_step(f"pretrain {name} ({length})", command, run_dir, log=work / "pretrain.log")
    action = pretrain.action
    pretrain.action = lambda: (wait_for_machine(), action())
    return [pretrain, export_step(work, run_dir / "checkpoint.pt", "msn"),
            eval_step(work, "msn", "knn", [], data=eval_data),
            eval_step(work, "msn", "lowshot", ["--shots", "5", "--splits", str(splits)], tag=f"lowshot{splits}",
                      data=eval_data)]


def pixel_steps(work: Path, bundle_work: Path, data: str, splits: int) -> list:
    """Raw pixels under the baseline bundle's preprocessing (``--backend pixels``)."""
    _, eval_data = data_args(data)
    steps = []
    for command, args, tag in (("knn", [], "knn"), ("lowshot", ["--shots", "5", "--splits", str(splits)],
                                                     f"lowshot{splits}")):
        step = eval_step(work, "pixels", command, [*args, "--backend", "pixels"], tag=tag, data=eval_data)
        step.command = [a.replace(str(work / "bundles"), str(bundle_work / "bundles")) for a in step.command]
        argv = step.command[1:]

        def run(argv=argv) -> None:
            from training.evaluation.cli import main

            main(argv)

        step.action = run
        steps.append(step)
    return steps


def summarize(work: Path, splits: int) -> dict:
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    first, last = logged[0], logged[-1]
    out = {"steps": last.get("step"), "loss_start": first["loss"], "loss_end": last["loss"],
           "target_entropy_start": first.get("target_entropy"), "target_entropy_end": last.get("target_entropy"),
           "target_max_prob_end": last.get("target_max_prob"),
           "used_prototypes_end": last.get("num_used_prototypes"),
           "collapse": any(r.get("collapse") for r in records), "stall": next((r["stall"] for r in records
                                                                              if r.get("stall")), None)}
    for tag, key in (("knn", "knn"), (f"lowshot{splits}", "5shot")):
        path = work / "evals" / f"msn-{tag}.json"
        if path.is_file():
            results = json.loads(path.read_text())["results"]
            out[key] = results[0].get("top1") if key == "knn" else results[0]["mean"]
            if key == "5shot":
                out["5shot_std"] = results[0].get("std")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="optimiser steps per run (equal for every variant)")
    parser.add_argument("--data", default="digits32", help="digits32, digits8, glyphs or fashion-mnist")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"of {', '.join(VARIANTS)}, "
                        "candidate (every change in --candidate), or NAME=KEY=VALUE,KEY=VALUE")
    parser.add_argument("--candidate", default="", help="overrides of the 'candidate' variant: KEY=VALUE,KEY=VALUE "
                        "(values as JSON)")
    parser.add_argument("--stop-at", type=int, help="stop each run at this step of the --steps schedule (a screen: "
                        "the first steps of the full run, bit for bit, to compare with the baseline's logged records)")
    parser.add_argument("--splits", type=int, default=1, choices=(1, 2, 3), help="5-shot splits")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    def parse(spec: str) -> dict:
        return {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv)}

    variants = {}
    for v in args.variants:
        if v == "candidate":
            variants[v] = parse(args.candidate)
        elif "=" in v:
            name, spec = v.split("=", 1)
            variants[name] = parse(spec)
        else:
            variants[v] = VARIANTS[v]
    stop = "" if args.stop_at is None else f"-stop{args.stop_at}"
    base = ROOT / f"{args.data}-{args.steps}{stop}"
    plans = {name: variant_steps(base / name, name, o, args.steps, args.data, args.splits, args.stop_at)
             for name, o in variants.items()}
    ref = next(iter(plans))
    plans["pixels"] = pixel_steps(base / "pixels", base / ref, args.data, args.splits)
    if args.dry_run:
        for steps in plans.values():
            print_plan(steps)
        return 0
    for name, steps in plans.items():
        run_steps(steps, base / name)
        if name != "pixels":
            print(name, json.dumps(summarize(base / name, args.splits)), flush=True)
    rows = {name: summarize(base / name, args.splits) for name in variants}
    pix = {}
    for tag, key in (("knn", "knn"), (f"lowshot{args.splits}", "5shot")):
        results = json.loads((base / "pixels" / "evals" / f"pixels-{tag}.json").read_text())["results"]
        pix[key] = results[0].get("top1") if key == "knn" else results[0]["mean"]
    path = base.with_suffix(".json")
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    if earlier.get("splits") == args.splits:  # the variants run before stay in the table; a rerun replaces its row
        variants, rows = earlier["variants"] | variants, earlier["rows"] | rows
    report = {"data": args.data, "steps": args.steps, "splits": args.splits, "variants": variants, "rows": rows,
              "pixels": pix}
    atomic_write_json(path, report)
    print(f"{'variant':12s} {'loss':>13s} {'H_t end':>7s} {'pmax':>6s} {'kNN-20':>6s} {'5-shot':>6s}")
    for name, r in rows.items():
        print(f"{name:12s} {r['loss_start']:6.2f}->{r['loss_end']:5.2f} {r['target_entropy_end']:7.2f} "
              f"{r['target_max_prob_end']:6.3f} {r.get('knn', float('nan')):6.2f} {r.get('5shot', float('nan')):6.2f}")
    print(f"{'pixels':12s} {'':13s} {'':7s} {'':6s} {pix['knn']:6.2f} {pix['5shot']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
