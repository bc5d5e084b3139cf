"""The serving front end alone: ``/embed`` of 224-px JPEGs through the real HTTP stack, engine replaced by an
INSTANT ENGINE (a benchmark instrument returning zeros; :mod:`benchmarks.serving.instant_engine`).

Why: a GPU engine embeds thousands of images/s, so what bounds HTTP throughput is the CPU work per image around it
(HTTP, multipart, decode, resize, normalise, response). This measures that work on any machine: images/s at 64
clients, and the **server's CPU-seconds** (the server process and every descendant, e.g. decode workers, read from
``/proc`` at the start and end of the timed part; the load generator's CPU is not counted) -> images per server
CPU-second; then the server pinned to 1 core and to 2 cores (``os.sched_setaffinity`` on it and its workers), for
threads (``--preprocess-threads``) and worker processes (``--preprocess-workers``).

    python -m benchmarks.serving.frontend_bench                      # the measurement (machine alone)
    python -m benchmarks.serving.frontend_bench --seconds 2 --clients 4 --out /tmp/fe.json   # a smoke run
"""
from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, machine, save_json
from benchmarks.serving import http_load
from benchmarks.serving.instant_engine import RUNTIME
from benchmarks.serving.serve_harness import start_server
from msn_core.bundle import Architecture, BundleInfo, Preprocessing, write_bundle_info

ENGINE = "instant-engine (benchmark instrument: returns zeros at once; the front end alone is measured)"


