"""Pretraining throughput on one GPU, this project beside the official facebookresearch/msn step, side by side.

Same GPU, batch (64 per GPU) and views (one 224 px anchor with patch drop 0.15 as the official recipe, 10 focal
views at 96 px, one 224 px target), ViT-S/16, fp32 and bf16. Ours is the real trainer (``training/pretrain.py``
through :mod:`benchmarks.training.train_throughput`: synthetic images, augmentation on the GPU inside the step,
images/s from its metrics); the official one is its own step code (:mod:`benchmarks.gpu.official_step`: views
already on the GPU, its data pipeline excluded as its own step timer excludes it; bf16 by our autocast wrapper,
the official code has none). MFU = model FLOPs per image (counted on our step) x images/s / the bf16 matrix
product peak measured in the same run; the fp32 rows also against the fp32 (TF32-off) peak.

    python -m benchmarks.gpu.training --official /tmp/msn-gpu/payload/official_msn --out training.json
    python -m benchmarks.gpu.training --quick --device cpu --out /tmp/t.json      # dry run: tiny, on the CPU
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
from benchmarks.training.train_throughput import (
    COMMON,
    PRESETS,
    matmul_ceiling,
    run_once,
    split_preset,
    step_flops,
)

QUICK_CPU = ["model.arch=vit_tiny", "model.patch_size=16", "model.image_size=64", "mask.focal_size=32",
             "mask.num_focal=2", "data.load_size=64", "data.batch_size=2", "data.num_workers=0",
             "run.max_steps=3", "run.log_every_steps=1", "run.device=cpu"]


def ours(overrides: list[str], precision: str) -> dict:
    config, items = split_preset(overrides)
    items = items + ["mask.ratio=0.15", f"run.precision={precision}"]
    with tempfile.TemporaryDirectory() as tmp:
        row = run_once(config, items, Path(tmp))
    flops, batch = step_flops(config, items)
    return {"implementation": "ours", "precision": precision, "batch": batch, **row,
            "gflop_per_image": flops / batch / 1e9}


def official(root: Path, device: str, precision: str, quick: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu.official_step", "--official", str(root), "--device", device,
           "--precision", precision]
    cmd += ["--model", "deit_tiny", "--batch", "2", "--focal", "2", "--steps", "1", "--warmup", "1"] if quick else []
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
    ap.add_argument("--max-steps", type=int, default=40, help="our trainer's steps per row (GPU)")
    a = ap.parse_args(argv)
    overrides = QUICK_CPU if a.quick else PRESETS["gpu-s16"] + [f"run.max_steps={a.max_steps}"]
    result: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "overrides": overrides,
                    "common": COMMON, "ceilings_gflops": {}, "rows": []}
    sizes = (256, 512) if a.quick else None
    for p in ("bf16", "fp32"):
        result["ceilings_gflops"][p] = matmul_ceiling(a.device, p, sizes, 0.2 if a.quick else 1.0) / 1e9
    save_json(a.out, result)
    for precision in a.precisions:
        rows = [ours(overrides, precision)]
        if a.official is None or not (a.official / "src").is_dir():
            rows.append({"implementation": "official", "precision": precision,
                         "skipped": "no official sources (python -m benchmarks.gpu.pack puts them in the payload)"})
        else:
            rows.append(official(a.official, a.device, precision, a.quick, a.timeout))
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
