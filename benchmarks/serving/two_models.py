"""Two models in one ``msn-serve`` against one model alone, side by side in one run, under the 64-client load.

For each bundle, a one-model server takes the load alone (its images/s is the reference); then one server with both
models takes mixed traffic (every client alternates between the two models request by request). Each model's
images/s in the shared server is compared with its share (here one half) of its one-model figure: the target is
>= 0.9. Optionally (``--replace``) model ``b`` is replaced with ``PUT /admin/models/b`` half-way through the mixed
load, and every request that did not answer 200 counts as lost. Rounds alternate the servers, so a slow phase of the
machine touches both. Prints and writes ``benchmarks/results/two_models.json`` with the machine.

    python -m benchmarks.serving.two_models --seconds 60 --rounds 2 --replace     # the measurement
    python -m benchmarks.serving.two_models --smoke                               # a few seconds: does it run
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, save_json
from benchmarks.serving.serve_harness import start_server, test_images, tiny_bundle

BOUNDARY = "msntwomodels5a0e"
GATE_TIMEOUT_S = 600.0


def embed_request(port: int, image: bytes, model: str | None) -> bytes:
    """One ``POST /embed`` with one image and, when given, the ``model`` field (multipart, built once)."""
    parts = [f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"x.jpg\"\r\n"
             "Content-Type: image/jpeg\r\n\r\n".encode() + image + b"\r\n"]
    if model is not None:
        parts.append(f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n".encode())
    body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
    head = (f"POST /embed HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: multipart/form-data; "
            f"boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next((int(v) for n, _, v in (ln.partition(b":") for ln in lines[1:])
                   if n.strip().lower() == b"content-length"), 0)
    await reader.readexactly(length)
    return int(lines[0].split(b" ", 2)[1])


async def _clients(port: int, requests: dict[str, list[bytes]], clients: int, seconds: float, gate) -> dict:
    """``clients`` connections, each cycling through the models' requests in turn until ``seconds`` have passed
    after the gate; per model: statuses counted and latencies."""
    conns = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(clients)])
    models = list(requests)
    for reader, writer in conns:  # warm each connection and each model's path once
        for m in models:
            await _exchange(reader, writer, requests[m][0])
    await asyncio.get_running_loop().run_in_executor(None, gate.wait, GATE_TIMEOUT_S)
    deadline = time.monotonic() + seconds
    stats = {m: {"status": {}, "lat": []} for m in models}

    async def client(c: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = c
        while time.monotonic() < deadline:
            m = models[i % len(models)]
            t0 = time.perf_counter()
            try:
                status = await _exchange(reader, writer, requests[m][i % len(requests[m])])
            except (OSError, asyncio.IncompleteReadError):
                status = "connection"
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            stats[m]["lat"].append(time.perf_counter() - t0)
            stats[m]["status"][str(status)] = stats[m]["status"].get(str(status), 0) + 1
            i += 1
        writer.close()

    await asyncio.gather(*[client(c, r, w) for c, (r, w) in enumerate(conns)])
    return stats


def _process(args: tuple) -> dict:
    try:
        return asyncio.run(_clients(*args))
    except BaseException:
        args[-1].abort()
        raise


def load(port: int, requests: dict[str, list[bytes]], clients: int, seconds: float, procs: int,
         during=None) -> dict:
    """Run the clients over ``procs`` processes, released together; ``during()`` runs in this process once the load
    started (the replacement). Per model: images/s, statuses, latency percentiles."""
    ctx = get_context("spawn")
    procs = max(1, min(procs, clients))
    side: dict = {}
    with ctx.Manager() as manager, ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        gate = manager.Barrier(procs + 1)
        futures = [pool.submit(_process, (port, requests, clients // procs + (p < clients % procs), seconds, gate))
                   for p in range(procs)]
        gate.wait(GATE_TIMEOUT_S)
        t0 = time.monotonic()
        if during is not None:
            worker = threading.Thread(target=lambda: side.update(during()))
            worker.start()
            worker.join()
        parts = [f.result() for f in futures]
        wall = time.monotonic() - t0
    out: dict = {"wall_s": round(wall, 3), "models": {}}
    for m in requests:
        status: dict[str, int] = {}
        lat = [x for p in parts for x in p[m]["lat"]]
        for p in parts:
            for k, v in p[m]["status"].items():
                status[k] = status.get(k, 0) + v
        ok = status.get("200", 0)
        out["models"][m] = {"images_per_s": round(ok / seconds, 2), "requests": sum(status.values()),
                            "by_status": status, "p50_ms": round(1e3 * float(np.percentile(lat, 50)), 2),
                            "p99_ms": round(1e3 * float(np.percentile(lat, 99)), 2)}
    if side:
        out["replace"] = side
    return out


def replace_midway(url: str, bundle: Path, after_s: float):
    def run() -> dict:
        import httpx

        time.sleep(after_s)
        t0 = time.perf_counter()
        r = httpx.put(f"{url}/admin/models/b", json={"bundle": str(bundle)}, timeout=300)
        return {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3), "at_s": after_s}
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle-a", type=Path, help="default: a tiny random bundle")
    p.add_argument("--bundle-b", type=Path, help="default: another tiny random bundle")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--seconds", type=float, default=60.0, help="load per phase")
    p.add_argument("--rounds", type=int, default=1, help="one-model and two-model phases, alternated")
    p.add_argument("--replace", action="store_true", help="PUT model b half-way through each two-model phase")
    p.add_argument("--server-args", default="", help="extra msn-serve flags, e.g. '--max-batch-size 32'")
    p.add_argument("--smoke", action="store_true", help="a few seconds, 8 clients: checks that it runs")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=RESULTS / "two_models.json")
    a = p.parse_args()
    if a.smoke:
        a.clients, a.procs, a.seconds, a.rounds = 8, 1, 2.0, 1
        if a.out == RESULTS / "two_models.json":  # a smoke run's figures are not results
            a.out = Path(tempfile.gettempdir()) / "two_models_smoke.json"
    images = test_images(16)
    result: dict = {"note": a.note, "clients": a.clients, "seconds": a.seconds, "server_args": a.server_args,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "rounds": []}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        bundle_a = a.bundle_a or tiny_bundle(tmp / "a")
        bundle_b = a.bundle_b or _other_tiny_bundle(tmp / "b")
        result["bundles"] = {"a": str(a.bundle_a or "tiny (seed 0)"), "b": str(a.bundle_b or "tiny (seed 1)")}
        extra = a.server_args.split()
        for r in range(a.rounds):
            rnd: dict = {"one_model": {}}
            for name, bundle in (("a", bundle_a), ("b", bundle_b)):
                proc, url = start_server(bundle, tmp / f"one-{name}-{r}", extra)
                try:
                    port = int(url.rsplit(":", 1)[1])
                    reqs = {name: [embed_request(port, im, None) for im in images]}
                    rnd["one_model"][name] = load(port, reqs, a.clients, a.seconds, a.procs)["models"][name]
                finally:
                    proc.terminate()
                    proc.wait(30)
            proc, url = start_server(f"a={bundle_a}", tmp / f"two-{r}", ["--bundle", f"b={bundle_b}", *extra])
            try:
                port = int(url.rsplit(":", 1)[1])
                reqs = {m: [embed_request(port, im, m) for im in images] for m in ("a", "b")}
                during = replace_midway(url, bundle_b, a.seconds / 2) if a.replace else None
                rnd["two_models"] = load(port, reqs, a.clients, a.seconds, a.procs, during)
            finally:
                proc.terminate()
                proc.wait(30)
            for m in ("a", "b"):
                share = rnd["one_model"][m]["images_per_s"] / 2
                rnd["two_models"]["models"][m]["of_share"] = round(
                    rnd["two_models"]["models"][m]["images_per_s"] / share, 3) if share else None
            rnd["lost"] = sum(n for m in ("a", "b") for s, n in rnd["two_models"]["models"][m]["by_status"].items()
                              if s != "200")
            result["rounds"].append(rnd)
            print(f"round {r}: one-model a {rnd['one_model']['a']['images_per_s']} / b "
                  f"{rnd['one_model']['b']['images_per_s']} img/s; two models: a "
                  f"{rnd['two_models']['models']['a']['images_per_s']} ({rnd['two_models']['models']['a']['of_share']}"
                  f" of its share), b {rnd['two_models']['models']['b']['images_per_s']} "
                  f"({rnd['two_models']['models']['b']['of_share']}); not 200: {rnd['lost']}"
                  + (f"; replace {rnd['two_models']['replace']}" if a.replace else ""), flush=True)
    shares = [rnd["two_models"]["models"][m]["of_share"] for rnd in result["rounds"] for m in ("a", "b")]
    result["min_of_share"] = min(s for s in shares if s is not None) if any(s is not None for s in shares) else None
    result["lost_total"] = sum(rnd["lost"] for rnd in result["rounds"])
    save_json(a.out, result)
    return 0


def _other_tiny_bundle(out: Path) -> Path:
    """The tiny bundle's architecture with other weights (another model id)."""
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer
    torch.manual_seed(1)
    enc = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    export_bundle(enc, out, arch="vit_tiny", parity_check=False,
                  preprocessing={"resize": 36, "crop": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "channels": 3,
                                 "interpolation": "bicubic"})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
