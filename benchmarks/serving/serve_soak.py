"""Load and soak test of msn-serve: many concurrent clients for a bounded time, then an overload burst.

Prints and writes JSON (machine facts included); ``python -m benchmarks.render`` turns it into
docs/benchmarks.md. Runs against a real ``msn-serve`` subprocess on loopback, with independent client processes.

    python -m benchmarks.serving.serve_soak --bundle bundles/demo --clients 64 --duration 300
    python -m benchmarks.serving.serve_soak           # a tiny random ViT (2 blocks, 32 px, 64-d) when no --bundle
    python -m benchmarks.serving.serve_soak --quick   # 20 s soak: proves the harness

Soak: ``--clients`` clients, each in a loop over a mixed workload (60 % single-image /embed, 20 % /index search,
10 % /index add of ids that replace each other, so the index stays bounded, 10 % /fewshot predict), for
``--duration`` seconds. Reported: requests, errors (any non-2xx), p50/p99 per kind, and the server's resident
memory sampled every second (RSS after the first minute vs. at the end). Overload: a second server with a small
inference queue gets the same clients sending 8-image requests; every refusal must be 503 with Retry-After.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving.serve_harness import pct, start_server, test_images, tiny_bundle

KINDS = ("embed", "search", "add", "predict")


async def _client_loop(url: str, images: list[bytes], dim: int, clients: int, start_at: float, stop_at: float,
                       seed: int, batch: int) -> dict:
    import httpx

    rng = np.random.default_rng(seed)
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    codes: dict[str, int] = {}
    retry_after_missing = 0

    async def one(client: httpx.AsyncClient, worker: int) -> None:
        nonlocal retry_after_missing
        n = 0
        while time.time() < stop_at:
            n += 1
            roll = rng.random() if batch == 1 else 0.0
            kind = "embed" if roll < 0.6 else "search" if roll < 0.8 else "add" if roll < 0.9 else "predict"
            vec = rng.standard_normal((1, dim)).round(4).tolist()
            t0 = time.perf_counter()
            try:
                if kind == "embed":
                    files = [("images", images[(worker + n + i) % len(images)]) for i in range(batch)]
                    r = await client.post("/embed", files=files)
                elif kind == "search":
                    r = await client.post("/index/soak/search", json={"vectors": vec, "k": 10})
                elif kind == "add":
                    r = await client.post("/index/soak/add", json={"ids": [int(rng.integers(0, 5000))],
                                                                   "vectors": vec, "metadata": [{"w": worker}]})
                else:
                    r = await client.post("/fewshot/soak/predict", json={"embeddings": vec, "k": 3})
                code = str(r.status_code)
                if r.status_code == 503 and "retry-after" not in r.headers:
                    retry_after_missing += 1
            except httpx.HTTPError as e:
                code = type(e).__name__
            lat[kind].append(time.perf_counter() - t0)
            codes[f"{kind}:{code}"] = codes.get(f"{kind}:{code}", 0) + 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))  # every process starts at the same instant
        await asyncio.gather(*[one(client, w) for w in range(clients)])
    return {"latency": lat, "codes": codes, "retry_after_missing": retry_after_missing}


def _client_process(args: tuple) -> dict:
    return asyncio.run(_client_loop(*args))


STARTUP_S = 15.0  # time for the client processes to start (spawn + imports) before the clock starts


def _run_clients(url: str, images: list[bytes], dim: int, clients: int, seconds: float, procs: int,
                 batch: int = 1, start_at: float | None = None) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    procs = max(1, min(procs, clients))
    start_at = start_at or time.time() + STARTUP_S
    jobs = [(url, images, dim, clients // procs + (p < clients % procs), start_at, start_at + seconds, p, batch)
            for p in range(procs)]
    with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(_client_process, jobs))
    lat = {k: [x for p in parts for x in p["latency"][k]] for k in KINDS}
    codes: dict[str, int] = {}
    for p in parts:
        for k, v in p["codes"].items():
            codes[k] = codes.get(k, 0) + v
    total = sum(codes.values())
    return {"clients": clients, "client_processes": procs, "seconds": seconds, "requests": total,
            "requests_per_s": total / seconds, "codes": dict(sorted(codes.items())),
            "errors": sum(v for k, v in codes.items() if not k.split(":")[1].startswith("2")),
            "retry_after_missing": sum(p["retry_after_missing"] for p in parts),
            "latency_ms": {k: {"n": len(v), "p50": 1e3 * pct(v, 50), "p99": 1e3 * pct(v, 99)} for k, v in lat.items()
                           if v}}


class RssSampler(threading.Thread):
    """The server's VmRSS (kB) every ``period`` seconds, from /proc."""

    def __init__(self, pid: int, t0: float, period: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.period, self.samples, self._halt = pid, period, [], threading.Event()
        self.t0 = t0  # seconds are counted from here (the load's start)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.samples.append((time.time() - self.t0, int(line.split()[1])))
            except OSError:
                return
            self._halt.wait(self.period)

    def stop(self) -> list[tuple[float, int]]:
        self._halt.set()
        self.join(5)
        return self.samples


def _prepare(url: str, dim: int) -> None:
    import httpx

    rng = np.random.default_rng(0)
    with httpx.Client(base_url=url, timeout=120) as c:
        for start in range(0, 5000, 1000):
            ids = list(range(start, start + 1000))
            vectors = rng.standard_normal((1000, dim)).round(4).tolist()
            r = c.post("/index/soak/add", json={"ids": ids, "vectors": vectors})
            r.raise_for_status()
        labels = [f"c{i % 5}" for i in range(50)]
        r = c.post("/fewshot/fit", json={"name": "soak", "labels": labels,
                                         "embeddings": rng.standard_normal((50, dim)).round(4).tolist()})
        r.raise_for_status()


def soak(bundle: Path, tmp: Path, clients: int, duration: float, procs: int, threads: int) -> dict:
    from msn_core.bundle import load_bundle_info

    dim = load_bundle_info(bundle).embed_dim
    images = test_images(16)
    proc, url = start_server(bundle, tmp / "soak-data", ["--intra-op-threads", str(threads), "--queue-size", "1024"])
    try:
        _prepare(url, dim)
        start_at = time.time() + STARTUP_S
        sampler = RssSampler(proc.pid, start_at)
        sampler.start()
        result = _run_clients(url, images, dim, clients, duration, procs, start_at=start_at)
        samples = [(t, kb) for t, kb in sampler.stop() if t >= 0]
    finally:
        proc.terminate()
        proc.wait(30)
    after_1min = [kb for t, kb in samples if t >= min(60.0, duration / 3)]
    rss = {"first_kb": samples[0][1], "after_1min_kb": after_1min[0], "end_kb": samples[-1][1],
           "max_kb": max(kb for _, kb in samples), "samples": len(samples)}
    rss["growth_after_1min"] = (rss["end_kb"] - rss["after_1min_kb"]) / rss["after_1min_kb"]
    return {**result, "rss": rss, "rss_series_kb": samples[:: max(1, len(samples) // 60)]}


def overload(bundle: Path, tmp: Path, clients: int, seconds: float, procs: int, threads: int) -> dict:
    """A small inference queue (16 images) and 8-image requests: most requests must be refused with 503."""
    from msn_core.bundle import load_bundle_info

    dim = load_bundle_info(bundle).embed_dim
    proc, url = start_server(bundle, tmp / "overload-data", ["--intra-op-threads", str(threads), "--queue-size", "16",
                                                            "--max-batch-size", "8"])
    try:
        result = _run_clients(url, test_images(16), dim, clients, seconds, procs, batch=8)
    finally:
        proc.terminate()
        proc.wait(30)
    codes = result["codes"]
    result["refused_503"] = sum(v for k, v in codes.items() if k.endswith(":503"))
    result["other_errors"] = result["errors"] - result["refused_503"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, help="bundle directory (default: a tiny random ViT exported here)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_soak.json")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0, help="soak seconds")
    ap.add_argument("--overload-seconds", type=float, default=30.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of the server")
    ap.add_argument("--note", default="", help="free text stored with the results (e.g. how processes were pinned)")
    ap.add_argument("--quick", action="store_true", help="20 s soak, 5 s overload: proves the harness")
    a = ap.parse_args()
    duration, over = (20.0, 5.0) if a.quick else (a.duration, a.overload_seconds)
    name = str(a.bundle) if a.bundle else "tiny random ViT (2 blocks, 32 px, patch 4, 64-d)"
    out = {"machine": machine(), "bundle": name, "quick": a.quick, "note": a.note,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"machine: {out['machine']['cpu']} x{out['machine']['cores_visible']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="msn-soak-") as scratch:
        tmp = Path(scratch)
        bundle = a.bundle or tiny_bundle(tmp / "tiny")
        out["soak"] = soak(bundle, tmp, a.clients, duration, a.client_procs, a.threads)
        print("soak:", json.dumps({k: v for k, v in out["soak"].items() if k != "rss_series_kb"}), flush=True)
        out["overload"] = overload(bundle, tmp, a.clients, over, a.client_procs, a.threads)
        print("overload:", json.dumps(out["overload"]), flush=True)
    save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
