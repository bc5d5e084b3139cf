"""Training throughput, achieved FLOP rate and its share of the machine's matrix-multiply ceiling ("MFU").

Each row runs the real trainer (`training/pretrain.py`, synthetic data, `run.max_steps`) in a fresh process and reads
images/s from its metrics.jsonl (median of the logged windows after warm-up) and the peak memory (CUDA: max
allocated; CPU: max resident set). The FLOPs of one step are counted in this process on the same config
(`torch.utils.flop_counter`: matrix multiplies, convolutions and attention, forward and backward, the usual MFU
convention), and the ceiling is the best `torch.mm` rate of the row's precision (fp32, or bf16 where the row trains
under bf16 autocast) measured in the same run with the same thread count. MFU = FLOPs per step x steps per second /
ceiling. `--precisions fp32 bf16` puts both side by side (default: both where the CPU or GPU has native bf16, fp32
alone elsewhere); `--batch-sizes` adds rows at other per-process batches (the learning rate does not change cost).

Each masking ratio is measured for the full MSN step (masked anchor + focal views + target) and the anchor branch
alone (no focal views), where the saving from dropped tokens shows undiluted.

    python -m benchmarks.training.train_throughput --preset cpu-small  # docs/benchmarks.md's masking table
    python -m benchmarks.training.train_throughput --preset cpu-recipe --ratios 0.3  # the small-image recipe's step
    python -m benchmarks.training.train_throughput --preset cpu-recipe --ratios 0.3 --variants msn --batch-sizes 64 256
    python -m benchmarks.training.train_throughput --preset gpu-s16 --preset gpu-l7  # on a GPU machine

Writes JSON (default benchmarks/results/train_throughput-<preset>.json) and prints each row; the table of
docs/benchmarks.md is rendered from it by ``python -m benchmarks.render``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, machine, save_json

PRESETS: dict[str, list[str]] = {
    # ViT-tiny/4 on 32 px images (64 patches, 12 blocks): the transformer dominates the step even on 2 CPU cores.
    "cpu-small": ["model.arch=vit_tiny", "model.patch_size=4", "model.image_size=32",
                  "mask.focal_size=16", "mask.num_focal=4", "data.load_size=32", "data.batch_size=32",
                  "data.num_workers=1", "run.max_steps=25", "run.log_every_steps=5", "run.device=cpu"],
    # The small-image recipe (configs/fmnist_vit_tiny.yaml) as `make demo` trains it, on synthetic 28 px images.
    "cpu-recipe": ["--config", "configs/fmnist_vit_tiny.yaml", "data.load_size=28", "data.num_workers=0",
                   "optim.budget_minutes=null", "run.max_steps=40", "run.log_every_steps=5", "run.device=cpu"],
    # The paper's settings on one GPU: 224 px, 10 focal views at 96 px, bf16 autocast.
    "gpu-s16": ["model.arch=vit_small", "model.patch_size=16", "model.image_size=224", "mask.focal_size=96",
                "mask.num_focal=10", "data.load_size=256", "data.batch_size=64", "data.num_workers=8",
                "run.max_steps=60", "run.log_every_steps=10", "run.device=cuda", "run.precision=bf16"],
    "gpu-l7": ["model.arch=vit_large", "model.patch_size=7", "model.image_size=224", "mask.focal_size=98",
               "mask.num_focal=10", "data.load_size=256", "data.batch_size=32", "data.num_workers=8",
               "run.max_steps=40", "run.log_every_steps=10", "run.device=cuda", "run.precision=bf16"],
}
COMMON = ["data.source=synthetic", "data.synthetic_size=4096", "optim.epochs=100", "run.progress_bar=false",
          "run.checkpoint_every_steps=100000"]


def split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    """A preset's optional ``--config FILE`` and its ``key=value`` overrides."""
    if items[:1] == ["--config"]:
        return items[1], items[2:]
    return None, items


def run_once(config: str | None, overrides: list[str], workdir: Path) -> dict:
    """One training run in a child process; returns median images/s and peak memory."""
    cmd = [sys.executable, "-m", "training.pretrain", "--output-dir", str(workdir)]
    cmd += ["--config", config] if config else []
    for item in COMMON + overrides:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"training run failed:\n{stderr[-2000:]}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["images_per_sec"] for r in records[1:]] or [records[-1]["images_per_sec"]]
    result = {"images_per_sec": statistics.median(steady), "peak_rss_gb": usage.ru_maxrss / 2**20}
    if "max_memory_gb" in records[-1]:
        result["peak_cuda_gb"] = records[-1]["max_memory_gb"]
    return result


