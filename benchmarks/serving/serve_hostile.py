"""The figures of hostile and heavy requests, measured on a real msn-serve process.

    python -m benchmarks.serving.serve_hostile   # this checkout
    python -m benchmarks.serving.serve_hostile --src /tmp/old-tree --skip-search \
        --out benchmarks/results/serve_hostile-before.json

(1) the hostile searches (a 1 MiB metadata value, 10,000 queries, 200 queries x k=10000 on a 10k index, a 600 MB
response): statuses and the server's peak-memory growth (VmHWM); (2) /healthz latency while a ~10 s few-shot fit
runs (1800 examples, 360 classes) and while a ~30 MB JSON fit body is parsed (the figure a test bounds); (3) eight
6300x6300 16-bit PNGs in one /embed request: server CPU seconds and peak-memory growth. ``--src`` runs the server
from another source tree (to measure the code before a change; ``--skip-search`` there, since the unbounded search
can exhaust the machine's memory). Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving.frontend_bench import tree
from benchmarks.serving.serve_harness import pct, start_server, tiny_bundle

DIM = 64


def proc_kb(pid: int, field: str = "VmHWM") -> int:
    """``field`` of the server process, summed over its HTTP worker processes when it has them (the fit workers,
    which start and stop with fits, are counted too)."""
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass  # exited meanwhile
    return total


def cpu_s(pid: int) -> float:
    """CPU seconds of the server process and its children now (HTTP worker processes included)."""
    total = 0.0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def vectors(n: int, seed: int = 0) -> list[list[float]]:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32).round(3).tolist()


def hostile_search(url: str, pid: int) -> dict:
    import httpx

    with httpx.Client(base_url=url, timeout=600) as c:
        for start_id in range(0, 10_000, 5_000):
            c.post("/index/big/add", json={"ids": list(range(start_id, start_id + 5_000)),
                                           "vectors": vectors(5_000, start_id)}).raise_for_status()
        c.post("/index/meta/add", json={"ids": list(range(50)), "vectors": vectors(50, 7),
                                        "metadata": [{"blob": "x" * 60 * 1024}] * 50}).raise_for_status()
        before = proc_kb(pid)
        cases = {
            "1 MiB metadata value": c.post("/index/meta/add", json={"ids": [99], "vectors": vectors(1),
                                                                     "metadata": [{"blob": "y" * 2**20}]}),
            "10,000 queries, k=10": c.post("/index/meta/search", json={"vectors": [[0.5] * DIM] * 10_000, "k": 10}),
            "200 queries x k=10000 on 10k vectors": c.post("/index/big/search", json={"vectors": vectors(200, 1),
                                                                                       "k": 10_000}),
            "1000 queries x k=10, 60 KB metadata per hit": c.post("/index/meta/search",
                                                                  json={"vectors": vectors(1000, 2), "k": 10}),
        }
        growth = (proc_kb(pid) - before) / 1024
    return {"cases": {k: {"status": r.status_code, "bytes": len(r.content), "error": r.json().get("error")}
                      for k, r in cases.items()}, "peak_memory_growth_mb": growth}


def _healthz_while(url: str, send, settle_s: float, every_s: float) -> dict:
    """``/healthz`` latencies, polled on a connection of its own every ``every_s`` while ``send(client)`` runs in a
    thread (after ``settle_s``); with the sender's status and wall seconds."""
    import httpx

    out: dict = {}

    def run() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            t0 = time.perf_counter()
            r = send(c)
            out.update(status=r.status_code, request_wall_s=time.perf_counter() - t0)

    lat = []
    with httpx.Client(base_url=url, timeout=600) as c:
        c.get("/healthz")  # the polling connection is open before the request starts
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(settle_s)
        while thread.is_alive():
            t0 = time.perf_counter()
            c.get("/healthz")
            lat.append(time.perf_counter() - t0)
            time.sleep(every_s)
    thread.join()
    return {**out, "polls": len(lat), "healthz_ms": {"p50": 1e3 * pct(lat, 50), "p99": 1e3 * pct(lat, 99),
                                                     "max": 1e3 * max(lat)}}


