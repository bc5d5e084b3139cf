"""docs/benchmarks.md: training throughput, serving, hostile requests and the soak, from benchmarks/results/*.json."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render import chaos, front_end, gpu, service_models, speed
from benchmarks.render.speed import faiss_lines, int8_lines
from benchmarks.render.text import machine_line
from benchmarks.render.vits import vits_section


def train_section(report: dict) -> list[str]:
    return [
        f"### `{report['preset']}`" + (f" ({', '.join(report['extra'])})" if report.get("extra") else ""),
        "",
        f"Machine: {machine_line(report['machine'])}. Overrides: `{' '.join(report['overrides'])}`.",
        "",
        markdown_table(report),
        "",
    ] + ([f"Note: {report['note']}", ""] if report.get("note") else [])


def serve_section(report: dict) -> list[str]:
    lines = [
        f"Machine: {machine_line(report['machine'])}. Bundle: `{Path(report['bundle']).name}`. The load generator",
        "runs on the same machine as the server.",
        "",
    ]
    if "ort_vs_torch" in report:
        ort = report["ort_vs_torch"]
        lines += [(f"ORT vs torch eager, batch {ort['batch']}, {ort['tokens']} tokens, {ort['threads']} threads: "
                   f"{ort['ort_ms_p50']:.1f} ms vs {ort['torch_eager_ms_p50']:.1f} ms per batch (p50), "
                   f"×{ort['speedup_ort_over_torch']:.2f}; max abs difference {ort['max_abs_diff']:.1e}."), ""]
    if "int8" in report:
        lines += int8_lines(report["int8"])
    else:
        lines += ["int8 vs fp32 ONNX Runtime: not in this results file.", ""]
    if "faiss_tuned" in report:
        lines += faiss_lines(report["faiss_tuned"])
    if "http" not in report:
        return lines
    lines += [
        "| single-image clients | images/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for row in report["http"] + [dict(report["http_mixed_masks"], concurrency="16, mixed mask ratios")]:
        lines.append(f"| {row['concurrency']} | {row['images_per_s']:.1f} | {row['p50_ms']:.1f} "
                     f"| {row['p99_ms']:.1f} |")
    offline = (
        f"Offline batched (decode + preprocess + ORT in one process): "
        f"{report['offline_batched']['images_per_s']:.1f} images/s; best HTTP / offline = "
        f"{report['http_best_vs_offline']:.2f}."
    )
    lines += ["", offline, ""]
    if report.get("faiss") and "faiss_tuned" not in report:  # files written before the tuner
        lines += [("FAISS through msn-serve's index store, on synthetic clustered vectors (n/1000 Gaussian clusters, "
                   "queries are perturbed data points), so IVF recall is optimistic compared with real embeddings."),
                  "",
                  "| vectors | dim | index | add vectors/s | search QPS (batched) | recall@10 vs exact |",
                  "|---|---|---|---|---|---|"]
        for row in report["faiss"]:
            for kind in ("flat", "ivf", "hnsw"):
                if kind in row:
                    r = row[kind]
                    name = kind if kind != "ivf" else f"ivf (nlist {r.get('nlist')}, nprobe {r.get('nprobe')})"
                    lines.append(f"| {row['n']:,} | {row['dim']} | {name} | {r['add_vectors_per_s']:,.0f} | "
                                 f"{r['search_qps_batched']:,.0f} | {r['recall@10_vs_flat']:.3f} |")
        lines.append("")
    return lines


def hostile_section(after: dict, before: dict | None) -> list[str]:
    """Hostile and heavy requests: this code, and the code before the fix when measured."""
    lines = [f"Machine: {machine_line(after['machine'])}. {after.get('note', '')}".rstrip(), ""]
    search = after.get("hostile_search")
    if search:
        lines += ["| hostile search (default limits) | status | answer |", "|---|---|---|"]
        for case, r in search["cases"].items():
            answer = r["error"] or f"{r['bytes']:,} bytes"
            lines.append(f"| {case} | {r['status']} | {answer} |")
        growth = (f"Peak memory (VmHWM) of the server grew by {search['peak_memory_growth_mb']:.0f} MB over these "
                  "requests (the issue's bar: 300 MB; before, one such request made a 10.5 GB response "
                  "and an OOM kill).")
        lines += ["", growth, ""]
    header = ("| code | fit (1800 examples, 360 classes) | /healthz p50 / p99 / max during the fit | "
              "8 x 6300² 16-bit PNGs: server CPU | peak memory growth |")
    lines += [header, "|---|---|---|---|---|"]
    for label, r in [("after", after)] + ([("before", before)] if before else []):
        h, im = r["healthz_during_fit"], r["images_16bit"]
        ms = h["healthz_ms"]
        lines.append(f"| {label} ({r['src']}) | {h['fit_wall_s']:.1f} s | {ms['p50']:.0f} / {ms['p99']:.0f} / "
                     f"{ms['max']:.0f} ms | {im['server_cpu_s']:.1f} s | {im['peak_memory_growth_mb']:.0f} MB |")
    big = after.get("healthz_during_big_body")
    if big:  # what tests/serve/test_big_body_liveness.py bounds (p99 under 1 s), measured here
        ms = big["healthz_ms"]
        lines += ["", f"/healthz while a {big['body_mb']:.0f} MB JSON fit body is parsed ({big['polls']} polls over "
                      f"{big['request_wall_s']:.1f} s): p50 {ms['p50']:.0f} ms, p99 {ms['p99']:.0f} ms, "
                      f"max {ms['max']:.0f} ms."]
    return lines + [""]


def soak_section(report: dict) -> list[str]:
    s, o = report["soak"], report["overload"]
    rss = s["rss"]
    machine = f"Machine: {machine_line(report['machine'])}. Bundle: {report['bundle']}. {report.get('note', '')}"
    summary = (f"Soak: {s['clients']} concurrent clients ({s['client_processes']} client processes) for "
               f"{s['seconds']:.0f} s: {s['requests']:,} requests ({s['requests_per_s']:.1f}/s), "
               f"**{s['errors']} errors**; server RSS {rss['after_1min_kb'] / 1024:.0f} MB after the first minute, "
               f"{rss['end_kb'] / 1024:.0f} MB at the end ({100 * rss['growth_after_1min']:+.1f} %), at most "
               f"{rss['max_kb'] / 1024:.0f} MB.")
    lines = [machine.rstrip(), "", summary, "", "| request | count | p50 ms | p99 ms |", "|---|---|---|---|"]
    for kind, r in s["latency_ms"].items():
        lines.append(f"| {kind} | {r['n']:,} | {r['p50']:.0f} | {r['p99']:.0f} |")
    overload = (f"Overload: the same {o['clients']} clients sending 8-image requests for {o['seconds']:.0f} s to a "
                f"server with a 16-image queue: {o['requests']:,} requests, {o['refused_503']:,} answered 503 "
                f"({o['retry_after_missing']} without Retry-After), {o['other_errors']} other errors.")
    return lines + ["", overload, ""]


def render(results: Path) -> str:
    """The whole of ``docs/benchmarks.md`` from the JSON files in ``results``."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.render` from `benchmarks/results/*.json`; do not edit by hand.",
        "Every table names the machine it was measured on. No GPU was available to the sessions that produced",
        "these files unless a table says so.",
        "",
        "## Training throughput vs. masking ratio",
        "",
        "`python -m benchmarks.training.train_throughput --preset NAME`: the real trainer on synthetic data, one fresh",
        "process per row; images/s is the median over logged windows after the first, peak memory is the",
        "process's max RSS (CPU) or max CUDA allocation (GPU). *msn* is the full step (masked anchor + focal views",
        "+ target); *anchor-only* drops the focal views, so the saving from dropped tokens shows undiluted (the",
        "target view is never masked and always costs one forward pass). The paper's ViT-L/7 on GPUs went from",
        "415 to 600 images/s and from 26 to 17 GB when masking.",
        "",
    ]
    for path in sorted(results.glob("train_throughput-*.json")):
        lines += train_section(json.loads(path.read_text()))
    serve = results / "serve_bench.json"
    if serve.exists():
        report = json.loads(serve.read_text())
        if not report.get("quick"):
            lines += ["## Serving", "",
                      (f"`python -m benchmarks.serving.serve_bench --bundle bundles/{Path(report['bundle']).name}`"
                       f"{' --only ' + ' '.join(report['sections']) if report.get('sections') else ''}."), ""]
            lines += serve_section(report)
            if "int8" not in report or "faiss_tuned" not in report:
                lines += [("These 2-core figures predate the int8, tuned-FAISS and HTTP measurements, which were "
                           "measured on one core (below). On an idle 2-core machine one command measures them all "
                           "(about an hour): `python -m benchmarks.serving.serve_bench --bundle bundles/bench`, with "
                           "`bundles/bench` exported from a Fashion-MNIST run as in "
                           "[serving.md](serving.md#benchmark)."), ""]
    vits = results / "vits_bench.json"
    if vits.exists() and "quick" not in (report := json.loads(vits.read_text()))["model"]:
        lines += ["## Serving ViT-S/16 at 224 px", "",
                  ("`python -m benchmarks.serving.vits_bench`: every runtime and precision `msn-serve` offers on "
                   "this CPU beside torch eager (the reference ceiling), what `--precision auto` serves, and HTTP "
                   "at 1, 16 and 64 clients."), ""]
        lines += vits_section(report)
    avx2 = results / "vits_bench-avx2.json"
    if avx2.exists():
        lines += ["### An AVX2-only CPU", "",
                  ("`python -m benchmarks.serving.vits_bench --out benchmarks/results/vits_bench-avx2.json`: "
                   "the same run on a machine with neither bf16 nor int8 dot-product units "
                   "(no AVX-512, VNNI or AMX)."), ""]
        lines += vits_section(json.loads(avx2.read_text()))
    demo = results / "vits_bench-demo.json"
    if demo.exists():
        report = json.loads(demo.read_text())
        lines += ["### The demo bundle", "",
                  ("`python -m benchmarks.serving.vits_bench --bundle bundles/demo --skip-http --batches 32`: the same "
                   "table for the 10-minute Fashion-MNIST encoder (its int8 graph added to a copy, guarded on "
                   "held-out Fashion-MNIST images)."), ""]
        lines += vits_section(report)
    lines += speed.sections(results)
    lines += front_end.section(results)
    lines += gpu.section(results)
    hostile = results / "serve_hostile.json"
    if hostile.exists():
        before = results / "serve_hostile-before.json"
        usage = ("`python -m benchmarks.serving.serve_hostile` (and `--src <tree of the code before> --skip-search "
                 "--out benchmarks/results/serve_hostile-before.json`).")
        lines += ["## Hostile and heavy requests", "", usage, ""]
        lines += hostile_section(json.loads(hostile.read_text()),
                                 json.loads(before.read_text()) if before.exists() else None)
        workers = results / "serve_hostile-workers.json"
        if workers.exists():
            lines += ["### With HTTP worker processes", "",
                      ("`python -m benchmarks.serving.serve_hostile --http-workers 2 --out "
                       "benchmarks/results/serve_hostile-workers.json`: the same requests to a server with two HTTP "
                       "processes (memory and CPU summed over the engine process and its HTTP processes)."), ""]
            lines += hostile_section(json.loads(workers.read_text()), None)
    soak = results / "serve_soak.json"
    if soak.exists() and not json.loads(soak.read_text()).get("quick"):
        usage = ("`python -m benchmarks.serving.serve_soak --clients 64 --duration 300`: mixed /embed, search, add and "
                 "predict requests; RSS sampled every second.")
        lines += ["## Load and soak", "", usage, ""]
        lines += soak_section(json.loads(soak.read_text()))
    lines += service_models.two_models_section(results) + service_models.embed_folder_section(results)
    lines += chaos.section(results)
    return "\n".join(lines).rstrip() + "\n"



