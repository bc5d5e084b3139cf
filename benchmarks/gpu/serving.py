"""GPU serving of a ViT-S/16 bundle: ONNX Runtime CUDA fp32 / fp16, with and without IOBinding, beside the CPU
provider of the same machine and torch eager on the GPU (the reference ceiling), offline and over HTTP.

The bundle is the official ViT-S/16 architecture at 224 px with **random weights** (speed does not depend on
them), exported as ``msn-export`` does (no int8 graph: the CPU int8 path is not a GPU option).

- ``offline``: images/s per batch of ``--batches``, every runner timed in interleaved rounds (median run):
  ``ort-cuda/fp32`` and ``ort-cuda/fp16`` through :class:`msn_serve.embedding.engine.Engine` (its CUDA path binds
  inputs and output with IOBinding), the same sessions fed by plain ``session.run`` (does IOBinding pay?),
  ``ort-cpu/fp32`` with every core, and ``torch-cuda/fp32`` / ``torch-cuda/bf16`` (autocast) eager forwards of the
  same trunk reading the same feature, host arrays in and out as the engines get them.
- ``http``: a real ``msn-serve --device cuda`` under 1, 16 and 64 single-image clients (JPEG upload, decode and
  preprocessing included) beside the same engine offline: pure inference, and with in-process decode +
  preprocessing (``benchmarks.serving.serve_bench.offline``).

Without a GPU (``--device cpu``, the dry run) the CUDA rows are skipped with the reason and the rest runs on a tiny
bundle, so the script cannot fail on a typo when a GPU is finally lent.

    python -m benchmarks.gpu.serving --out serving.json           # on the GPU machine
    python -m benchmarks.gpu.serving --quick --out /tmp/s.json    # tiny bundle, numbers mean nothing
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import machine, save_json
from benchmarks.serving.vits_bench import timed_rounds as timed

IMAGENET = {"resize": 256, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
            "channels": 3, "interpolation": "bicubic"}


def cuda_available() -> tuple[bool, str]:
    """(ONNX Runtime can run CUDA here, why not)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (the CPU build; onnxruntime-gpu)"
    try:
        import torch
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
    except ImportError:
        pass
    return True, ""