def instant_bundle(out: Path) -> Path:
    """A ViT-S/16 224-px bundle's ``msn.json`` (resize 256, crop 224) and an empty ``model.onnx`` nothing reads."""
    out.mkdir(parents=True, exist_ok=True)
    info = BundleInfo("frontend-bench-instant", Architecture("vit_small", 224, 16, 384, 12, 6),
                      Preprocessing(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
    write_bundle_info(out, info)
    (out / "model.onnx").write_bytes(b"")
    return out


def jpegs(n: int, seed: int = 0) -> list[bytes]:
    """224x224 photos-like JPEGs of about 25 KB: smooth colour fields with grain."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        base = Image.fromarray(rng.integers(0, 256, (14, 14, 3), dtype=np.uint8)).resize((224, 224),
                                                                                          Image.Resampling.BICUBIC)
        grain = rng.normal(0, 9, (224, 224, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(np.asarray(base) + grain, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def server_stack() -> dict:
    """The HTTP parser and event loop the server ran on (``--http auto``; uvloop when installed)."""
    from msn_core.optional import available
    from msn_serve.http.server import http_implementation

    return {"http": http_implementation("auto"), "loop": "uvloop" if available("uvloop") else "asyncio"}


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += _children(p)
        except OSError:
            pass
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (decode workers included)."""
    total = 0.0
    for p in tree(pid):
        try:
            total += http_load.cpu_seconds(p)
        except OSError:
            pass  # exited between listing and reading
    return total


def pin(pid: int, cores: set[int]) -> None:
    for p in tree(pid):
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cores)
            except OSError:
                pass


MODES = {"threads": "decode threads in one process", "processes": "decode worker processes beside one HTTP process",
         "http": "HTTP worker processes (--http-workers, one per core) around the engine process"}


def mode_args(mode: str, n: int) -> list[str]:
    return {"threads": ["--preprocess-threads", str(n)], "processes": ["--preprocess-workers", str(n)],
            "http": ["--http-workers", str(n)]}[mode]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def front_end(url: str) -> dict:
    """What /readyz says of the front end (HTTP processes, their connections), or {}."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/readyz", timeout=10) as r:
        return json.loads(r.read()).get("front_end", {})


def measure(bundle: Path, data: Path, requests: list[bytes], *, cores: set[int], mode: str, clients: int,
            seconds: float, client_procs: int, launcher: list[str] | None = None,
            extra: tuple[str, ...] = (), src: Path | None = None) -> dict:
    """One server, pinned to ``cores``, in ``mode`` (:data:`MODES`, one decode thread/process or HTTP process a
    core), its engine the instant engine unless ``launcher`` says otherwise."""
    n = len(cores)
    args = ["--max-batch-size", "64", "--queue-size", "4096", *mode_args(mode, n), *extra]
    proc, url = start_server(bundle, data, args, launcher=launcher or ["-m", "benchmarks.serving.instant_engine"],
                             **({"src": src} if src else {}))
    port = int(url.rsplit(":", 1)[1])
    try:
        time.sleep(0.5 if mode != "threads" else 0)  # the worker processes finish starting
        pin(proc.pid, cores)
        probe = http_load.run(port, requests, clients, max(clients * 2, 64), client_procs,
                              server_cpu=lambda: tree_cpu_seconds(proc.pid))
        total = max(clients * 2, int(probe["images_per_s"] * seconds))
        r = http_load.run(port, requests, clients, total, client_procs,
                          server_cpu=lambda: tree_cpu_seconds(proc.pid))
        processes = tree(proc.pid)
        r["server_processes"] = len(processes)
        r["rss_mb"] = {str(p): round(rss_kb(p) / 1024, 1) for p in processes}
        fe = front_end(url)
        if fe.get("processes"):
            r["connections_per_http_process"] = [p["connections"] for p in fe["processes"]]
    finally:
        proc.terminate()
        proc.wait(30)
    r.update(cores=n, mode=mode, decode=MODES.get(mode, mode),
             images_per_server_cpu_s=round(r["requests"] / r["server_cpu_s"], 1) if r["server_cpu_s"] else None,
             images_per_s=round(r["images_per_s"], 1))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="timed part of each configuration")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2, help="load-generator processes")
    ap.add_argument("--cores", default="1,2", help="server core counts to measure (the first N allowed cores)")
    ap.add_argument("--modes", default="threads,processes,http",
                    help="threads, processes (decode workers) and/or http (HTTP worker processes), one per core")
    ap.add_argument("--src", type=Path, help="source tree whose msn_serve runs (default: this one), e.g. the code "
                                             "before a change, in a git worktree")
    ap.add_argument("--compare-src", type=Path, help="A/B instead: this tree against another (e.g. the code before a "
                                                     "change, in a git worktree), in interleaved rounds")
    ap.add_argument("--rounds", type=int, default=3, help="--compare-src: rounds")
    ap.add_argument("--out", type=Path, default=RESULTS / "frontend_bench.json")
    a = ap.parse_args()
    if a.compare_src:
        compare(a)
        return
    allowed = sorted(os.sched_getaffinity(0))
    requests = [http_load.embed_request("127.0.0.1", j) for j in jpegs(16)]
    sizes = [len(j) for j in jpegs(16)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = instant_bundle(Path(tmp) / "bundle")
        for n in [int(c) for c in a.cores.split(",")]:
            if n > len(allowed):
                print(f"skipping {n} cores: only {len(allowed)} allowed here")
                continue
            for mode in a.modes.split(","):
                r = measure(bundle, Path(tmp) / f"data-{n}-{mode}", requests, cores=set(allowed[:n]), mode=mode,
                            clients=a.clients, seconds=a.seconds, client_procs=a.client_procs, src=a.src)
                rows.append(r)
                print(f"[{RUNTIME}] {n} core(s), {mode}: {r['images_per_s']} images/s, "
                      f"{r['server_cpu_s']} server CPU-s for {r['requests']} -> {r['images_per_server_cpu_s']} "
                      f"images per server CPU-second; p50 {r['p50_ms']:.1f} ms, errors {r['errors']}")
    scaling = {}
    for mode in MODES:
        by = {r["cores"]: r["images_per_s"] for r in rows if r["mode"] == mode}
        if 1 in by and 2 in by:
            scaling[mode] = round(by[2] / by[1], 2)
            print(f"2 cores / 1 core, {mode}: {scaling[mode]}x")
    save_json(a.out, {"benchmark": "frontend_bench", "engine": ENGINE, "request": "POST /embed, one 224x224 JPEG",
                      "jpeg_bytes_mean": round(float(np.mean(sizes))), "clients": a.clients,
                      "seconds": a.seconds, "rows": rows, "scaling_2_over_1_core": scaling,
                      "server_stack": server_stack(), "src": str(a.src) if a.src else "this tree",
                      "note": "the load generator runs on the same machine; its CPU is not counted as the server's",
                      "machine": machine(torch_info=False)})  # no torch in this benchmark: importing it is seconds


def compare(a: argparse.Namespace) -> None:
    """This tree against ``a.compare_src``, each configuration in alternating rounds (the machine's drift between
    two runs minutes apart was larger than the difference sought)."""
    allowed = sorted(os.sched_getaffinity(0))
    requests = [http_load.embed_request("127.0.0.1", j) for j in jpegs(16)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = instant_bundle(Path(tmp) / "bundle")
        for rnd in range(a.rounds):
            for n in [int(c) for c in a.cores.split(",") if int(c) <= len(allowed)]:
                for mode in a.modes.split(","):
                    for src in (None, a.compare_src):
                        r = measure(bundle, Path(tmp) / f"data-{rnd}-{n}-{mode}-{src is None}", requests,
                                    cores=set(allowed[:n]), mode=mode, clients=a.clients, seconds=a.seconds,
                                    client_procs=a.client_procs, src=src)
                        r.update(round=rnd, src=str(src) if src else "this tree")
                        rows.append(r)
                        print(f"round {rnd}, {r['src']}, {n} core(s), {mode}: {r['images_per_s']} images/s, "
                              f"{r['images_per_server_cpu_s']} per server CPU-s", flush=True)
    summary = {}
    for key in sorted({(r["src"], r["cores"], r["mode"]) for r in rows}):
        rates = [r["images_per_s"] for r in rows if (r["src"], r["cores"], r["mode"]) == key]
        summary[" / ".join(map(str, key))] = {"images_per_s_mean": round(float(np.mean(rates)), 1),
                                               "images_per_s": rates}
    print(summary)
    save_json(a.out, {"benchmark": "frontend_bench --compare-src", "engine": ENGINE, "clients": a.clients,
                      "seconds": a.seconds, "rows": rows, "summary": summary,
                      "machine": machine(torch_info=False)})


if __name__ == "__main__":
    main()