def markdown_table(report: dict) -> str:
    """One row per run; speed-up is against the same variant (and precision and batch) without masking. Reports
    with a precision per row (fp32 beside bf16, each against the ceiling of its own precision) get two columns."""
    rows = report["rows"]
    per_precision = any("precision" in r for r in rows)

    def key(r: dict) -> tuple:
        return r["variant"], r.get("precision"), r.get("batch")

    head = "| variant | precision | batch " if per_precision else "| variant "
    lines = [head + "| mask ratio | images/s | speed-up | GFLOP/image | GFLOP/s | MFU | peak memory (GB) |",
             "|---" * (10 if per_precision else 8) + "|"]
    base = {key(r): r["images_per_sec"] for r in rows if r["mask_ratio"] == 0.0}
    for r in rows:
        speedup = f"×{r['images_per_sec'] / base[key(r)]:.2f}" if key(r) in base else "n/a"
        memory = r.get("peak_cuda_gb", r["peak_rss_gb"])
        flops = (f"{r['gflop_per_image']:.2f} | {r['achieved_gflops']:.0f} | {100 * r['mfu']:.0f} % of "
                 f"{r['ceiling_gflops']:.0f}" if "mfu" in r else "n/a | n/a | n/a")
        cells = f"| {r['variant']} | {r['precision']} | {r['batch']} " if per_precision else f"| {r['variant']} "
        lines.append(f"{cells}| {r['mask_ratio']:.1f} | {r['images_per_sec']:.1f} | {speedup} | "
                     f"{flops} | {memory:.2f} |")
    return "\n".join(lines)
