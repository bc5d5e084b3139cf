"""ViT-S/16 at 224 px: every runtime and precision msn-serve offers, offline and over HTTP, side by side in one run.

The bundle is the official ViT-S/16 architecture (384 wide, 12 blocks, 6 heads, 196 patches) with **random
weights** (speed does not depend on them; the accuracy gates then compare random features, which is a harder test
for int8 than trained ones), exported by ``export_bundle`` as ``msn-export`` does, with a guarded int8 graph
(``--int8-method``, QDQ by default: the one both ONNX Runtime and OpenVINO run).

- ``offline``: images/s at each batch of ``--batches`` with every core, runs interleaved in rounds so that a busy
  machine slows all alike: torch eager fp32 and bf16 autocast (the reference ceiling, not a serving option: the
  serve image has no torch), ONNX Runtime fp32 / int8 (the bundle's graph, plus the other quantization methods
  unguarded, for comparison), OpenVINO fp32 / bf16 / int8 where this CPU and install allow. Then what
  ``msn-serve --precision auto`` chooses here (:func:`msn_serve.embedding.choice.choose_engine`) and how it
  compares with torch bf16.
- ``http``: a real ``msn-serve`` (``--precision auto``) under 1, 16 and 64 single-image clients (JPEGs, decode and
  preprocessing included, :mod:`benchmarks.serving.http_load`), beside the same engine's offline rate with decode and
  preprocessing in-process (:func:`benchmarks.serving.serve_bench.offline`), interleaved; p50/p99 against the bound
  max-wait + 2 batch times.

    python -m benchmarks.serving.vits_bench           # ~10 min on 2 cores
    python -m benchmarks.serving.vits_bench --quick   # tiny sizes: proves the harness, numbers mean nothing
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving.serve_bench import load, offline
from benchmarks.serving.serve_harness import pct, start_server, test_images

IMAGENET = {"resize": 256, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
            "channels": 3, "interpolation": "bicubic"}
OUT = REPO / "benchmarks" / "results" / "vits_bench.json"


def make_bundle(out: Path, *, quick: bool, int8_method: str, guard_images: int) -> Path:
    import torch

    from training.bundle.export import add_int8, export_bundle
    from training.bundle.quantize import QuantizeOptions
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    size, arch = (32, {"patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}) if quick else \
        (224, {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 6})
    encoder = VisionTransformer(image_size=size, **arch)
    pre = {**IMAGENET, "resize": size * 8 // 7, "crop": size}
    t0 = time.perf_counter()
    export_bundle(encoder, out, arch="vit_tiny" if quick else "vit_small", preprocessing=pre, parity_check=False)
    add_int8(out, QuantizeOptions(method=int8_method, data="synthetic", calibration_images=64,
                                  guard_images=guard_images, synthetic_size=max(512, guard_images * 2),
                                  speed_seconds=1.0))
    print(f"bundle: {out} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out


class TorchReference:
    """The bundle's trunk in torch eager, fp32 or bf16 autocast, reading the bundle's feature as the graph does."""

    runtime = "torch"

    def __init__(self, bundle: Path, precision: str, threads: int):
        import torch

        from msn_core.bundle import load_bundle_info
        from training.model.load import load_encoder
        from training.model.readout import feature_spec
        torch.set_num_threads(threads)
        self.info, self.precision = load_bundle_info(bundle), precision
        self.encoder, _ = load_encoder(bundle)
        self.encoder.eval()
        self.spec = feature_spec(self.encoder, self.info.feature)

    def run(self, pixels: np.ndarray, keep: np.ndarray) -> np.ndarray:
        import torch

        from training.model.readout import read_feature
        keep_t = torch.from_numpy(keep)
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=self.precision == "bf16"):
            out = read_feature(self.encoder, self.spec, torch.from_numpy(pixels), keep_t, keep_t >= 0)
        return out.float().numpy()


def timed_rounds(runners: dict, pixels: np.ndarray, keep: np.ndarray, rounds: int, runs: int) -> dict:
    """Seconds of each run of each runner, ``runs`` in a row per runner, the runners interleaved over ``rounds``."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            for _ in range(runs):
                t0 = time.perf_counter()
                runner.run(pixels, keep)
                times[name].append(time.perf_counter() - t0)
    return times


