"""Regenerate docs/benchmarks.md from the JSON files the benchmark scripts wrote to benchmarks/results/.

    python benchmarks/render_docs.py

Nothing here measures: every figure comes from a results file, with the machine it was measured on.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"


def machine_line(machine: dict) -> str:
    parts = [machine.get("gpu") or machine.get("cpu", "unknown CPU")]
    cores = machine.get("cpu_count") or machine.get("cores_visible")
    if cores:
        parts.append(f"{cores} cores visible")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


def train_section(report: dict) -> list[str]:
    from train_throughput import markdown_table

    return [
        f"### `{report['preset']}`",
        "",
        f"Machine: {machine_line(report['machine'])}. Overrides: `{' '.join(report['overrides'])}`.",
        "",
        markdown_table(report),
        "",
    ] + ([f"Note: {report['note']}", ""] if report.get("note") else [])


def int8_lines(r: dict) -> list[str]:
    ips, up = r["images_per_s"], r["speedup"]
    best = max(up.values())
    verdict = "meets the ×2 target" if best >= r["target_speedup"] else (
        f"short of the ×{r['target_speedup']:g} target by ×{r['target_speedup'] / best:.2f}")
    g = r["guard"]
    lowshot = ", ".join(f"{k.replace('imgs_class', '-shot')} {v['int8']:.1f} vs {v['fp32']:.1f} %"
                        for k, v in (g["lowshot"] or {}).items())
    return [(f"int8 vs fp32 ONNX Runtime, batch {r['batch']}, {r['tokens']} tokens, {r['threads']} threads, runs "
            f"interleaved: fp32 {ips['fp32']:.1f} images/s, dynamic int8 {ips['dynamic']:.1f} (×{up['dynamic']:.2f}), "
            f"static int8 {ips['static']:.1f} (×{up['static']:.2f}); {verdict}. The bundle's int8 graph "
            f"({r['bundle_method']}) passed the export guard on {g['heldout_images']:,} held-out images: min cosine "
            f"to fp32 {g['cosine_min']:.4f} (half-masked {g['cosine_masked_min']:.4f}); low-shot int8 vs fp32: "
            f"{lowshot or 'skipped'}."), ""]


def faiss_lines(corpora: list[dict]) -> list[str]:
    lines = []
    for c in corpora:
        what = ("synthetic clustered vectors" if c["corpus"] == "clustered" else
                f"Fashion-MNIST train embeddings of `{c.get('model_id')}` replicated with noise "
                f"({c['real_vectors']:,} real vectors), queries from the test split")
        best = c.get("best")
        verdict = (f"best: {best['plan']['type']} at {best['qps']:,.0f} queries/s "
                   f"({'meets' if best['qps'] >= 5000 else 'short of'} the 5,000 target)" if best
                   else "no kind reached the target recall")
        lines += [(f"{c['n']:,} × {c['dim']}, {what}; tuned on {c['tuning_queries']:,} held-out queries to "
                  f"recall@10 ≥ {c['target_recall']}, measured on {c['evaluation_queries']:,} others, "
                  f"{c['threads']} FAISS threads; {verdict}."), "",
                  "| index | tuned parameters | recall@10 | batched queries/s | memory (MB) | build s |",
                  "|---|---|---|---|---|---|",
                  f"| flat (exact) | - | 1.000 | {c['flat']['qps']:,.0f} | {c['flat']['memory_bytes'] / 1e6:,.0f} | - |"]
        for r in c["kinds"]:
            p = r["plan"]
            name = {"ivf": f"IVF-Flat {p['nlist']}", "hnsw": f"HNSW{p['hnsw_m']}",
                    "ivfpq": f"IVF{p['nlist']}-PQ{p['pq_m']}{'x4 fast-scan' if p['fastscan'] else ''}"
                             f"{' + exact re-rank' if p['k_factor'] else ''}"}[p["type"]]
            knobs = ", ".join(f"{k} {r[k]}" for k in ("nprobe", "ef_search", "k_factor") if k in r)
            gpu = f" (GPU: {r['gpu']['qps']:,.0f})" if r.get("gpu") else ""
            lines.append(f"| {name} | {knobs} | {r['recall']:.3f} | {r['qps']:,.0f}{gpu} | "
                         f"{r['memory_bytes'] / 1e6:,.0f} | {r['build_s']:.0f} |")
        lines.append("")
    return lines


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
        lines.append(f"| {row['concurrency']} | {row['images_per_s']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
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
    """Issue 12's hostile and heavy requests: this code, and the code before the fix when measured."""
    lines = [f"Machine: {machine_line(after['machine'])}. {after.get('note', '')}".rstrip(), ""]
    search = after.get("hostile_search")
    if search:
        lines += ["| hostile search (default limits) | status | answer |", "|---|---|---|"]
        for case, r in search["cases"].items():
            answer = r["error"] or f"{r['bytes']:,} bytes"
            lines.append(f"| {case} | {r['status']} | {answer} |")
        growth = (f"Peak memory (VmHWM) of the server grew by {search['peak_memory_growth_mb']:.0f} MB over these "
                  "requests (the issue's bar: 300 MB; before, one such request made a 10.5 GB response and an OOM kill).")
        lines += ["", growth, ""]
    header = ("| code | fit (1800 examples, 360 classes) | /healthz p50 / p99 / max during the fit | "
              "8 x 6300² 16-bit PNGs: server CPU | peak memory growth |")
    lines += [header, "|---|---|---|---|---|"]
    for label, r in [("after", after)] + ([("before", before)] if before else []):
        h, im = r["healthz_during_fit"], r["images_16bit"]
        ms = h["healthz_ms"]
        lines.append(f"| {label} ({r['src']}) | {h['fit_wall_s']:.1f} s | {ms['p50']:.0f} / {ms['p99']:.0f} / "
                     f"{ms['max']:.0f} ms | {im['server_cpu_s']:.1f} s | {im['peak_memory_growth_mb']:.0f} MB |")
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


