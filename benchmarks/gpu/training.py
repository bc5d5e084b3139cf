"""Pretraining throughput on one GPU, this project beside the official facebookresearch/msn step, side by side.

Same GPU, batch (64 per GPU) and views (one 224 px anchor with patch drop 0.15 as the official recipe, 10 focal
views at 96 px, one 224 px target), ViT-S/16, fp32 and bf16. Ours is the real trainer (``training/pretrain.py``
through :mod:`benchmarks.training.train_throughput`: synthetic images, augmentation on the GPU inside the step,
images/s from its metrics); the official one is its own step code (:mod:`benchmarks.gpu.official_step`: views
already on the GPU, its data pipeline excluded as its own step timer excludes it; bf16 by our autocast wrapper,
the official code has none). MFU = model FLOPs per image (counted on our step) x images/s / the bf16 matrix
product peak measured in the same run; the fp32 rows also against the fp32 (TF32-off) peak.

``breakdown`` (per precision, :mod:`benchmarks.training.step_breakdown`) splits our step into the whole step,
the step on views made beforehand (what the official row times) and the augmentation alone, with syncs per step
and a profiler trace on CUDA (``<out stem>-profile/``): the like-for-like ratio is ``step_on_views`` against the
official step.

    python -m benchmarks.gpu.training --official /tmp/msn-gpu/payload/official_msn --out training.json
    python -m benchmarks.gpu.training --device cpu --batch 8 --steps 4 --official DIR --out /tmp/t.json  # real model
    python -m benchmarks.gpu.training --quick --device cpu --out /tmp/t.json      # dry run: tiny, on the CPU
    python -m benchmarks.gpu.training --device cpu --batch 16 --steps 4 --cpu-attention auto explicit sdpa ...

``--cpu-attention`` (a CPU in bf16; fp32 attention is SDPA): rows with each named kernel (``run.cpu_attention``).
``auto`` first runs the trainer's own timing pass on this pairing (:mod:`benchmarks.training.speed_choice`; threads
kept at torch's default, so only the kernel is timed) and measures the rows with the kernel it chose; its record
is ``speed_timing`` in the JSON. A kernel already measured is not measured again.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, machine, save_json
from benchmarks.training.speed_choice import speed_choice
from benchmarks.training.step_breakdown import for_device, measure
from benchmarks.training.train_throughput import COMMON, PRESETS, matmul_ceiling, run_once, split_preset

# The dry run's model and run: every part the GPU run uses (views, focal masks, head, prototypes, both probes), each
# as small as it goes. One thread: the suite's workers share a small machine's cores, where torch's second thread
# would spin waiting for a core and multiply the CPU time.
QUICK_CPU = ["model.arch=vit_tiny", "model.patch_size=16", "model.image_size=64", "mask.focal_size=32",
             "mask.num_focal=2", "data.load_size=64", "data.batch_size=2", "data.num_workers=0",
             "model.depth=2", "model.head_hidden_dim=256", "model.head_out_dim=64", "model.num_prototypes=128",
             "run.probe_images=96", "run.view_probe_images=16", "run.cpu_threads=1",
             "run.max_steps=3", "run.log_every_steps=1", "run.device=cpu"]


def ours(overrides: list[str], precision: str, steps: int, warmup: int, profile_dir: Path, quick: bool,
         profile: bool, extra: list[str] = ()) -> tuple[dict, dict]:
    """The trainer's row (a child process, data loading and logging included) and the in-process breakdown
    (profiled when ``profile``: one precision is enough, a CUDA trace is large and the profiler slow)."""
    config, items = split_preset(overrides)
    items = items + ["mask.ratio=0.15", f"run.precision={precision}", *extra]
    with tempfile.TemporaryDirectory() as tmp:
        row = run_once(config, items, Path(tmp))
    parts = measure(config, items, steps=steps, warmup=warmup, out=profile_dir, tag=precision,
                    profile_steps=(1 if quick else 2) if profile else 0, sync_steps=1 if quick else 2)
    row = {"implementation": "ours", "precision": precision, "batch": parts["batch"], **row,
           "gflop_per_image": parts["gflop_per_image"]}
    return row, parts


def official(root: Path, device: str, precision: str, quick: bool, timeout: float, batch: int, steps: int,
             warmup: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu.official_step", "--official", str(root), "--device", device,
           "--precision", precision]
    if quick:
        cmd += ["--model", "deit_tiny", "--batch", "2", "--focal", "2", "--steps", "1", "--warmup", "1"]
    else:
        cmd += ["--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        return {"implementation": "official", "precision": precision, "error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--official", type=Path, help="folder with the official src/ (absent: official rows skipped)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU: proves the harness")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for each official run")
    ap.add_argument("--steps", "--max-steps", type=int, default=40,
                    help="our trainer's steps per row; timed steps of the official row and of each breakdown "
                         "phase: the smaller of this and 30 / 10 (a few on a CPU: ViT-S/16 takes seconds a step)")
    ap.add_argument("--batch", type=int, default=64, help="per-process batch, ours and the official alike")
    ap.add_argument("--cpu-attention", nargs="+", choices=["auto", "explicit", "sdpa"], default=["auto"],
                    help="bf16 attention kernels on a CPU, a row each (auto: the trainer's timing picks)")
    a = ap.parse_args(argv)
    import torch  # after the arguments: --help needs no torch
    timed = 1 if a.quick else min(a.steps, 10)  # breakdown calls per phase
    warmup = 1 if a.quick else min(3, max(1, a.steps // 4))
    if a.quick:
        overrides = QUICK_CPU
    else:
        log_every = max(1, min(10, a.steps // 4))  # several logged windows, the first (warm-up) left out
        overrides = for_device(PRESETS["gpu-s16"], a.device, a.batch) + [f"run.max_steps={a.steps}",
                                                                           f"run.log_every_steps={log_every}"]
    profile_dir = a.out.with_name(a.out.stem + "-profile")
    result: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "overrides": overrides,
                    "common": COMMON, "ceilings_gflops": {}, "rows": [], "breakdown": {}, "speed_timing": {}}
    if a.quick:
        torch.set_num_threads(1)  # as QUICK_CPU's run.cpu_threads
    sizes = (128, 256) if a.quick else None
    for p in ("bf16", "fp32"):
        result["ceilings_gflops"][p] = matmul_ceiling(a.device, p, sizes, 0.05 if a.quick else 1.0) / 1e9
    save_json(a.out, result)
    for precision in a.precisions:
        kernels = a.cpu_attention if a.device == "cpu" and precision == "bf16" else ["sdpa"]  # fp32: always SDPA
        measured: set[str] = set()
        for kernel in kernels:
            label = kernel
            if kernel == "auto":
                config, items = split_preset(overrides)
                timing = speed_choice(config, [*items, "mask.ratio=0.15", f"run.precision={precision}",
                                               f"run.cpu_threads={torch.get_num_threads()}"])
                result["speed_timing"][precision] = timing
                print(json.dumps({"speed_timing": precision, **timing}), flush=True)
                kernel = timing["chosen"]["run.cpu_attention"]
                label = f"auto: {kernel}"
            if kernel in measured:
                continue
            measured.add(kernel)
            several = a.device == "cpu" and precision == "bf16" and len(kernels) > 1  # one row per kernel
            key = f"{precision} {kernel}" if several else precision
            extra = [f"run.cpu_attention={kernel}"] if a.device == "cpu" and precision == "bf16" else []
            row, parts = ours(overrides, precision, timed, warmup, profile_dir, a.quick,
                              precision == a.precisions[0] and len(measured) == 1, extra)
            row.update(key=key, cpu_attention=label)
            rows = [row]
            if a.official is None or not (a.official / "src").is_dir():
                rows.append({"implementation": "official", "precision": precision,
                             "skipped": "no official sources (python -m benchmarks.gpu.pack puts them in the payload)"})
            else:
                rows.append(official(a.official, a.device, precision, a.quick, a.timeout, a.batch,
                                     min(a.steps, 30), warmup if a.steps < 30 else 5))
            rows[1]["key"] = key
            if "step_s_median" in rows[1]:  # like for like: both steps on views already made
                parts["official_s_per_step"] = rows[1]["step_s_median"]
                parts["speedup_on_views_vs_official"] = rows[1]["step_s_median"] / parts["phases"]["step_on_views"][
                    "s_per_step"]
            parts["cpu_attention"] = label
            result["breakdown"][key] = parts
            print(json.dumps({"breakdown": key, **{k: v["s_per_step"] for k, v in parts["phases"].items()},
                              "syncs_per_step": parts.get("syncs_per_step")}), flush=True)
            flops = rows[0]["gflop_per_image"]
            for row in rows:
                if "images_per_sec" in row:
                    achieved = flops * row["images_per_sec"]
                    row["achieved_gflops"] = achieved
                    row["mfu_vs_bf16_peak"] = achieved / result["ceilings_gflops"]["bf16"]
                    row["mfu_vs_own_precision_peak"] = achieved / result["ceilings_gflops"][precision]
                print(json.dumps(row), flush=True)
            if all("images_per_sec" in r for r in rows):
                rows[0]["speedup_vs_official"] = rows[0]["images_per_sec"] / rows[1]["images_per_sec"]
            result["rows"] += rows
            save_json(a.out, result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