def torch_reference(bundle: str, threads: int, batches: list[int], rounds: int, runs: int) -> dict:
    """Torch eager fp32 and bf16 timed in a fresh process of their own (run through ``spawn``): in the process that
    had quantized and compiled the other engines, bf16 autocast returned features unrelated to fp32's (cosine ~0)
    while a clean process agrees to 0.99995, so the reference is measured the way a user would run it."""
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.choice import probe_inputs

    info = load_bundle_info(bundle)
    refs = {f"torch/{p}": TorchReference(Path(bundle), p, threads) for p in ("fp32", "bf16")}
    out: dict = {}
    for batch in batches:
        pixels, keep = probe_inputs(info, batch)[0]
        outputs = {name: ref.run(pixels, keep) for name, ref in refs.items()}  # warm-up, kept for the cosine
        times = timed_rounds(refs, pixels, keep, rounds, runs)
        out[str(batch)] = {name: {"times": times[name], "output": outputs[name]} for name in refs}
    return out


def engines(bundle: Path, threads: int, tmp: Path) -> tuple[dict, dict]:
    """Every runtime/precision that runs here (name -> engine), and the ones that do not (name -> why)."""
    from msn_core.bundle import INT8_METHODS, load_bundle_info
    from msn_core.hardware import cpu_info
    from msn_serve.embedding.choice import Request, build_engine, plan
    from msn_serve.embedding.engine import Engine
    from training.bundle.int8_guard import guard_data
    from training.bundle.quantize import calibration_feeds, quantize_graph

    info = load_bundle_info(bundle)
    candidates, excluded = plan(info, Request(threads=threads), cpu_info())
    out: dict = {}
    for c in candidates:
        out[c.name if c.precision != "int8" else f"{c.name}-{info.int8.method}"] = build_engine(c, info, threads)
    # The other ORT quantization methods, unguarded: what the export's method choice chose between.
    data = guard_data("synthetic", None, info.preprocessing.resize, calibration_images=64, guard_images=1,
                      synthetic_size=512)
    feeds = calibration_feeds(bundle, data)
    for method in INT8_METHODS:
        if method != info.int8.method:
            copy = tmp / f"int8-{method}"
            shutil.copytree(bundle, copy)
            quantize_graph(info.onnx_path, copy / info.int8.file, method, feeds)
            out[f"onnxruntime/int8-{method} (unguarded)"] = Engine(load_bundle_info(copy), intra_op_threads=threads,
                                                                   precision="int8")
    return out, excluded


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def offline_section(bundle: Path, threads: int, batches: list[int], rounds: int, runs: int, tmp: Path) -> dict:
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.choice import Request, choose_engine, probe_inputs

    info = load_bundle_info(bundle)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        torch_runs = pool.submit(torch_reference, str(bundle), threads, batches, rounds, runs).result()
    table, excluded = engines(bundle, threads, tmp)
    result: dict = {"threads": threads, "tokens": info.num_patches, "excluded": excluded, "batches": {},
                    "torch_reference": "timed in its own process, before the others"}
    for batch in batches:
        pixels, keep = probe_inputs(info, batch)[0]
        reference = table["onnxruntime/fp32"].run(pixels, keep).astype(np.float64)
        times: dict[str, list[float]] = {name: r["times"] for name, r in torch_runs[str(batch)].items()}
        cosine = {name: _min_cosine(reference, r["output"]) for name, r in torch_runs[str(batch)].items()}
        for name, engine in table.items():  # warm-up, and each output against ORT fp32
            cosine[name] = _min_cosine(reference, engine.run(pixels, keep))
        times.update(timed_rounds(table, pixels, keep, rounds, runs))
        rows = {name: {"images_per_s": round(batch / float(np.median(t)), 2), "ms_p50": round(1e3 * pct(t, 50), 1),
                       "cosine_min_vs_ort_fp32": round(cosine[name], 5)} for name, t in times.items()}
        result["batches"][str(batch)] = rows
        print(f"offline batch {batch}:", json.dumps(rows), flush=True)
    engine, choice = choose_engine(info, Request(threads=threads))
    chosen = f"{choice.runtime}/{choice.precision}" + (f"-{info.int8.method}" if choice.precision == "int8" else "")
    result["auto"] = {"choice": choice.describe(), "served": chosen}
    for batch, rows in result["batches"].items():
        served, ceiling = rows[chosen]["images_per_s"], rows["torch/bf16"]["images_per_s"]
        result["auto"][f"batch{batch}"] = {"served_images_per_s": served, "torch_bf16_images_per_s": ceiling,
                                           "served_vs_torch_bf16": round(served / ceiling, 3),
                                           "served_vs_ort_fp32": round(served / rows["onnxruntime/fp32"]
                                                                       ["images_per_s"], 3)}
    print("auto:", json.dumps(result["auto"]), flush=True)
    return result