def main() -> None:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/render_docs.py` from `benchmarks/results/*.json`; do not edit by hand.",
        "Every table names the machine it was measured on. No GPU was available to the sessions that produced",
        "these files unless a table says so.",
        "",
        "## Training throughput vs. masking ratio",
        "",
        "`python benchmarks/train_throughput.py --preset NAME`: the real trainer on synthetic data, one fresh",
        "process per row; images/s is the median over logged windows after the first, peak memory is the",
        "process's max RSS (CPU) or max CUDA allocation (GPU). *msn* is the full step (masked anchor + focal views",
        "+ target); *anchor-only* drops the focal views, so the saving from dropped tokens shows undiluted (the",
        "target view is never masked and always costs one forward pass). The paper's ViT-L/7 on GPUs went from",
        "415 to 600 images/s and from 26 to 17 GB when masking.",
        "",
    ]
    for path in sorted(RESULTS.glob("train_throughput-*.json")):
        lines += train_section(json.loads(path.read_text()))
    serve = RESULTS / "serve_bench.json"
    if serve.exists():
        report = json.loads(serve.read_text())
        if not report.get("quick"):
            lines += ["## Serving", "", (f"`python benchmarks/serve_bench.py --bundle bundles/{Path(report['bundle']).name}`"
                      f"{' --only ' + ' '.join(report['sections']) if report.get('sections') else ''}."), ""]
            lines += serve_section(report)
            if "int8" not in report or "faiss_tuned" not in report:
                lines += [("These 2-core figures predate issue 15; its int8, tuned-FAISS and HTTP figures were "
                           "measured on one core (below). On an idle 2-core machine one command measures them all "
                           "(about an hour): `python benchmarks/serve_bench.py --bundle bundles/bench`, with "
                           "`bundles/bench` exported from a Fashion-MNIST run as in "
                           "[serving.md](serving.md#benchmark)."), ""]
    import render_speed

    lines += render_speed.sections(RESULTS)
    hostile = RESULTS / "serve_hostile.json"
    if hostile.exists():
        before = RESULTS / "serve_hostile-before.json"
        usage = ("`python benchmarks/serve_hostile.py` (and `--src <tree of the code before> --skip-search "
                 "--out benchmarks/results/serve_hostile-before.json`).")
        lines += ["## Hostile and heavy requests (issue 12)", "", usage, ""]
        lines += hostile_section(json.loads(hostile.read_text()),
                                 json.loads(before.read_text()) if before.exists() else None)
    soak = RESULTS / "serve_soak.json"
    if soak.exists() and not json.loads(soak.read_text()).get("quick"):
        usage = ("`python benchmarks/serve_soak.py --clients 64 --duration 300`: mixed /embed, search, add and "
                 "predict requests; RSS sampled every second.")
        lines += ["## Load and soak", "", usage, ""]
        lines += soak_section(json.loads(soak.read_text()))
    DOC.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {DOC}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