def make_bundle(out: Path, quick: bool) -> Path:
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    size, arch = (32, {"patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}) if quick else \
        (224, {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 6})
    encoder = VisionTransformer(image_size=size, **arch)
    export_bundle(encoder, out, arch="vit_tiny" if quick else "vit_small",
                  preprocessing={**IMAGENET, "resize": size * 8 // 7, "crop": size}, parity_check=False)
    return out


class PlainRun:
    """An engine's session fed with ``session.run`` (host arrays in and out), to see what IOBinding buys."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, pixels: np.ndarray, keep: np.ndarray) -> np.ndarray:
        from msn_core.bundle import onnx_feeds

        g = self.engine.graph
        return np.asarray(g.session.run([g.output_name], onnx_feeds(g.input_names, pixels, keep))[0], np.float32)


class TorchForward:
    """The bundle's trunk in torch eager on ``device``, fp32 or bf16 autocast, host arrays in and out."""

    def __init__(self, bundle: Path, device: str, precision: str):
        import torch

        from msn_core.bundle import load_bundle_info
        from training.model.load import load_encoder
        from training.model.readout import feature_spec

        self.device, self.precision = torch.device(device), precision
        self.encoder, _ = load_encoder(bundle)
        self.encoder.eval().to(self.device)
        self.spec = feature_spec(self.encoder, load_bundle_info(bundle).feature)

    def run(self, pixels: np.ndarray, keep: np.ndarray) -> np.ndarray:
        import torch

        from training.model.readout import read_feature

        keep_t = torch.from_numpy(keep).to(self.device)
        with torch.inference_mode(), torch.autocast(self.device.type, torch.bfloat16,
                                                    enabled=self.precision == "bf16"):
            out = read_feature(self.encoder, self.spec, torch.from_numpy(pixels).to(self.device), keep_t,
                               keep_t >= 0)
        return out.float().cpu().numpy()


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def build_runners(bundle: Path, cuda: bool, threads: int, tmp: Path) -> tuple[dict, dict]:
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine

    info = load_bundle_info(bundle)
    runners: dict = {"ort-cpu/fp32": Engine(info, device="cpu", intra_op_threads=threads)}
    skipped: dict = {}
    if cuda:
        fp32 = Engine(info, device="cuda", fp16=False, cache_dir=tmp)
        fp16 = Engine(info, device="cuda", fp16=True, cache_dir=tmp)
        runners.update({"ort-cuda/fp32": fp32, "ort-cuda/fp32-plain": PlainRun(fp32),
                        f"ort-cuda/{fp16.precision}": fp16, f"ort-cuda/{fp16.precision}-plain": PlainRun(fp16)})
        for name in ("fp32", "bf16"):
            runners[f"torch-cuda/{name}"] = TorchForward(bundle, "cuda", name)
        providers = {name: r.graph.provider for name, r in runners.items() if hasattr(r, "graph")}
        skipped["providers_in_use"] = providers
    else:
        reason = cuda_available()[1] or "--device cpu"
        for name in ("ort-cuda/fp32", "ort-cuda/fp16", "torch-cuda/fp32", "torch-cuda/bf16"):
            skipped[name] = reason
    return runners, skipped


def offline_section(bundle: Path, cuda: bool, threads: int, batches: list[int], rounds: int, runs: int,
                    tmp: Path) -> dict:
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.choice import probe_inputs

    info = load_bundle_info(bundle)
    runners, skipped = build_runners(bundle, cuda, threads, tmp)
    result: dict = {"threads": threads, "tokens": info.num_patches, "skipped": skipped, "batches": {}}
    for batch in batches:
        rows: dict = {}
        for label, (pixels, keep) in zip(("full", "half_masked"), probe_inputs(info, batch), strict=True):
            reference = runners["ort-cpu/fp32"].run(pixels, keep)
            cosine = {name: min_cosine(reference, r.run(pixels, keep)) for name, r in runners.items()}  # + warm-up
            times = timed(runners, pixels, keep, rounds, runs)
            rows[label] = {name: {"images_per_s": round(batch / float(np.median(t)), 1),
                                  "ms_p50": round(1e3 * float(np.median(t)), 2),
                                  "cosine_min_vs_ort_cpu_fp32": round(cosine[name], 5)} for name, t in times.items()}
        result["batches"][str(batch)] = rows
        print(f"offline batch {batch}:", json.dumps(rows["full"]), flush=True)
    return result


def http_section(bundle: Path, cuda: bool, threads: int, batch: int, wait_ms: float, per_client: int, procs: int,
                 clients: list[int], tmp: Path, http_workers: list[str], server_args: list[str] = ()) -> dict:
    """HTTP against the engine: for each ``--http-workers`` setting (0: one process; auto: one HTTP process per
    host core but one), images/s at each client count, against the engine offline. ``server_args``: more msn-serve
    flags."""
    import httpx

    from benchmarks.serving.serve_bench import load, offline
    from benchmarks.serving.serve_harness import start_server, test_images
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine

    device = "cuda" if cuda else "cpu"
    images = test_images(16)
    info = load_bundle_info(bundle)
    engine = Engine(info, device=device, fp16=True, cache_dir=tmp, intra_op_threads=threads)
    keep = np.tile(np.arange(info.num_patches, dtype=np.int64), (batch, 1))
    pixels = np.zeros((batch, info.in_chans, info.image_size, info.image_size), np.float32)
    engine.run(pixels, keep)
    pure = batch / float(np.median(timed({"engine": engine}, pixels, keep, 1, 20)["engine"]))
    with_decode = offline(bundle, images, batch, threads, max(256, 4 * batch), engine=engine)
    out: dict = {"device": device, "batch": batch, "max_wait_ms": wait_ms, "client_procs": procs,
                 "offline_pure_images_per_s": round(pure, 1), "offline_with_decode": with_decode, "by_workers": {}}
    for workers in http_workers:
        proc, url = start_server(bundle, tmp / f"data-{workers}", [
            "--device", device, "--max-batch-size", str(batch), "--max-wait-ms", str(wait_ms), "--queue-size",
            "8192", "--http-workers", workers, *server_args])
        try:
            ready = httpx.get(f"{url}/readyz", timeout=10).json()
            runs = []
            for c in clients:
                r = load(url, images, c, max(c * per_client, 32), [None], procs, server_pid=proc.pid)
                runs.append(r)
                print(f"http (--http-workers {workers}) {c} clients:", json.dumps(r), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
        top = runs[-1]
        out["by_workers"][workers] = {
            "served": {k: ready.get(k) for k in ("runtime", "precision", "device") if k in ready},
            "front_end": ready.get("front_end"), "clients": runs,
            f"http{clients[-1]}_vs_offline_pure": round(top["images_per_s"] / pure, 3),
            f"http{clients[-1]}_vs_offline_with_decode": round(top["images_per_s"] / with_decode["images_per_s"], 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny bundle, few runs: proves the harness")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--http-batch", type=int, default=64)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--per-client", type=int, default=16)
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, len(os.sched_getaffinity(0)) // 2)))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--http-workers", nargs="+", default=["auto", "0"],
                    help="--http-workers settings to measure HTTP with (auto first: the figure that matters; 0: one "
                         "process, the figure before HTTP worker processes)")
    a = ap.parse_args(argv)
    ok, why = cuda_available()
    cuda = ok if a.device == "auto" else a.device == "cuda"
    if a.device == "cuda" and not ok:
        raise SystemExit(f"serving: --device cuda, but {why}")
    result: dict = {"machine": machine(), "cuda": cuda, "cuda_unavailable_reason": why or None,
                    "model": "tiny (--quick)" if a.quick else "ViT-S/16 224px, random weights",
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="msn-gpu-serving-") as tmp_name:
        tmp = Path(tmp_name)
        bundle = make_bundle(tmp / "bundle", a.quick)
        result["offline"] = offline_section(bundle, cuda, a.threads, [2] if a.quick else a.batches,
                                            1 if a.quick else a.rounds, 1 if a.quick else a.runs, tmp)
        save_json(a.out, result)
        if not a.skip_http:
            # The dry run's servers serve ONNX Runtime fp32 as asked, gated but not timed against OpenVINO, as a CUDA
            # server serves its one engine: a CPU runtime choice (seconds of timing a start) is no part of this run.
            pinned = ["--runtime", "onnxruntime", "--precision", "fp32"] if a.quick and not cuda else []
            result["http"] = http_section(bundle, cuda, a.threads, 4 if a.quick else a.http_batch, a.max_wait_ms,
                                          2 if a.quick else a.per_client, 1 if a.quick else a.client_procs,
                                          [1, 4] if a.quick else a.clients, tmp, a.http_workers, pinned)
            for workers, row in result["http"]["by_workers"].items():
                print(f"http --http-workers {workers}:", json.dumps({k: v for k, v in row.items() if k != "clients"}),
                      flush=True)
    save_json(a.out, result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
