"""Where the HTTP ``/embed`` path spends its CPU at 64 single-image clients.

Two measurements, printed and written as JSON with the machine:

1. **The event loop, profiled.** ``msn-serve`` runs under cProfile counting the main thread's CPU time (the
   event loop, where HTTP parsing, multipart parsing, validation and response encoding happen; decoding runs in
   the pre-processing pool and inference in the batcher's thread). 64 clients (:mod:`http_load`) send single-image
   requests, once asking for JSON and once for raw float32; the loop's CPU time is split by the code it ran.
   cProfile slows Python code down, so the split is what to read, not the absolute milliseconds.
2. **Per-request costs, in-process** (no profiler): multipart parsing of one request with Starlette's parser,
   decode + preprocess of one image, and the encodings of one embedding (standard-library JSON as before, orjson
   JSON as now, raw float32, ``.npy``).

    python -m benchmarks.serving.embed_profile --bundle bundles/bench --out benchmarks/results/embed_profile.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving import http_load
from benchmarks.serving.serve_harness import start_server, test_images

CATEGORIES = (  # (label, substrings of "file:function" that belong to it), first match wins
    ("HTTP protocol (uvicorn h11)", ("h11", "uvicorn/protocols")),
    ("multipart parsing", ("multipart", "formparsers", "UploadFile", "tempfile", "SpooledTemporaryFile")),
    ("JSON encoding", ("json/encoder", "jsontext", "'tolist'", "render")),
    ("request validation (pydantic)", ("pydantic",)),
    ("msn_serve (routes, service, batcher)", ("msn_serve",)),
    ("FastAPI/Starlette routing", ("starlette", "fastapi")),
    ("asyncio machinery and sockets", ("asyncio", "selectors", "select.epoll", "concurrent/futures", "threading",
                                       "_socket", "SimpleQueue")),
)


def split_profile(path: Path) -> dict:
    """CPU seconds of the profiled main thread per category (tottime summed) and the costliest functions."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    totals: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES}
    totals["other"] = 0.0
    top: list[tuple[float, str]] = []
    for (file, _line, func), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        key = f"{file}:{func}"
        label = next((lab for lab, subs in CATEGORIES if any(s in key for s in subs)), "other")
        totals[label] += tottime
        top.append((tottime, f"{label}: {Path(file).name}:{func}"))
    busy = sum(totals.values())
    return {"loop_cpu_s": round(busy, 3),
            "share": {k: round(v / busy, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_functions": {name: round(t / busy, 3) for t, name in sorted(top, reverse=True)[:15]}}


# msn-serve under a profiler that counts the main thread's CPU time (not wall time: on a shared core a thread that
# is descheduled would charge the wait to whatever it was running), switched on by SIGUSR1 once the server is warm.
LAUNCHER = """
import cProfile, runpy, signal, sys, time
out = sys.argv.pop(1)
prof = cProfile.Profile(time.thread_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
try:
    runpy.run_module("msn_serve", run_name="__main__")
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def profiled_run(bundle: Path, tmp: Path, accept: str | None, requests: int, batch: int) -> dict:
    out = tmp / f"loop-{'json' if accept is None else 'raw'}.prof"
    proc, url = start_server(bundle, tmp / f"data-{out.stem}", ["--max-batch-size", str(batch), "--max-wait-ms",
                                                                 "2", "--intra-op-threads", "1",
                                                                 "--queue-size", "4096"],
                             launcher=["-c", LAUNCHER, str(out)])
    try:
        port = int(url.rsplit(":", 1)[1])
        reqs = [http_load.embed_request("127.0.0.1", im, accept=accept) for im in test_images(16)]
        proc.send_signal(signal.SIGUSR1)
        load = http_load.run(port, reqs, 64, requests, server_pid=proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down; the launcher writes the profile as main returns
        proc.wait(60)
    return {"accept": accept or "application/json", "load_under_profiler": load, **split_profile(out)}


def per_request_costs(bundle: Path, reps: int = 300) -> dict:
    """Microseconds per request for the pieces of the path, measured in this process."""
    from starlette.datastructures import Headers
    from starlette.formparsers import MultiPartParser

    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.preprocess import preprocess_bytes
    from msn_serve.http.embed_response import NPY, RAW, embeddings_response, json_response
    from msn_serve.http.responses import StrictJSONResponse
    info = load_bundle_info(bundle)
    image = test_images(1)[0]
    raw = http_load.embed_request("h", image)
    _head, body = raw.split(b"\r\n\r\n", 1)
    headers = Headers({"content-type": f"multipart/form-data; boundary={http_load.BOUNDARY}"})

    async def parse() -> None:
        async def stream():
            yield body
        form = await MultiPartParser(headers, stream()).parse()
        await form.close()

    def timed(fn, n: int = reps) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round(1e6 * (time.perf_counter() - t0) / n, 1)

    loop = asyncio.new_event_loop()
    emb = np.random.default_rng(0).standard_normal((1, info.embed_dim)).astype(np.float32)
    body_json = {"model_id": info.model_id, "dim": info.embed_dim, "count": 1, "normalized": False,
                 "kept_tokens": [info.num_patches]}
    out = {
        "multipart_parse_us": timed(lambda: loop.run_until_complete(parse())),
        "decode_preprocess_us": timed(lambda: preprocess_bytes(image, info.preprocessing, max_pixels=10**8)),
        "json_stdlib_response_us": timed(lambda: StrictJSONResponse({**body_json, "embeddings": emb.tolist()})),
        "json_orjson_response_us": timed(lambda: json_response(body_json, emb, None)),
        "raw_response_us": timed(lambda: embeddings_response(RAW, emb, model_id=info.model_id, normalized=False,
                                                             kept_tokens=[49])),
        "npy_response_us": timed(lambda: embeddings_response(NPY, emb, model_id=info.model_id, normalized=False,
                                                             kept_tokens=[49])),
        "json_body_bytes": len(json_response(body_json, emb, None).body),
        "raw_body_bytes": emb.nbytes, "image_bytes": len(image), "request_bytes": len(raw),
    }
    loop.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "embed_profile.json")
    ap.add_argument("--note", default="", help="how the machine was shared (e.g. pinned to one core)")
    a = ap.parse_args()
    result: dict = {"machine": machine(), "bundle": str(a.bundle), "note": a.note,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "per_request_us": per_request_costs(a.bundle)}
    print("per request:", json.dumps(result["per_request_us"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="msn-prof-") as tmp:
        result["event_loop"] = [profiled_run(a.bundle, Path(tmp), accept, a.requests, a.batch)
                                for accept in (None, "application/octet-stream")]
    for r in result["event_loop"]:
        print(r["accept"], json.dumps({k: r[k] for k in ("loop_cpu_s", "share")}), flush=True)
    save_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
