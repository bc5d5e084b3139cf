"""Serving benchmark: ORT vs torch eager, HTTP latency/throughput under concurrency, masks, FAISS.

Prints a table and writes JSON (machine facts included). Runs against a real ``msn-serve`` subprocess on loopback.

    python -m benchmarks.serving.serve_bench --bundle bundles/demo --out benchmarks/results/serve_bench.json
    python -m benchmarks.serving.serve_bench --quick   # tiny random bundle, seconds; proves the harness works

Sections (``--only`` picks some): ``ort``: ORT vs torch eager on the same bundle and batch at equal thread budgets;
``int8``: fp32 vs int8 ORT, dynamic and static quantization side by side (benchmarks/serving/int8_bench.py); ``http``:
single-image clients at 1/16/64 concurrency vs offline batched throughput (decode + preprocess + ORT in-process,
the server's ceiling) and mixed mask ratios; ``faiss``: every index kind tuned by msn-serve's tuner to recall@10
>= 0.95 on a million clustered 384-d vectors and on the bundle's Fashion-MNIST embeddings replicated to a million
(benchmarks/serving/faiss_bench.py), with memory per kind and, where faiss sees a GPU, the GPU copies.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving import faiss_bench, http_load, int8_bench
from benchmarks.serving.serve_harness import pct, start_server, test_images, tiny_bundle


# ---- (1) ORT vs torch eager ------------------------------------------------------------------------------------------
def ort_vs_torch(bundle: Path, batch: int, threads: int, reps: int) -> dict:
    import torch

    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine
    from training.model.load import load_encoder
    from training.model.readout import feature_spec, read_feature
    info = load_bundle_info(bundle)
    eng = Engine(info, intra_op_threads=threads)
    enc, _ = load_encoder(bundle)
    enc.eval()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    px = rng.standard_normal((batch, info.in_chans, info.image_size, info.image_size)).astype(np.float32)
    keep = np.tile(np.arange(info.num_patches, dtype=np.int64), (batch, 1))
    tpx, tkeep, tmask = torch.from_numpy(px), torch.from_numpy(keep), torch.ones(keep.shape, dtype=torch.bool)

    spec = feature_spec(enc, info.feature)

    def run_torch():  # the bundle's feature, with the key-padding mask, as the exported graph runs
        with torch.inference_mode():
            return read_feature(enc, spec, tpx, tkeep, tmask)

    def timeit(fn) -> list[float]:
        fn()
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return ts

    t_ort = timeit(lambda: eng.run(px, keep))
    t_torch = timeit(run_torch)
    out_t = run_torch().numpy()
    diff = float(np.abs(eng.run(px, keep) - out_t).max())
    return {"batch": batch, "threads": threads, "tokens": info.num_patches, "ort_ms_p50": 1e3 * pct(t_ort, 50),
            "torch_eager_ms_p50": 1e3 * pct(t_torch, 50), "speedup_ort_over_torch": pct(t_torch, 50) / pct(t_ort, 50),
            "max_abs_diff": diff}


def load(url: str, images: list[bytes], concurrency: int, total: int, masks: list[str | None], procs: int,
         *, accept: str | None = None, server_pid: int | None = None) -> dict:
    """``concurrency`` single-image clients (:mod:`http_load`: pre-built requests, keep-alive sockets) over
    ``procs`` processes, released together; with ``server_pid``, the server's CPU seconds during the run."""
    port = int(url.rsplit(":", 1)[1])
    reqs = [http_load.embed_request("127.0.0.1", images[i % len(images)], mask=masks[i % len(masks)], accept=accept)
            for i in range(max(len(images), len(masks)))]
    return {**http_load.run(port, reqs, concurrency, total, procs, server_pid=server_pid),
            "accept": accept or "application/json"}


def offline(bundle: Path, images: list[bytes], batch: int, threads: int, total: int, engine=None) -> dict:
    """In-process decode + preprocess + batched inference (``engine``, by default ONNX Runtime fp32): what the
    server could reach with zero HTTP overhead."""
    from concurrent.futures import ThreadPoolExecutor

    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine
    from msn_serve.embedding.preprocess import preprocess_bytes
    info = load_bundle_info(bundle)
    eng = engine or Engine(info, intra_op_threads=threads)
    keep_all = np.arange(info.num_patches, dtype=np.int64)
    pool = ThreadPoolExecutor(2)
    eng.run(np.zeros((batch, info.in_chans, info.image_size, info.image_size), np.float32),
            np.tile(keep_all, (batch, 1)))  # warm-up, as the server's
    t0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    while done < total:
        n = min(batch, total - done)
        px = np.stack(list(pool.map(lambda d: preprocess_bytes(d, info.preprocessing, max_pixels=10**8),
                                    [images[(done + i) % len(images)] for i in range(n)])))
        eng.run(px, np.tile(keep_all, (n, 1)))
        done += n
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    pool.shutdown()
    return {"batch": batch, "images": total, "images_per_s": total / wall, "cpu_ms_per_image": 1e3 * cpu / total,
            "batch_ms": 1e3 * wall * batch / total}


