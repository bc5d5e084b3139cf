"""A lean HTTP/1.1 load generator for ``POST /embed`` (and ``/v1/embeddings``, OIP infer): pre-built requests over
keep-alive sockets.

On a machine where the clients share cores with the server (the 2-core development VM, pinned to one core), a
general-purpose client such as httpx spends more CPU per request than the server does, so the measured throughput
would mostly say how fast the clients are. Here each request is bytes built once; a response is read as status
line + headers + ``Content-Length`` bytes. The request body is the Python client's
(:func:`msn_serve.client.multipart_body`), so the load is what :class:`msn_serve.client.Client` sends; only the
sending is done here, on raw sockets. Each client process also reports its own CPU time, and :func:`cpu_seconds`
reads a server's, so a benchmark can say where the core went.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from msn_serve.client.wire import multipart_body

BOUNDARY = "msnbenchboundary7d1c"
GATE_TIMEOUT_S = 600.0  # connections + warm-up of every client; a dead server fails the run instead of hanging


def embed_request(host: str, image: bytes, *, mask: str | None = None, accept: str | None = None,
                  normalize: bool = False, model: str | None = None) -> bytes:
    """The bytes of one ``POST /embed`` with one image: the client's multipart body (``mask`` is JSON text;
    ``model`` names one of several served models)."""
    body, ctype = multipart_body([("x.png", image, "image/png")],
                                 {"mask": mask, "normalize": "true" if normalize else None, "model": model},
                                 text_fields=("mask", "normalize", "model"), boundary=BOUNDARY)
    head = (f"POST /embed HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Accept: {accept}\r\n" if accept else "") + "\r\n")
    return head.encode() + body


def embeddings_request(host: str, image: bytes, *, model: str = "msn") -> bytes:
    """The bytes of one OpenAI-style ``POST /v1/embeddings`` with one image as a base64 PNG data URL (what the
    ``openai`` client sends, floats answered as JSON)."""
    body = json.dumps({"model": model, "input": f"data:image/png;base64,{base64.b64encode(image).decode()}",
                       "encoding_format": "float"}).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def infer_request(host: str, pixels: np.ndarray, *, model: str = "msn") -> bytes:
    """The bytes of one Open Inference Protocol ``POST /v2/models/{model}/infer`` with one image's ``pixel_values``
    (float32 ``(C, H, W)``, already preprocessed) as ``tritonclient.http`` sends it by default: Triton's binary
    tensor extension in, binary out."""
    tensor = np.ascontiguousarray(pixels[None], dtype="<f4").tobytes()
    header = json.dumps({"inputs": [{"name": "pixel_values", "shape": [1, *pixels.shape], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(tensor)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Length: {len(header) + len(tensor)}\r\n\r\n")
    return head.encode() + header + tensor


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, int]:
    """Send one request, read its whole response: ``(status, body bytes)``."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status, length


async def _run(port: int, requests: list[bytes], concurrency: int, ids: list[int], gate) -> dict:
    """Open every connection and warm each with two requests, wait at ``gate`` until every process has done so,
    then send ``ids`` over the connections. The timed part starts at the gate: warm-up requests still queued at
    the server would otherwise count against the timed ones (with ViT-S/16 on 2 cores, 64 clients' warm-up is
    several batches, and a fixed head start under-reported throughput by up to a third)."""
    conns = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)])
    for _ in range(2):  # warm the connections and the server's code paths
        await asyncio.gather(*[_exchange(reader, writer, requests[0]) for reader, writer in conns])
    await asyncio.get_running_loop().run_in_executor(None, gate.wait, GATE_TIMEOUT_S)
    start = time.time()
    lat: list[float] = []
    errors = 0
    counter = iter(ids)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal errors
        for i in counter:
            t0 = time.perf_counter()
            status, _ = await _exchange(reader, writer, requests[i % len(requests)])
            lat.append(time.perf_counter() - t0)
            errors += status != 200
        writer.close()

    cpu0 = time.process_time()
    await asyncio.gather(*[client(reader, writer) for reader, writer in conns])
    return {"lat": lat, "errors": errors, "start": start, "end": time.time(), "cpu_s": time.process_time() - cpu0}


def _process(args: tuple) -> dict:
    try:
        return asyncio.run(_run(*args))
    except BaseException:
        args[-1].abort()  # break the gate: the other processes and the caller stop waiting and see this error
        raise


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (all its threads), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(port: int, requests: list[bytes], concurrency: int, total: int, procs: int = 1,
        server_pid: int | None = None, server_cpu: Callable[[], float] | None = None) -> dict:
    """``concurrency`` single-image clients (one connection each) over ``procs`` processes, released together;
    ``total`` requests, cycling through ``requests``. Reports images/s, latency percentiles and CPU seconds (the
    server's from ``server_cpu`` when given, e.g. a process with its workers, else ``server_pid``'s own)."""
    if server_cpu is None and server_pid:
        def server_cpu() -> float:
            return cpu_seconds(server_pid)
    procs = max(1, min(procs, concurrency))
    ctx = get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        gate = manager.Barrier(procs + 1)  # the client processes and this one: the timed part starts together
        jobs = [(port, requests, concurrency // procs + (p < concurrency % procs), list(range(p, total, procs)),
                 gate) for p in range(procs)]
        futures = [pool.submit(_process, j) for j in jobs]
        try:
            gate.wait(GATE_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass  # a client process failed: f.result() below raises its error
        server_cpu0 = server_cpu() if server_cpu else None
        results = [f.result() for f in futures]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    lat = np.asarray([x for r in results for x in r["lat"]])
    out = {"concurrency": concurrency, "client_processes": procs, "requests": total,
           "errors": sum(r["errors"] for r in results), "images_per_s": total / wall,
           "p50_ms": float(1e3 * np.percentile(lat, 50)), "p99_ms": float(1e3 * np.percentile(lat, 99)),
           "client_cpu_s": round(sum(r["cpu_s"] for r in results), 3), "wall_s": round(wall, 3)}
    if server_cpu:
        out["server_cpu_s"] = round(server_cpu() - server_cpu0, 3)
        out["server_cpu_ms_per_image"] = 1e3 * out["server_cpu_s"] / total
    return out
