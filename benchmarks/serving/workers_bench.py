"""HTTP worker processes against one process: the real demo engine's HTTP/offline ratio, latency at one client,
memory per HTTP process.

1. **Demo engine** (``--bundle``, default ``bundles/demo`` from ``make demo``; any bundle of the demo's architecture
   runs at the same speed): Fashion-MNIST test images as PNG files, single-image ``POST /embed`` from 64 clients,
   ``--http-workers 0`` and ``auto`` (ONNX Runtime fp32 pinned in the server and offline, so the two run the same
   engine), against the engine offline: ``session.run`` on batches of 64 already-preprocessed images, all cores.
   ``--routes`` measures the other embedding routes the same way, one image per request: ``v1`` (OpenAI's
   ``POST /v1/embeddings``, the PNG as a base64 data URL, floats back as JSON) and ``oip`` (``POST
   /v2/models/msn/infer``, the PNG's preprocessed ``pixel_values`` as ``tritonclient`` sends them: binary tensors
   in and out), each with its images/s against ``/embed``'s at the same ``--http-workers``.
2. **One client**: the instant engine (:mod:`benchmarks.serving.instant_engine`) and 224-px JPEGs, one client, in
   interleaved rounds: what the hop to the engine process and back adds to a request (``--rounds 0``: skipped).
3. **Memory**: resident set of the engine process and of each HTTP process, from ``/proc``.

    python -m benchmarks.serving.workers_bench                 # the measurement (the machine alone)
    python -m benchmarks.serving.workers_bench --routes embed v1 oip --workers 0 2 --rounds 0 \
        --out benchmarks/results/workers_bench-routes.json     # every embedding route, one process and two
    python -m benchmarks.serving.workers_bench --seconds 2 --rounds 1 --out /tmp/w.json   # a smoke run
"""
from __future__ import annotations

import argparse
import gzip
import io
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, RESULTS, machine, save_json
from benchmarks.serving import http_load
from benchmarks.serving.frontend_bench import front_end, instant_bundle, jpegs, rss_kb, tree, tree_cpu_seconds
from benchmarks.serving.serve_harness import start_server

FMNIST_TEST = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
PINNED = ["--precision", "fp32", "--runtime", "onnxruntime"]


def fmnist_pngs(n: int) -> list[bytes]:
    from PIL import Image

    raw = gzip.decompress(FMNIST_TEST.read_bytes())
    images = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(-1, 28, 28)[:n]
    out = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def offline_rate(bundle: Path, images: list[bytes], batch: int, seconds: float) -> float:
    """The engine alone: ``session.run`` on batches of ``batch`` preprocessed images, every core."""
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine
    from msn_serve.embedding.preprocess import preprocess_bytes

    info = load_bundle_info(bundle)
    engine = Engine(info)
    arrays = [preprocess_bytes(d, info.preprocessing, max_pixels=10**8) for d in images]
    pixels = np.stack([arrays[i % len(arrays)] for i in range(batch)])
    keep = np.tile(np.arange(info.num_patches, dtype=np.int64), (batch, 1))
    engine.run(pixels, keep)
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        engine.run(pixels, keep)
        times.append(time.perf_counter() - t0)
    return batch / float(np.median(times))


ROUTES = {"embed": "POST /embed, multipart", "v1": "POST /v1/embeddings, a base64 data URL, JSON floats back",
          "oip": "POST /v2/models/msn/infer, pixel_values as binary tensors in and out"}


def route_requests(route: str, bundle: Path, images: list[bytes]) -> list[bytes]:
    """One request per image for ``route`` (``embed``, ``v1`` or ``oip``)."""
    if route == "embed":
        return [http_load.embed_request("127.0.0.1", d) for d in images]
    if route == "v1":
        return [http_load.embeddings_request("127.0.0.1", d) for d in images]
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.preprocess import preprocess_bytes

    pre = load_bundle_info(bundle).preprocessing
    return [http_load.infer_request("127.0.0.1", preprocess_bytes(d, pre, max_pixels=10**8)) for d in images]