def healthz_during_fit(url: str) -> dict:
    x = np.random.default_rng(0).standard_normal((1800, DIM)).astype(np.float32).round(4).tolist()
    body = {"name": "long", "labels": [f"c{i % 360}" for i in range(1800)], "embeddings": x}
    out = _healthz_while(url, lambda c: c.post("/fewshot/fit", json=body), settle_s=1.0, every_s=0.1)
    return {"fit_wall_s": out.pop("request_wall_s"), **out}


BIG_BODY_ROWS = 23_400  # ~30 MB of JSON text at 64 full-precision floats a row (tests/serve/test_big_body_liveness)


def healthz_during_big_body(url: str) -> dict:
    """The figure tests/serve/test_big_body_liveness.py bounds: /healthz while a ~30 MB JSON fit body is parsed."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((BIG_BODY_ROWS, DIM)) + np.repeat(np.eye(3, DIM) * 4, BIG_BODY_ROWS // 3 + 1, 0)[
        :BIG_BODY_ROWS]
    labels = [f"class{i % 3}" for i in range(BIG_BODY_ROWS)]
    body = json.dumps({"name": "big", "labels": labels, "embeddings": emb.tolist()}).encode()
    send = lambda c: c.post("/fewshot/fit", content=body, headers={"content-type": "application/json"})  # noqa: E731
    return {"body_mb": len(body) / 1e6, **_healthz_while(url, send, settle_s=0.0, every_s=0.02)}


def big_16bit_images(url: str, pid: int) -> dict:
    import httpx
    from PIL import Image

    side = 6300
    arr = np.repeat((np.arange(side) * 9 // side * 8000)[:, None], side, axis=1).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=9)
    png = buf.getvalue()
    files = [("images", (f"{i}.png", png)) for i in range(8)]
    before_mem, before_cpu = proc_kb(pid), cpu_s(pid)
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post("/embed", files=files)
    return {"status": r.status_code, "request_mb": 8 * len(png) / 2**20, "wall_s": time.perf_counter() - t0,
            "server_cpu_s": cpu_s(pid) - before_cpu, "peak_memory_growth_mb": (proc_kb(pid) - before_mem) / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=REPO, help="source tree whose msn_serve runs (default: this one)")
    ap.add_argument("--bundle", type=Path, help="bundle (default: a tiny random ViT exported here, 64-d)")
    ap.add_argument("--skip-search", action="store_true", help="skip (1): unsafe on code without result limits")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_hostile.json")
    ap.add_argument("--note", default="")
    ap.add_argument("--label", help="names the measured code in the table (default: the tree's git commit)")
    ap.add_argument("--http-workers", default="0", help="the server's --http-workers (0: one process)")
    a = ap.parse_args()
    src = a.src.resolve()
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    out: dict = {"machine": machine(), "src": a.label or commit or src.name, "note": a.note,
                 "http_workers": a.http_workers,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    args = ["--intra-op-threads", "1"] + (["--max-request-pixels", "400000000"] if src == REPO else [])
    args += ["--max-fit-samples", str(BIG_BODY_ROWS + 1), "--max-vectors-per-request", str(BIG_BODY_ROWS + 1)]
    args += ["--http-workers", a.http_workers] if a.http_workers != "0" else []
    with tempfile.TemporaryDirectory(prefix="msn-hostile-") as scratch:
        tmp = Path(scratch)
        proc, url = start_server(a.bundle or tiny_bundle(tmp / "tiny"), tmp / "data", args, src=src)
        try:
            if not a.skip_search:
                out["hostile_search"] = hostile_search(url, proc.pid)
                print("hostile search:", json.dumps(out["hostile_search"]), flush=True)
            out["healthz_during_fit"] = healthz_during_fit(url)
            print("healthz during fit:", json.dumps(out["healthz_during_fit"]), flush=True)
            out["healthz_during_big_body"] = healthz_during_big_body(url)
            print("healthz during a 30 MB body:", json.dumps(out["healthz_during_big_body"]), flush=True)
            out["images_16bit"] = big_16bit_images(url, proc.pid)
            print("16-bit images:", json.dumps(out["images_16bit"]), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
