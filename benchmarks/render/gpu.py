"""The GPU run's tables (benchmarks/gpu/run.py; docs/gpu-run.md) from ``benchmarks/results/gpu/*.json``."""
from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _offline(report: dict) -> list[str]:
    lines = ["| batch | input | " + " | ".join(_NAMES) + " |", "|" + "---|" * (len(_NAMES) + 2)]
    for batch, rows in report["offline"]["batches"].items():
        for label, row in rows.items():
            cells = [f"{row[n]['images_per_s']:,.0f}" if n in row else "–" for n in _NAMES]
            lines.append(f"| {batch} | {label.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return lines


_NAMES = ["ort-cuda/fp32", "ort-cuda/fp32-plain", "ort-cuda/fp16", "ort-cuda/fp16-plain", "torch-cuda/fp32",
          "torch-cuda/bf16", "ort-cpu/fp32"]


def _flags(m: dict) -> str:
    flags = ", ".join(f for f in m.get("cpu_flags", []) if f != "fma") or "flags not recorded"
    return f"{m['cpu_count']}-core {m['cpu']} ({flags}), torch {m.get('torch', '?')}"


def cpu_pairing(report: dict) -> list[str]:
    """The pairing at the real model on a CPU (``benchmarks.gpu.training --device cpu``): what the GPU run will
    measure, proven to run, and the like-for-like step ratio on this machine; a row per bf16 attention kernel
    (``--cpu-attention``) and what the trainer's timing chose among them."""
    batch = report["rows"][0]["batch"]
    focal = next((o.split("=")[1] for o in report["overrides"] if o.startswith("mask.num_focal=")), "?")
    labels = [r["cpu_attention"] for r in report["rows"] if r.get("cpu_attention") and r["precision"] == "bf16"]
    kernels = " ".join(dict.fromkeys(k for label in labels for k in label.split(": "))) or "auto"  # auto: explicit
    lines = ["### The same pairing on a CPU", "",
             (f"`python -m benchmarks.gpu.training --device cpu --batch {batch} --steps 4 --cpu-attention {kernels} "
              f"--official DIR` (`benchmarks/results/training-pairing-cpu/pairing.json`; {_flags(report['machine'])}; "
              f"the machine otherwise alone): the real ViT-S/16 pairing above at batch {batch} with {focal} focal "
              "views. *step*, *on views*, *augmentation*: our step whole, on views made beforehand (what the "
              "official row times), and the augmentation alone (`benchmarks/training/step_breakdown.py`). "
              "*attention*: the bf16 CPU kernel (`run.cpu_attention`; fp32 is always SDPA); *auto* is what the "
              "trainer's timing pass chose on this pairing."), "",
             ("| precision | attention | ours: trainer images/s | official images/s | ours: s/step (step / on views / "
              "augmentation) | official s/step | ours on views vs official |"), "|---|---|---|---|---|---|---|"]
    for key, parts in report["breakdown"].items():
        rows = {r["implementation"]: r for r in report["rows"] if r.get("key", r["precision"]) == key}
        ph = {k: v["s_per_step"] for k, v in parts["phases"].items()}
        official = rows.get("official", {})
        lines.append(f"| {rows['ours']['precision']} | {parts.get('cpu_attention', 'sdpa')} | "
                     f"{rows['ours']['images_per_sec']:.2f} | "
                     f"{official.get('images_per_sec', float('nan')):.2f} | {ph['step']:.2f} / "
                     f"{ph['step_on_views']:.2f} / {ph['augment']:.2f} | "
                     f"{official.get('step_s_median', float('nan')):.2f} | "
                     f"×{parts.get('speedup_on_views_vs_official', float('nan')):.2f} |")
    for precision, timing in report.get("speed_timing", {}).items():
        rates = ", ".join(f"{k} {v:.2f}" for k, v in timing["images_per_second"].items())
        lines += ["", (f"The trainer's timing pass on this pairing in {precision} "
                       "(`training/run/precision_timing.py`"
                       f", {timing['steps']} steps undone, {timing['seconds']:.0f} s; "
                       "threads kept at torch's default): "
                       f"{rates} images/s; it chose **{timing['chosen']['run.cpu_attention']}**.")]
    return lines + [""]


def section(results: Path) -> list[str]:
    gpu = results / "gpu"
    serving, http = _load(gpu / "serving-h100.json"), _load(gpu / "serving-h100-http.json")
    training, tests, faiss = (_load(gpu / f"{n}-h100.json") for n in ("training", "tests", "faiss"))
    if serving is None and training is None:
        return []
    lines = ["## The GPU run", "",
             ("`benchmarks/gpu/` ([gpu-run.md](gpu-run.md)): one NVIDIA H100 80GB (16 Intel Xeon host cores), "
              "driver 580.159.04, torch 2.11.0+cu130, onnxruntime-gpu 1.31.1 carried in parts. ViT-S/16 at 224 px with "
              "**random weights**. Each figure is one run; the device time was 15 minutes in all."), ""]
    if tests is not None:
        failed = "; ".join(f"`{k}`: {v}" for k, v in tests["failed"].items()) or "none"
        lines += [(f"**CUDA-marked tests** (`{tests['command']}`): {len(tests['passed'])} passed "
                   f"({', '.join('`' + t + '`' for t in tests['passed'])}); failed: {failed}."), ""]
    if serving is not None:
        lines += ["### Serving, offline (images/s)", "",
                  ("`python -m benchmarks.gpu.serving`: ONNX Runtime CUDA through the serving engine (IOBinding) and "
                   "through plain `session.run` (*-plain*), torch eager on the GPU (the reference ceiling), and the "
                   "CPU provider of the same machine; every output within cosine 0.9999 of ORT CPU fp32 (torch bf16 "
                   "0.99995). *half masked*: half of the 196 patches kept. Runners interleaved, median of "
                   "3 rounds × 5 runs."), ""]
        lines += _offline(serving) + [""]
        full = serving["offline"]["batches"]["64"]["full"]
        fp16 = full["ort-cuda/fp16"]["images_per_s"]
        lines += [(f"At batch 64: fp16 {fp16 / full['ort-cuda/fp32']['images_per_s']:.2f}"
                   f" × fp32 (target 1.5); the served fp16 engine {fp16 / full['torch-cuda/bf16']['images_per_s']:.2f}"
                   " × torch bf16 eager (target 1.0). IOBinding as the engine bound it then (fresh device copies of "
                   "the inputs every batch) did not pay: plain `session.run` was faster in every row above, so the "
                   "engine now runs plain `session.run` on CUDA too (the *-plain* columns)."), ""]
    if http is not None and "http" in http:
        lines += _http(http["http"])
    if training is not None:
        c = training["ceilings_gflops"]
        lines += ["### Pretraining beside the official step", "",
                  ("`python -m benchmarks.gpu.training`: ViT-S/16, batch 64, views 1 + 10 focal (96 px) + target, "
                   "patch drop 0.15. *ours*: the real trainer on synthetic images (augmentation on the GPU inside "
                   "the step, from its metrics); *official*: facebookresearch/msn's step (`init_model`, `init_opt`, "
                   "`init_msn_loss`, the `train_step` body) on views already on the GPU, its data pipeline excluded "
                   "as its own timer excludes it; its bf16 is our autocast wrapper "
                   "(the official code trains in fp32). Peaks measured in the same run: "
                   f"bf16 {c['bf16'] / 1e3:,.0f} TFLOP/s, fp32 {c['fp32'] / 1e3:,.1f}."),
                  "", "| precision | implementation | images/s | MFU (bf16 peak) | MFU (own peak) | peak GB |",
                  "|---|---|---|---|---|---|"]
        for r in training["rows"]:
            if "images_per_sec" not in r:
                continue
            lines.append(f"| {r['precision']} | {r['implementation']} | {r['images_per_sec']:.0f} | "
                         f"{100 * r['mfu_vs_bf16_peak']:.1f} % | {100 * r['mfu_vs_own_precision_peak']:.1f} % | "
                         f"{r.get('peak_cuda_gb', float('nan')):.1f} |")
        ratios = [f"{r['precision']} ×{r['speedup_vs_official']:.2f}" for r in training["rows"]
                  if "speedup_vs_official" in r]
        lines += ["", (f"Ours against the official step: {', '.join(ratios)} (target ×1.5): **slower**. The "
                       "official figure leaves out its data pipeline, ours includes 12 views of GPU augmentation per "
                       "image; how much of the gap that is was not measured before the device time ran out."), ""]
    pairing = _load(results / "training-pairing-cpu" / "pairing.json")
    if pairing is not None and pairing.get("breakdown"):
        lines += cpu_pairing(pairing)
    if faiss is not None:
        r = faiss["rows"][0]
        lines += ["### FAISS on that machine", "",
                  (f"CPU FAISS (the GPU build needs CUDA 12 runtime wheels that do not fit the window) on "
                   f"{faiss['n']:,} × {faiss['dim']} clustered vectors, 16 host cores: IVF-Flat nprobe {r['nprobe']} "
                   f"recall@10 {r['recall']:.3f} at {r['qps']:,.0f} queries/s (build {r['build_s']:.0f} s). "
                   f"{faiss['note']}."), ""]
    return lines


def _http(h: dict) -> list[str]:
    """HTTP against the engine: per ``--http-workers`` setting (runs from before the setting: one process)."""
    runs = h.get("by_workers") or {"0": h}
    first = next(iter(runs.values()))
    lines = ["### Serving over HTTP", "",
             (f"`msn-serve --device cuda` (served {first['served']['runtime']} {first['served']['precision']}, "
              f"max batch {h['batch']}, max wait {h['max_wait_ms']:g} ms), single-image JPEG clients over "
              f"{h['client_procs']} processes, beside the same engine offline."), "",
             "| --http-workers | clients | images/s | p50 ms | p99 ms | server CPU ms/image |",
             "|---|---|---|---|---|---|"]
    for workers, run in runs.items():
        fe = run.get("front_end") or {}
        label = f"{workers} ({fe['http_workers']} processes)" if workers == "auto" and fe else workers
        for row in run["clients"]:
            lines.append(f"| {label} | {row['concurrency']} | {row['images_per_s']:.0f} | {row['p50_ms']:.0f} | "
                         f"{row['p99_ms']:.0f} | {row['server_cpu_ms_per_image']:.1f} |")
    decode = h["offline_with_decode"]["images_per_s"]
    lines += ["", (f"Offline: the engine alone {h['offline_pure_images_per_s']:,.0f} images/s; with decode and "
                  f"preprocessing on two threads in-process {decode:.0f}.")]
    for workers, run in runs.items():
        lines.append(f"- `--http-workers {workers}`: HTTP at 64 clients = {run['http64_vs_offline_pure']:.2f} of the "
                     f"engine (target 0.9), {run['http64_vs_offline_with_decode']:.2f} of decode + engine.")
    if "by_workers" not in h:
        lines.append("- (measured before HTTP worker processes existed: the server decoded uploads on two threads "
                     "of one process, so a 16-core GPU host served at two cores' decode rate)")
    return lines + [""]