def step_flops(config: str | None, overrides: list[str]) -> tuple[float, int]:
    """(FLOPs of one optimiser step, global batch) for the config, counted on one real step in this process."""
    from torch.utils.flop_counter import FlopCounterMode

    from training import distributed as dist
    from training.config import load_config
    from training.run.build import build_run
    from training.run.step import start_hyperparameters, train_step

    cfg = load_config(REPO / config if config else None, COMMON + overrides)
    run = build_run(cfg, dist.init_distributed(cfg.run.device))
    hyper = start_hyperparameters(cfg)  # the step's values do not change its cost
    images = next(iter(run.loader))[0]
    train_step(run, hyper, images)  # warm-up: lazy initialisation must not be counted
    with FlopCounterMode(display=False) as counter:
        train_step(run, hyper, images)
    return float(counter.get_total_flops()), run.global_batch


def matmul_ceiling(device: str, precision: str, sizes: tuple[int, ...] | None = None,
                   seconds: float = 1.0) -> float:
    """Best ``torch.mm`` rate in FLOP/s in ``precision`` over square sizes, with this process's threads.

    A GPU needs large products to leave the launch-bound regime (a 2048^3 product is ~20 us on a Hopper).
    """
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    sizes = sizes or ((2048, 4096, 8192) if device == "cuda" else (512, 1024, 2048))
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, b)
            reps += 1
            if device == "cuda":
                torch.cuda.synchronize()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def default_precisions(device: str) -> list[str]:
    """fp32 and bf16 where bf16 is native (the comparison that matters), fp32 alone where it would be emulated."""
    import torch

    from msn_core.hardware import cpu_info

    native = torch.cuda.is_bf16_supported() if device == "cuda" else cpu_info().bf16_native
    return ["fp32", "bf16"] if native else ["fp32"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default cpu-small")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7])
    parser.add_argument("--variants", nargs="+", choices=("msn", "anchor-only"), default=["msn", "anchor-only"])
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), help="default: see above")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="per-process batches (default: the preset's)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every row, e.g. --set run.compile=true (repeatable)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name (train_throughput-PRESET-TAG.json)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. what else ran on the machine")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for preset in args.preset or ["cpu-small"]:
        config, overrides = split_preset(PRESETS[preset])
        overrides = overrides + args.extra
        device = "cuda" if "run.device=cuda" in overrides else "cpu"
        precisions = args.precisions or default_precisions(device)
        ceilings = {p: matmul_ceiling(device, p) for p in precisions}
        batches = args.batch_sizes or [None]
        rows = []
        for variant in args.variants:
            extra = ["mask.num_focal=0"] if variant == "anchor-only" else []
            for ratio, batch_size, precision in itertools.product(args.ratios, batches, precisions):
                row_overrides = overrides + extra + [f"mask.ratio={ratio}", f"run.precision={precision}"]
                row_overrides += [f"data.batch_size={batch_size}"] if batch_size else []
                with tempfile.TemporaryDirectory() as tmp:
                    row = run_once(config, row_overrides, Path(tmp))
                flops, batch = step_flops(config, row_overrides)
                achieved = flops / batch * row["images_per_sec"]
                ceiling = ceilings[precision]
                row.update(variant=variant, mask_ratio=ratio, precision=precision, batch=batch,
                           gflop_per_image=flops / batch / 1e9, achieved_gflops=achieved / 1e9,
                           ceiling_gflops=ceiling / 1e9, mfu=achieved / ceiling)
                rows.append(row)
                print(json.dumps(row), flush=True)
        report = {"benchmark": "train_throughput", "preset": preset, "config": config, "overrides": overrides,
                  "extra": args.extra,
                  "machine": machine(), "note": args.note, "ceilings_gflops": {p: c / 1e9 for p, c in ceilings.items()},
                  "rows": rows}
        save_json(args.out_dir / f"train_throughput-{preset}{'-' + args.tag if args.tag else ''}.json", report)
    print("docs: python -m benchmarks.render")


if __name__ == "__main__":
    main()
