"""docs/benchmarks.md, "Front end and HTTP worker processes": ``frontend_bench.json`` and ``workers_bench.json``."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line, table

FRONTEND = ("`python -m benchmarks.serving.frontend_bench`: a real `msn-serve` whose engine is the instant engine (a "
            "benchmark instrument returning zeros: the front end alone is measured), 64 single-image clients sending "
            "224-px JPEGs (~25 KB) from two load-generator processes on the same machine, the server pinned to 1 and "
            "2 cores; images per server CPU-second counts every server process (engine process, HTTP processes, "
            "decode workers), not the load generator.")
WORKERS = ("`python -m benchmarks.serving.workers_bench --bundle BUNDLE`: a bundle of the demo's architecture "
           "(ViT-tiny, 28 px, ONNX Runtime fp32 pinned in the server and offline), Fashion-MNIST test images as PNG "
           "files from 64 clients, against the engine offline (`session.run` on batches of 64 preprocessed images, "
           "every core); then one client, instant engine and 224-px JPEGs, one process against two HTTP processes "
           "in interleaved rounds.")
ROUTES = ("`python -m benchmarks.serving.workers_bench --routes embed v1 oip --workers 0 2 --rounds 0`: the same "
          "bundle and images through every embedding route, one image per request from 64 clients: `/embed` "
          "(multipart), `/v1/embeddings` (a base64 data URL, JSON floats back) and OIP infer (the image's "
          "preprocessed `pixel_values` as `tritonclient` sends them, binary tensors in and out); with HTTP worker "
          "processes all three are prepared in the HTTP processes.")
ROUTE_NAMES = {"embed": "/embed", "v1": "/v1/embeddings", "oip": "OIP infer"}
MODES = {"threads": "one process, decode threads", "processes": "one process, decode worker processes",
         "http": "HTTP worker processes"}


def _frontend(report: dict) -> list[str]:
    rows = []
    for r in report["rows"]:
        mode = r.get("mode") or ("processes" if "worker" in r.get("decode", "") else "threads")
        spread = r.get("connections_per_http_process")
        rows.append([f"{r['cores']}", MODES.get(mode, mode), f"{r['images_per_s']:,.0f}",
                     f"{r['images_per_server_cpu_s']:,.0f}", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}",
                     " / ".join(str(c) for c in spread) if spread else ""])
    lines = [table(["cores", "front end", "images/s", "images per server CPU-s", "p50 / p99 ms",
                    "connections per HTTP process"], rows), ""]
    scaling = report.get("scaling_2_over_1_core", {})
    if scaling:
        lines += ["2 cores against 1: " + "; ".join(f"{MODES.get(m, m)} ×{v:.2f}" for m, v in scaling.items())
                  + " (target for HTTP worker processes: ×1.8 and 440 images per server CPU-second).", ""]
    return lines + [f"Machine: {machine_line(report['machine'])}.", ""]


def _workers(report: dict) -> list[str]:
    rows = []
    for setting, r in report["http"].items():
        fe = r.get("front_end") or {}
        rss = sorted(r.get("rss_mb", {}).values())
        rows.append([setting, str(fe.get("http_workers", setting)), f"{r['images_per_s']:,.0f}",
                     f"{r['vs_offline']:.2f}", f"{r['server_cpu_ms_per_image']:.2f}",
                     f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}", " + ".join(f"{x:.0f}" for x in reversed(rss))])
    lines = [f"Offline `session.run`: {report['offline_session_run_images_per_s']:,.0f} images/s.", "",
             table(["--http-workers", "HTTP processes", "images/s", "of offline", "server CPU ms/image",
                    "p50 / p99 ms", "RSS MB (engine + HTTP processes)"], rows), ""]
    one = report.get("one_client")
    if one:
        lines += [(f"One client: p50 {one['0']['p50_ms']:.2f} ms in one process, {one['2']['p50_ms']:.2f} ms with two "
                   f"HTTP processes ({one['added_p50_ms']:+.2f}; target ≤ +0.3); p99 {one['0']['p99_ms']:.2f} and "
                   f"{one['2']['p99_ms']:.2f} ms ({one['added_p99_ms']:+.2f}; target ≤ +1), medians of "
                   f"{len(one['0']['rounds'])} interleaved rounds."), ""]
    return lines + [f"Machine: {machine_line(report['machine'])}.", ""]


def _routes(report: dict) -> list[str]:
    """Every embedding route at each ``--http-workers`` (``workers_bench --routes``)."""
    rows = []
    for route, by_workers in report["routes"].items():
        for setting, r in by_workers.items():
            fe = r.get("front_end") or {}
            rows.append([ROUTE_NAMES.get(route, route), setting, str(fe.get("http_workers", setting)),
                         f"{r['images_per_s']:,.0f}", f"{r['vs_embed']:.2f}" if "vs_embed" in r else "",
                         f"{r['server_cpu_ms_per_image']:.2f}", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}"])
    return [table(["route", "--http-workers", "HTTP processes", "images/s", "of /embed's", "server CPU ms/image",
                   "p50 / p99 ms"], rows), "", f"Machine: {machine_line(report['machine'])}.", ""]


def section(results: Path) -> list[str]:
    lines = ["## Front end and HTTP worker processes", ""]
    frontend, workers = results / "frontend_bench.json", results / "workers_bench.json"
    routes = results / "workers_bench-routes.json"
    if frontend.exists():
        lines += [FRONTEND, ""] + _frontend(json.loads(frontend.read_text()))
    if workers.exists():
        lines += [WORKERS, ""] + _workers(json.loads(workers.read_text()))
    if routes.exists():
        lines += [ROUTES, ""] + _routes(json.loads(routes.read_text()))
    return lines if len(lines) > 2 else []
