"""Where one training step's time goes, on any device: (a) the whole step, augmentation included, as the trainer
runs it; (b) the same step on views made beforehand (the official step is timed that way: its views come ready from
CPU workers); (c) the augmentation and mask alone. Each per step and per image, so "augmentation on the critical
path" is a measured number. On CUDA also the host-device syncs per step (``torch.cuda.set_sync_debug_mode``, by
call site) and a ``torch.profiler`` chrome trace; on every device the profiler's ``key_averages`` table.

Why: on an H100 our step ran at x0.55 of the official one (bf16, ViT-S/16, batch 64), on a CPU at x1.29, and the
trainer's images/s mixes data loading, augmentation, the step and logging. The step is built in this process
(``training.run.build``) and runs the trainer's own functions (``training.run.step``); data loading is excluded,
as the official step timer excludes it.

    python -m benchmarks.training.step_breakdown --device cpu --batch 8 --steps 3 --out /tmp/breakdown
    python -m benchmarks.training.step_breakdown --device cuda --out /tmp/breakdown            # batch 64
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import REPO, save_json
from benchmarks.training.train_throughput import COMMON, PRESETS, split_preset

PHASES = ("step", "step_on_views", "augment")


def for_device(overrides: list[str], device: str, batch: int | None = None) -> list[str]:
    """``overrides`` with ``run.device`` set to ``device`` (a preset names cuda), a batch, and CPU-sized workers."""
    out = [o for o in overrides if not o.startswith("run.device=")] + [f"run.device={device}"]
    if device == "cpu":  # 8 decoding workers would fight the step for a small CPU's cores
        out.append(f"data.num_workers={min(8, max(0, (os.cpu_count() or 1) - 1))}")
    return out + ([f"data.batch_size={batch}"] if batch else [])


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls after ``warmup``, the device drained before and after each one."""
    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        durations.append(time.perf_counter() - t0)
    return durations


def count_syncs(fn: Callable[[], object], steps: int) -> dict:
    """Host-device synchronisations per call (CUDA only), with the Python lines that caused them.

    ``set_sync_debug_mode("warn")`` warns on every synchronising call, blocking host-to-device copies from pageable
    memory included; each warning is attributed to the Python line that made the call.
    """
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = Counter(f"{_short(w.filename)}:{w.lineno}" for w in syncs)
    return {"per_call": len(syncs) / steps, "sites": {k: v / steps for k, v in sites.most_common(12)}}


def _short(filename: str) -> str:
    path = Path(filename)
    for root in (REPO, *[Path(p) for p in sys.path if "site-packages" in p]):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name


def profile_calls(fn: Callable[[], object], device, steps: int, out: Path, tag: str) -> dict:
    """``steps`` calls under ``torch.profiler``: the key_averages table (``out/TAG-profile.txt``), on CUDA also a
    gzipped chrome trace (``out/TAG-trace.json.gz``, opens in Perfetto) and the GPU's busy time per call."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    out.mkdir(parents=True, exist_ok=True)
    files = {"table": out / f"{tag}-profile.txt"}
    files["table"].write_text(events.table(sort_by=sort, row_limit=50))
    result: dict = {"steps": steps}
    if cuda:
        raw = out / f"{tag}-trace.json"
        prof.export_chrome_trace(str(raw))
        result.update(trace_summary(json.loads(raw.read_text()), steps))
        files["trace"] = raw.with_suffix(".json.gz")
        with raw.open("rb") as src, gzip.open(files["trace"], "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    result["files"] = {k: str(v) for k, v in files.items()}
    return result


def trace_summary(trace: dict, steps: int) -> dict:
    """Per call, from a chrome trace: GPU busy seconds (kernels, copies, fills; far below the step time means the
    host, not the GPU, sets the pace), kernels launched, and explicit synchronisations by CUDA runtime call."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    syncs = Counter(e["name"] for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"])
    return {"gpu_busy_s_per_call": sum(e.get("dur", 0) for e in device) / 1e6 / steps,
            "kernels_per_call": sum(e.get("cat") == "kernel" for e in device) / steps,
            "runtime_syncs_per_call": {k: v / steps for k, v in syncs.items()}}


def measure(config: str | None, overrides: list[str], *, steps: int, warmup: int, out: Path | None = None,
            tag: str = "step", profile_steps: int = 2, sync_steps: int = 2) -> dict:
    """The three phases (module docstring) of the run ``config`` + ``overrides`` builds, in this process, and the
    FLOPs of one step (``torch.utils.flop_counter``, as ``train_throughput.step_flops``: one build serves both)."""
    from torch.utils.flop_counter import FlopCounterMode

    from training import distributed as dist
    from training.config import load_config
    from training.run.build import build_run
    from training.run.step import make_views, start_hyperparameters, train_step, update

    cfg = load_config(REPO / config if config else None, COMMON + overrides)
    run = build_run(cfg, dist.init_distributed(cfg.run.device))
    hyper = start_hyperparameters(cfg)  # the values do not change the cost
    images = next(iter(run.loader))[0]  # uint8 on the host (pinned on CUDA), moved by the step as in training
    batch = images.shape[0]
    views = make_views(run, images)  # (b) reuses these tensors: made once, before any timing
    calls: dict[str, Callable[[], object]] = {
        "step": lambda: train_step(run, hyper, images),
        "step_on_views": lambda: update(run, hyper, views),
        "augment": lambda: make_views(run, images),
    }
    result: dict = {"device": str(run.device), "precision": run.precision, "batch": batch, "steps_timed": steps,
                    "phases": {}}
    calls["step"]()  # lazy initialisation must not be counted
    with FlopCounterMode(display=False) as counter:
        calls["step"]()
    result["gflop_per_image"] = counter.get_total_flops() / batch / 1e9
    for name in PHASES:
        durations = time_calls(calls[name], run.device, steps, warmup)
        median = statistics.median(durations)
        result["phases"][name] = {"s_per_step": median, "ms_per_image": 1e3 * median / batch,
                                  "images_per_sec": batch / median, "s_all": durations}
    phase = {k: v["s_per_step"] for k, v in result["phases"].items()}
    result["augment_share_of_step"] = phase["augment"] / phase["step"]
    result["step_minus_parts_s"] = phase["step"] - phase["step_on_views"] - phase["augment"]
    if run.device.type == "cuda" and sync_steps:
        result["syncs_per_step"] = {name: count_syncs(calls[name], sync_steps) for name in PHASES}
    if out is not None and profile_steps:
        result["profile"] = profile_calls(calls["step"], run.device, profile_steps, out, tag)  # (a) holds (b), (c)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder: breakdown.json, profiler tables and traces")
    ap.add_argument("--preset", default="gpu-s16", choices=sorted(PRESETS))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--batch", type=int, help="per-process batch (default: the preset's)")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=10, help="timed calls per phase")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    config, overrides = split_preset(PRESETS[a.preset])
    overrides = for_device(overrides, a.device, a.batch) + ["mask.ratio=0.15", *a.extra]
    report: dict = {"preset": a.preset, "overrides": overrides, "rows": []}
    for i, precision in enumerate(a.precisions):
        row = measure(config, [*overrides, f"run.precision={precision}"], steps=a.steps, warmup=a.warmup,
                      out=a.out, tag=precision, profile_steps=2 if i == 0 else 0)  # one profile: the first
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        report["rows"].append(row)
        save_json(a.out / "breakdown.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