SECTIONS = ("ort", "int8", "http", "faiss")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, help="bundle directory (default with --quick: a tiny random one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_bench.json")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves the harness, numbers mean nothing")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="sections to run (default all); e.g. --only faiss for the million-vector part alone")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes (pin them away from the "
                    "server's cores with taskset on a big machine)")
    ap.add_argument("--faiss-n", type=int, help="vectors per FAISS corpus (default 1,000,000; --quick 20,000)")
    ap.add_argument("--faiss-kinds", nargs="+", default=["ivf", "ivfpq", "hnsw"], choices=["ivf", "ivfpq", "hnsw"])
    ap.add_argument("--http-rounds", type=int, default=2, help="interleaved offline / 64-client rounds")
    ap.add_argument("--note", default="", help="how the machine was shared (recorded in the JSON)")
    ap.add_argument("--guard-images", type=int, help="held-out images of the int8 guard (default 10,000)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="msn-bench-"))
    try:
        bundle = a.bundle or (tiny_bundle(tmp / "bundle") if a.quick else None)
        if bundle is None:
            ap.error("--bundle is required without --quick")
        reps, per_client = (3, 4) if a.quick else (20, 50)
        result: dict = {"machine": machine(), "bundle": str(bundle), "quick": a.quick, "sections": a.only,
                        "threads": a.threads, "note": a.note,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        print(f"machine: {result['machine']['cpu']} x{result['machine']['cores_visible']}", flush=True)
        if "ort" in a.only:
            result["ort_vs_torch"] = ort_vs_torch(bundle, a.batch, a.threads, reps)
            print("ort vs torch:", json.dumps(result["ort_vs_torch"]), flush=True)
        if "int8" in a.only:
            result["int8"] = int8_bench.run(bundle, threads=a.threads, batch=a.batch,
                                            guard_images=a.guard_images or (256 if a.quick else 10_000),
                                            seconds=2.0 if a.quick else 20.0)
            print("int8:", json.dumps(result["int8"]), flush=True)
        if "http" in a.only:
            http_section(result, bundle, tmp, a, per_client)
        if "faiss" in a.only:
            n = a.faiss_n or (20_000 if a.quick else 1_000_000)
            result["faiss_tuned"] = faiss_bench.run(None if a.quick else bundle, n,
                                                    ["clustered"] if a.quick else ["clustered", "fmnist"],
                                                    a.faiss_kinds)
        save_json(a.out, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def http_section(result: dict, bundle: Path, tmp: Path, a: argparse.Namespace, per_client: int) -> None:
    """Single-image clients at 1/16/64 and mixed masks (JSON responses); then rounds of offline / 64 clients
    asking for JSON / 64 asking for raw float32, interleaved so that load from other jobs on a shared machine falls
    on both sides of each ratio.

    Ratios at 64 clients: ``http_vs_offline`` = HTTP images/s / the mean of the offline runs just before and after
    (wall clock; where the clients share the server's cores this is a floor), and ``http_vs_offline_cpu`` = offline
    CPU per image / server CPU per image (what the server would reach with its cores to itself)."""
    images = test_images(16)
    wait_ms = 2.0
    # ONNX Runtime fp32, as the offline side runs it (benchmarks/serving/vits_bench.py measures --precision auto).
    proc, url = start_server(bundle, tmp / "data", ["--max-batch-size", str(a.batch), "--max-wait-ms", str(wait_ms),
                                                    "--intra-op-threads", str(a.threads), "--device", a.device,
                                                    "--queue-size", "4096", "--precision", "fp32",
                                                    "--runtime", "onnxruntime"])
    total_offline = max(64, 16 * per_client)

    def http(c: int, accept: str | None = None, masks: list[str | None] | None = None) -> dict:
        r = load(url, images, c, max(c * per_client, 20), masks or [None], a.client_procs, accept=accept,
                 server_pid=proc.pid)
        print("http:", json.dumps(r), flush=True)
        return r

    def off() -> dict:
        r = offline(bundle, images, a.batch, a.threads, total_offline)
        print("offline:", json.dumps(r), flush=True)
        return r

    try:
        result["http"] = [http(1), http(16)]
        result["http_mixed_masks"] = http(16, masks=[None, '{"ratio": 0.5}', '{"ratio": 0.75}', '{"ratio": 0.9}'])
        offs, rounds = [off()], []
        for _ in range(a.http_rounds):
            pair = [http(64), http(64, "application/octet-stream")]
            offs.append(off())
            rounds.append(pair)
            result["http"] += pair
    finally:
        proc.terminate()
        proc.wait(30)
    result["offline_runs"] = offs
    result["offline_batched"] = {**offs[0], "images_per_s": float(np.mean([o["images_per_s"] for o in offs])),
                                 "cpu_ms_per_image": float(np.mean([o["cpu_ms_per_image"] for o in offs])),
                                 "batch_ms": float(np.mean([o["batch_ms"] for o in offs]))}
    bound = wait_ms + 2 * result["offline_batched"]["batch_ms"]
    result["http_64"] = {}
    for accept in ("application/json", "application/octet-stream"):
        wall, cpu, p99 = [], [], []
        for i, pair in enumerate(rounds):
            r = next(x for x in pair if x["accept"] == accept)
            o = (offs[i]["images_per_s"] + offs[i + 1]["images_per_s"]) / 2
            o_cpu = (offs[i]["cpu_ms_per_image"] + offs[i + 1]["cpu_ms_per_image"]) / 2
            wall.append(r["images_per_s"] / o)
            cpu.append(o_cpu / r["server_cpu_ms_per_image"])
            p99.append(r["p99_ms"])
        result["http_64"][accept] = {"http_vs_offline": round(float(np.mean(wall)), 3),
                                     "http_vs_offline_rounds": [round(x, 3) for x in wall],
                                     "http_vs_offline_cpu": round(float(np.mean(cpu)), 3),
                                     "p99_ms": round(float(np.max(p99)), 1), "p99_bound_ms": round(bound, 1),
                                     "target_ratio": 0.9}
    best = max(result["http"], key=lambda r: r["images_per_s"])
    result["http_best_vs_offline"] = best["images_per_s"] / result["offline_batched"]["images_per_s"]
    print("at 64 clients:", json.dumps(result["http_64"]), flush=True)

if __name__ == "__main__":
    raise SystemExit(main())