def http_rate(bundle: Path, tmp: Path, images: list[bytes], workers: str, clients: int, seconds: float,
              client_procs: int, route: str = "embed") -> dict:
    proc, url = start_server(bundle, tmp / f"data-{route}-{workers}", ["--max-batch-size", "64", "--queue-size",
                                                                       "4096", "--http-workers", workers, *PINNED])
    port = int(url.rsplit(":", 1)[1])
    requests = route_requests(route, bundle, images)

    def cpu() -> float:
        return tree_cpu_seconds(proc.pid)

    try:
        probe = http_load.run(port, requests, clients, clients * 4, client_procs, server_cpu=cpu)
        r = http_load.run(port, requests, clients, max(clients * 4, int(probe["images_per_s"] * seconds)),
                          client_procs, server_cpu=cpu)
        r["front_end"] = front_end(url)
        r["rss_mb"] = {str(p): round(rss_kb(p) / 1024, 1) for p in tree(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(30)
    r["images_per_s"] = round(r["images_per_s"], 1)
    return r


def one_client(tmp: Path, rounds: int, per_round: int) -> dict:
    """p50 / p99 of one client, one process against two HTTP processes, rounds interleaved."""
    bundle = instant_bundle(tmp / "instant")
    requests = [http_load.embed_request("127.0.0.1", j) for j in jpegs(16)]
    lat: dict[str, list[float]] = {"0": [], "2": []}
    servers = {}
    try:
        for w in lat:
            servers[w] = start_server(bundle, tmp / f"lat-{w}", ["--http-workers", w],
                                      launcher=["-m", "benchmarks.serving.instant_engine"])
        for _ in range(rounds):
            for w, (_, url) in servers.items():
                port = int(url.rsplit(":", 1)[1])
                r = http_load.run(port, requests, 1, per_round, 1, server_cpu=None)
                lat[w].append((r["p50_ms"], r["p99_ms"]))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    out = {w: {"p50_ms": round(float(np.median([x[0] for x in v])), 3),
               "p99_ms": round(float(np.median([x[1] for x in v])), 3), "rounds": v} for w, v in lat.items()}
    out["added_p50_ms"] = round(out["2"]["p50_ms"] - out["0"]["p50_ms"], 3)
    out["added_p99_ms"] = round(out["2"]["p99_ms"] - out["0"]["p99_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=REPO / "bundles" / "demo")
    ap.add_argument("--seconds", type=float, default=15.0, help="timed part of each HTTP run")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--workers", nargs="+", default=["0", "auto"], help="--http-workers settings to measure")
    ap.add_argument("--routes", nargs="+", default=["embed"], choices=sorted(ROUTES),
                    help="embedding routes to measure (embed: /embed; v1: /v1/embeddings; oip: OIP infer)")
    ap.add_argument("--rounds", type=int, default=5, help="one-client rounds per server (0: skip that part)")
    ap.add_argument("--per-round", type=int, default=400, help="requests per one-client round")
    ap.add_argument("--out", type=Path, default=RESULTS / "workers_bench.json")
    a = ap.parse_args()
    if not (a.bundle / "msn.json").is_file():
        raise SystemExit(f"{a.bundle}: no bundle (run `make demo`, or give --bundle of the demo's architecture)")
    images = fmnist_pngs(256)
    result: dict = {"benchmark": "workers_bench", "bundle": str(a.bundle), "clients": a.clients,
                    "request": "POST /embed, one 28x28 Fashion-MNIST PNG", "served": "onnxruntime fp32 (pinned)",
                    "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        offline = offline_rate(a.bundle, images, 64, a.seconds / 3)
        result["offline_session_run_images_per_s"] = round(offline, 1)
        print(f"offline session.run, batch 64: {offline:.0f} images/s", flush=True)
        result["http"], result["routes"] = {}, {}
        for w in a.workers:
            for route in a.routes:
                r = http_rate(a.bundle, tmp, images, w, a.clients, a.seconds, a.client_procs, route)
                r["vs_offline"] = round(r["images_per_s"] / offline, 3)
                r["request"] = ROUTES[route]
                result["routes"].setdefault(route, {})[w] = r
                if route == "embed":
                    result["http"][w] = r
                print(f"{route} --http-workers {w} ({r['front_end'].get('http_workers')} processes): "
                      f"{r['images_per_s']:.0f} images/s at {a.clients} clients = {r['vs_offline']:.2f} of offline; "
                      f"p50 {r['p50_ms']:.1f} ms, errors {r['errors']}; RSS MB {r['rss_mb']}", flush=True)
            embed = result["routes"].get("embed", {}).get(w)
            for route in a.routes:
                if embed and route != "embed":
                    mine = result["routes"][route][w]
                    mine["vs_embed"] = round(mine["images_per_s"] / embed["images_per_s"], 3)
                    print(f"{route} at --http-workers {w}: {mine['vs_embed']:.2f} of /embed's images/s", flush=True)
        if not result["http"]:
            del result["http"]
        save_json(a.out, result)
        if a.rounds <= 0:
            return
        result["one_client"] = one_client(tmp, a.rounds, a.per_round)
        lat = result["one_client"]
        print(f"one client (instant engine, 224-px JPEG): p50 {lat['0']['p50_ms']:.2f} -> {lat['2']['p50_ms']:.2f} ms "
              f"({lat['added_p50_ms']:+.2f}), p99 {lat['0']['p99_ms']:.2f} -> {lat['2']['p99_ms']:.2f} ms "
              f"({lat['added_p99_ms']:+.2f})", flush=True)
    save_json(a.out, result)


if __name__ == "__main__":
    main()
