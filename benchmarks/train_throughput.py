"""Training throughput and peak memory at different masking ratios (the paper's compute table).

Runs the real trainer (`training/pretrain.py`, synthetic data, `run.max_steps`) once per masking ratio in a fresh
process and reads images/s from its metrics.jsonl (median of the logged windows after warm-up) and the process's
peak memory (CUDA: max allocated; CPU: max resident set). Each ratio is measured twice: the full MSN step (masked
anchor + focal views + target) and the anchor branch alone (no focal views), where the saving from dropped
tokens shows undiluted.

    python benchmarks/train_throughput.py --preset cpu-small            # what docs/benchmarks.md reports on CPU
    python benchmarks/train_throughput.py --preset gpu-s16 --preset gpu-l7   # on a GPU machine

Writes JSON (default benchmarks/results/train_throughput-<preset>.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PRESETS: dict[str, list[str]] = {
    # ViT-tiny/4 on 32 px images (64 patches, 12 blocks): the transformer dominates the step even on 2 CPU cores.
    "cpu-small": ["model.arch=vit_tiny", "model.patch_size=4", "model.image_size=32",
                  "mask.focal_size=16", "mask.num_focal=4", "data.load_size=32", "data.batch_size=32",
                  "data.num_workers=1", "run.max_steps=25", "run.log_every_steps=5", "run.device=cpu"],
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


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def run_once(overrides: list[str], workdir: Path) -> dict:
    """One training run in a child process; returns median images/s and peak memory."""
    cmd = [sys.executable, str(REPO / "training" / "pretrain.py"), "--output-dir", str(workdir)]
    for item in COMMON + overrides:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default cpu-small")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7])
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. what else ran on the machine")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for preset in args.preset or ["cpu-small"]:
        rows = []
        for variant, extra in (("msn", []), ("anchor-only", ["mask.num_focal=0"])):
            for ratio in args.ratios:
                with tempfile.TemporaryDirectory() as tmp:
                    row = run_once(PRESETS[preset] + extra + [f"mask.ratio={ratio}"], Path(tmp))
                row.update(variant=variant, mask_ratio=ratio)
                rows.append(row)
                print(json.dumps(row), flush=True)
        report = {"benchmark": "train_throughput", "preset": preset, "overrides": PRESETS[preset],
                  "machine": machine(), "note": args.note, "rows": rows}
        out = args.out_dir / f"train_throughput-{preset}.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(markdown_table(report))
        print(f"wrote {out}")


def markdown_table(report: dict) -> str:
    lines = ["| variant | mask ratio | images/s | speed-up | peak memory (GB) |", "|---|---|---|---|---|"]
    base = {r["variant"]: r["images_per_sec"] for r in report["rows"] if r["mask_ratio"] == 0.0}
    for r in report["rows"]:
        speedup = r["images_per_sec"] / base[r["variant"]] if r["variant"] in base else float("nan")
        memory = r.get("peak_cuda_gb", r["peak_rss_gb"])
        lines.append(f"| {r['variant']} | {r['mask_ratio']:.1f} | {r['images_per_sec']:.1f} | "
                     f"×{speedup:.2f} | {memory:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
