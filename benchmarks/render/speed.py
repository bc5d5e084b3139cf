"""Serving-speed sections of docs/benchmarks.md: int8 vs fp32, tuned FAISS at a million vectors, the one- and two-core
serve_bench runs and the profile of the ``/embed`` path."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line, sentence


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
                  f"| flat (exact) | - | 1.000 | {c['flat']['qps']:,.0f} "
                  f"| {c['flat']['memory_bytes'] / 1e6:,.0f} | - |"]
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



def _accept(row: dict) -> str:
    return {"application/json": "JSON", "application/octet-stream": "raw float32"}.get(row.get("accept"), "JSON")


def http_lines(report: dict) -> list[str]:
    """Single-image clients, the interleaved 64-client rounds against offline, and the verdict on the targets."""
    lines = ["| single-image clients | response | images/s | p50 ms | p99 ms | server CPU ms / image |",
             "|---|---|---|---|---|---|"]
    rows = report["http"] + [dict(report["http_mixed_masks"], concurrency="16, mixed mask ratios")]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {_accept(r)} | {r['images_per_s']:.1f} | {r['p50_ms']:.0f} | "
                     f"{r['p99_ms']:.0f} | {r.get('server_cpu_ms_per_image', float('nan')):.2f} |")
    offs = report.get("offline_runs", [report["offline_batched"]])
    lines += ["", ("Offline batched (decode + preprocess + ORT in one process, batch "
                   f"{report['offline_batched']['batch']}), runs interleaved with the 64-client rounds: "
                   + ", ".join(f"{o['images_per_s']:.1f}" for o in offs) + " images/s, "
                   + ", ".join(f"{o['cpu_ms_per_image']:.2f}" for o in offs) + " CPU ms / image."), ""]
    lines += [("| 64 clients | HTTP / offline (wall, per round) | HTTP / offline (CPU per image) | p99 ms | "
              "bound: max-wait + 2 batch times |"), "|---|---|---|---|---|"]
    for accept, r in report.get("http_64", {}).items():
        rounds = ", ".join(f"{x:.2f}" for x in r["http_vs_offline_rounds"])
        lines.append(f"| {_accept({'accept': accept})} | {r['http_vs_offline']:.2f} ({rounds}) | "
                     f"{r['http_vs_offline_cpu']:.2f} | {r['p99_ms']:.0f} | {r['p99_bound_ms']:.0f} |")
    return lines + [""]


def one_core_section(report: dict) -> list[str]:
    m = report["machine"]
    cores, threads = m["cores_visible"], report.get("threads", 1)
    lines = [f"Machine: {machine_line(m)}, {cores} core{'s' if cores > 1 else ''} used ({threads} ONNX Runtime "
             f"/ FAISS thread{'s' if threads > 1 else ''}). {sentence(report.get('note', ''))}".rstrip(), ""]
    if "int8" in report:
        lines += int8_lines(report["int8"])
    if "faiss_tuned" in report:
        lines += faiss_lines(report["faiss_tuned"])
    if "http" in report:
        lines += http_lines(report)
    return lines


def profile_section(report: dict) -> list[str]:
    us = report["per_request_us"]
    lines = [f"Machine: {machine_line(report['machine'])}. {sentence(report.get('note', ''))}".rstrip(), "",
             ("Per request, in-process (µs): "
             f"multipart parse {us['multipart_parse_us']:.0f}, decode + preprocess {us['decode_preprocess_us']:.0f}, "
             f"response with standard-library JSON {us['json_stdlib_response_us']:.0f} (before), orjson JSON "
             f"{us['json_orjson_response_us']:.0f} (now), raw float32 {us['raw_response_us']:.0f}, .npy "
             f"{us['npy_response_us']:.0f}; bodies: JSON {us['json_body_bytes']:,} bytes, raw "
             f"{us['raw_body_bytes']:,}, request {us['request_bytes']:,}."), ""]
    runs = report["event_loop"]
    labels = list(runs[0]["share"])
    lines += ["| event-loop CPU at 64 clients (cProfile, thread CPU time) | "
              + " | ".join(_accept(r) + " responses" for r in runs) + " |",
              "|---|" + "---|" * len(runs)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{100 * r['share'].get(label, 0):.0f} %" for r in runs) + " |")
    ab = report.get("decode_pool_vs_event_loop")
    if ab:
        def mean(mode: str, key: str) -> float:
            xs = [r[key] for r in ab["runs"] if r["mode"] == mode]
            return sum(xs) / len(xs)
        lines += ["", (f"Decoding in the pre-processing pool vs in the event loop ({ab['note']}): pool "
                       f"{mean('pool', 'images_per_s'):.1f} images/s, {mean('pool', 'server_cpu_ms_per_image'):.2f} "
                       f"server CPU ms / image, p99 {mean('pool', 'p99_ms'):.0f} ms; event loop "
                       f"{mean('inline', 'images_per_s'):.1f} images/s, "
                       f"{mean('inline', 'server_cpu_ms_per_image'):.2f} ms / image, p99 "
                       f"{mean('inline', 'p99_ms'):.0f} ms.")]
    return lines + [""]


def _faiss_section(report: dict, title: str, command: str) -> list[str]:
    return [title, "", command, "",
            f"Machine: {machine_line(report['machine'])}. {sentence(report.get('note', ''))}".rstrip(), "",
            *faiss_lines(report["faiss_tuned"])]


def sections(results: Path) -> list[str]:
    lines: list[str] = []
    two = results / "serve_bench-2core.json"
    if two.exists():
        report = json.loads(two.read_text())
        lines += ["## Serving speed on two idle cores", "",
                  (f"`python -m benchmarks.serving.serve_bench --bundle bundles/{Path(report['bundle']).name} "
                   f"--only {' '.join(report['sections'])} --out benchmarks/results/serve_bench-2core.json`, "
                   "with nothing else running."), ""]
        lines += one_core_section(report)
    one = results / "serve_bench-1core.json"
    if one.exists():
        report = json.loads(one.read_text())
        lines += ["## Serving speed on one core", "",
                  ("`taskset -c 1 python -m benchmarks.serving.serve_bench "
                   f"--bundle bundles/{Path(report['bundle']).name} "
                   f"--only {' '.join(report['sections'])} --client-procs 1` (with `OMP_NUM_THREADS=1`)."), ""]
        lines += one_core_section(report)
    faiss = results / "faiss_1m-2core.json"
    if faiss.exists():
        report = json.loads(faiss.read_text())
        lines += _faiss_section(report, "### FAISS at a million vectors, two cores",
                                f"`python -m benchmarks.serving.faiss_bench --kinds {' '.join(report['kinds'])} "
                                "--corpora "
                                f"{' '.join(c['corpus'] for c in report['faiss_tuned'])}`, nothing else running.")
    faiss = results / "faiss_1m-1core.json"
    if faiss.exists():
        report = json.loads(faiss.read_text())
        lines += _faiss_section(report, "### FAISS at a million vectors, one core",
                                f"`taskset -c 1 python -m benchmarks.serving.faiss_bench --bundle bundles/"
                                f"{Path(report['bundle']).name} --kinds {' '.join(report['kinds'])}` "
                                "(with `OMP_NUM_THREADS=1`).")
    prof = results / "embed_profile.json"
    if prof.exists():
        lines += ["### Where `/embed` spends its CPU", "",
                  "`taskset -c 1 python -m benchmarks.serving.embed_profile --bundle bundles/bench`.", ""]
        lines += profile_section(json.loads(prof.read_text()))
    return lines
