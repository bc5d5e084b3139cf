"""int8 vs fp32 ONNX Runtime on one bundle: dynamic and static quantization side by side, interleaved in one run.

The bundle's own int8 graph (``msn-export --quantize int8``; made here on a copy if the bundle has none, with the
same accuracy guard) supplies the guard figures; both methods are then quantized afresh from the same calibration
images and timed against the fp32 graph at the same batch and thread count, runs interleaved so that a busy machine
slows all three alike.

    python -m benchmarks.serving.int8_bench --bundle bundles/bench [--threads 2] [--batch 32]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import machine


def run(bundle: Path, *, threads: int, batch: int = 32, guard_images: int = 10_000, seconds: float = 20.0) -> dict:
    from msn_core.bundle import INT8_METHODS, load_bundle_info
    from training.bundle.export import add_int8
    from training.bundle.int8_guard import guard_data
    from training.bundle.quantize import (
        QuantizeOptions,
        calibration_feeds,
        data_source,
        measure_speed,
        quantize_graph,
    )

    tmp = Path(tempfile.mkdtemp(prefix="msn-int8-bench-"))
    try:
        copy = tmp / "bundle"
        shutil.copytree(bundle, copy)
        options = QuantizeOptions(guard_images=guard_images, threads=threads)
        if load_bundle_info(copy).int8 is None:
            print("int8: the bundle has no int8 graph; quantizing a copy (guard included)", flush=True)
            add_int8(copy, options)
        info = load_bundle_info(copy)
        source, root, size = data_source(options, info.extra.get("training"))
        data = guard_data(source, root, info.preprocessing.resize, calibration_images=options.calibration_images,
                          guard_images=1, synthetic_size=size)
        feeds = calibration_feeds(copy, data)
        paths = {"fp32": info.onnx_path}
        for method in INT8_METHODS:
            paths[method] = tmp / f"{method}.onnx"
            quantize_graph(info.onnx_path, paths[method], method, feeds)
        pixels = np.concatenate([f["pixel_values"] for f in feeds])[:batch]
        speed = measure_speed(paths, pixels, info.num_patches, threads=threads, seconds=seconds)
        guard = info.int8.guard
        return {"batch": len(pixels), "threads": threads, "tokens": info.num_patches, "images_per_s": speed,
                "speedup": {m: round(speed[m] / speed["fp32"], 2) for m in INT8_METHODS},
                "bundle_method": info.int8.method, "target_speedup": 2.0,
                "guard": {"cosine_min": guard["cosine"]["min"], "cosine_masked_min": guard["cosine_masked"]["min"],
                          "lowshot": guard["lowshot"], "heldout_images": guard["data"]["heldout_images"],
                          "passed": guard["passed"]}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--guard-images", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    print(json.dumps({"machine": machine(), **run(a.bundle, threads=a.threads, batch=a.batch,
                                                  guard_images=a.guard_images, seconds=a.seconds)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