def http_section(bundle: Path, threads: int, batch: int, wait_ms: float, per_client: int, procs: int,
                 tmp: Path) -> dict:
    import httpx

    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.choice import Candidate, build_engine

    images = test_images(16)
    proc, url = start_server(bundle, tmp / "data", ["--max-batch-size", str(batch), "--max-wait-ms", str(wait_ms),
                                                    "--intra-op-threads", str(threads), "--queue-size", "4096"])
    try:
        choice = httpx.get(f"{url}/readyz", timeout=10).json()["runtime_choice"]
        engine = build_engine(Candidate(choice["runtime"], choice["precision"]), load_bundle_info(bundle), threads)
        total = max(64, 2 * batch)

        def off() -> dict:
            r = offline(bundle, images, batch, threads, total, engine=engine)
            print("offline:", json.dumps(r), flush=True)
            return r

        def http(c: int) -> dict:
            r = load(url, images, c, max(c * per_client, 20), [None], procs, server_pid=proc.pid)
            print(f"http {c} clients:", json.dumps(r), flush=True)
            return r

        runs = [http(1), http(16)]
        offs = [off()]
        runs.append(http(64))
        offs.append(off())
    finally:
        proc.terminate()
        proc.wait(30)
    offline_rate = float(np.mean([o["images_per_s"] for o in offs]))
    batch_ms = float(np.mean([o["batch_ms"] for o in offs]))
    at64 = runs[-1]
    return {"served": f"{choice['runtime']}/{choice['precision']}", "batch": batch, "max_wait_ms": wait_ms,
            "clients": runs, "offline": offs, "offline_images_per_s": round(offline_rate, 2),
            "http64_vs_offline": round(at64["images_per_s"] / offline_rate, 3), "target_ratio": 0.9,
            "p99_ms_64": at64["p99_ms"], "p99_bound_ms": round(wait_ms + 2 * batch_ms, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--quick", action="store_true", help="a tiny random bundle: seconds; numbers mean nothing")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="offline batch sizes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the offline timing")
    ap.add_argument("--runs", type=int, default=3, help="runs per engine per round")
    ap.add_argument("--int8-method", default="qdq", choices=["auto", "dynamic", "static", "qdq"])
    ap.add_argument("--guard-images", type=int, default=256, help="held-out images of the int8 guard")
    ap.add_argument("--http-batch", type=int, default=32, help="the server's --max-batch-size")
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--per-client", type=int, default=6, help="requests per client at each concurrency")
    ap.add_argument("--client-procs", type=int, default=2, help="load-generator processes")
    ap.add_argument("--bundle", type=Path, help="measure this bundle instead (a copy gets a QDQ int8 graph if it "
                    "has none); e.g. the demo's")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--note", default="", help="how the machine was shared (recorded in the JSON)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="msn-vits-"))
    try:
        from msn_core.bundle import load_bundle_info
        if a.bundle is not None:
            bundle = tmp / "bundle"
            shutil.copytree(a.bundle, bundle)
            if load_bundle_info(bundle).int8 is None:
                from training.bundle.export import add_int8
                from training.bundle.quantize import QuantizeOptions
                add_int8(bundle, QuantizeOptions(method=a.int8_method, guard_images=a.guard_images))
            info = load_bundle_info(bundle)
            model = f"{a.bundle.name} ({info.architecture.name}, {info.image_size} px, feature {info.feature})"
        else:
            bundle = make_bundle(tmp / "bundle", quick=a.quick, int8_method=a.int8_method,
                                 guard_images=a.guard_images)
            model = "tiny (--quick)" if a.quick else "ViT-S/16 224px, random weights"
        result: dict = {"machine": machine(), "model": model, "note": a.note,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        int8 = load_bundle_info(bundle).int8
        result["int8_guard"] = {"method": int8.method, "cosine_min": int8.guard["cosine"]["min"],
                                "cosine_masked_min": int8.guard["cosine_masked"]["min"],
                                "lowshot": int8.guard["lowshot"], "passed": int8.guard["passed"],
                                "heldout_images": int8.guard["data"]["heldout_images"]}
        result["offline"] = offline_section(bundle, a.threads, [2] if a.quick else a.batches,
                                            1 if a.quick else a.rounds, 2 if a.quick else a.runs, tmp)
        if not a.skip_http:
            result["http"] = http_section(bundle, a.threads, a.http_batch, a.max_wait_ms,
                                          2 if a.quick else a.per_client, a.client_procs, tmp)
            print("http:", json.dumps({k: v for k, v in result["http"].items() if k not in ("clients", "offline")}))
        save_json(a.out, result)
        print(f"wrote {a.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
