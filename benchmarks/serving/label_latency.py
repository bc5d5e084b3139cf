"""Latency of the label-loop endpoints at a 100k-item index, over HTTP against a real ``msn-serve``.

The index holds the bundle's Fashion-MNIST embeddings (70k train + test) topped up to the requested size with
jittered copies, so k-means sees real structure. Each endpoint is called ``REPEATS`` times after one warm-up call,
sequentially from one client on the same machine; p50 and p95 are reported. ``predict_index`` is timed twice: the
first page after a fit (which scores every item once, for the class counts and the uncertainty order) and the
following pages (served from that cache).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import REPO

REPEATS = 15
ADD_BATCH = 4_000  # 4k x 192 floats of JSON stay under the default 32 MB body limit


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vectors(bundle: Path, items: int) -> np.ndarray:
    from benchmarks.common import train_test_features

    data = train_test_features(bundle, "onnx")
    base = np.concatenate([data["x_train"], data["x_test"]])
    reps = -(-items // len(base))
    rng = np.random.default_rng(0)
    out = np.concatenate([base + (rng.normal(size=base.shape).astype(np.float32) * 0.01 * r if r else 0)
                          for r in range(reps)])
    return out[:items].astype(np.float32)


def _time(client: httpx.Client, path: str, body: dict, repeats: int = REPEATS) -> dict:
    r = client.post(path, json=body)  # warm-up (and a check that the call works)
    r.raise_for_status()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.post(path, json=body).raise_for_status()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))],
            "max_ms": times[-1], "calls": repeats}


def measure(bundle: Path, items: int = 100_000) -> dict:
    vecs = _vectors(bundle, items)
    port = _free_port()
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "msn_serve", "--bundle", str(bundle), "--data-dir",
                                 str(Path(tmp) / "data"), "--port", str(port), "--intra-op-threads", "1"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
            for _ in range(600):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            client.post("/index/pool", json={"type": "flat"}).raise_for_status()
            for i in range(0, items, ADD_BATCH):
                ids = list(range(i, min(items, i + ADD_BATCH)))
                client.post("/index/pool/add", json={"ids": ids, "vectors": vecs[ids].tolist()}).raise_for_status()
            out: dict = {"items": items, "dim": int(vecs.shape[1]), "index": "flat", "cores": cores,
                         "server": "msn-serve, --intra-op-threads 1, default settings (select_candidates 20000)"}
            for strategy in ("typical", "kmeans", "kcenter", "random"):
                out[f"select n=20 {strategy}"] = _time(client, "/index/pool/select",
                                                       {"n": 20, "strategy": strategy, "seed": 0})
            out["select n=100 typical"] = _time(client, "/index/pool/select", {"n": 100, "seed": 0}, 5)
            labelled = client.post("/index/pool/select", json={"n": 20}).json()["ids"]
            labels = [f"c{i % 10}" for i in range(20)]
            fit = {"name": "bench", "index": "pool", "ids": labelled, "labels": labels, "overwrite": True}
            out["fit 20 ids"] = _time(client, "/fewshot/fit", fit, 5)
            first = []
            for _ in range(5):  # a new fit each time: the first page scores the whole index
                client.post("/fewshot/fit", json=fit).raise_for_status()
                t0 = time.perf_counter()
                client.post("/fewshot/bench/predict_index", json={"index": "pool", "limit": 1000}).raise_for_status()
                first.append((time.perf_counter() - t0) * 1000)
            out["predict_index first page after a fit (limit 1000)"] = {"p50_ms": statistics.median(first),
                                                                       "max_ms": max(first), "calls": 5}
            out["predict_index next pages (limit 1000)"] = _time(
                client, "/fewshot/bench/predict_index", {"index": "pool", "offset": 5000, "limit": 1000})
            out["predict_index least certain first (limit 100)"] = _time(
                client, "/fewshot/bench/predict_index", {"index": "pool", "limit": 100, "order": "uncertain"})
            for strategy in ("margin", "typical"):
                out[f"suggest n=20 {strategy}"] = _time(client, "/fewshot/bench/suggest",
                                                        {"index": "pool", "n": 20, "strategy": strategy})
            client.close()
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    return out
