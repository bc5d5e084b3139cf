"""What every benchmark script shares: where files live, the machine a figure was measured on, how results are
saved, and the cached Fashion-MNIST features several scripts embed.

A figure without its machine cannot be compared with anything, so :func:`save_json` attaches :func:`machine` to every
result it writes. Imports of torch, onnxruntime, faiss and ``training`` happen inside the functions that need them:
the renderer imports this module too and must run without them.
"""
from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msn_core.durable import atomic_write_json

if TYPE_CHECKING:
    import numpy as np

    from training.evaluation.features import Features

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs"
FEATURE_CACHE = Path.home() / ".cache" / "msn-eval"  # msn-eval's default, so both reuse one cache


# ----------------------------------------------------------------------------------------------------- machine


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _gpu(use_torch: bool = True) -> str | None:
    """The first CUDA device's name: torch's view when torch is here (and ``use_torch``), else nvidia-smi's (the
    serving image)."""
    torch = None
    if use_torch:
        try:
            import torch
        except ImportError:
            pass
    if torch is not None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, check=False)
        return r.stdout.strip().splitlines()[0] if r.stdout.strip() else None
    return None


def machine(torch_info: bool = True) -> dict[str, Any]:
    """The machine a figure is measured on: CPU model, cores, the SIMD/matrix flags that decide bf16 and int8 speed,
    torch's kernel level, the GPU and the library versions. Keys ``cpu``, ``cpu_count``, ``cores_visible``, ``gpu``
    and ``torch`` are the ones older results files use too. ``torch_info=False``, for a script that never uses
    torch (importing it costs seconds of CPU): torch's installed version only, the GPU from nvidia-smi."""
    from msn_core.hardware import cpu_info

    cpu = cpu_info().describe()
    info: dict[str, Any] = {"cpu": cpu["cpu_model"], "cpu_count": cpu["cores"],
                            "cores_visible": len(os.sched_getaffinity(0)), "cpu_flags": cpu["cpu_flags"],
                            "python": platform.python_version(), "platform": platform.platform()}
    if torch_info:
        try:
            import torch

            info["torch"] = torch.__version__
            info["torch_threads"] = torch.get_num_threads()
            info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        except ImportError:
            pass
    else:
        import importlib.metadata

        try:
            info["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            pass
    info["gpu"] = _gpu(torch_info)
    for name in ("onnxruntime", "faiss"):
        if (version := _version(name)) is not None:
            info[name] = version
    return info


def describe_machine(m: dict | str) -> str:
    """One line for a table caption: older results files stored this line itself, newer ones the dict."""
    if isinstance(m, str):
        return m
    text = f"{m.get('cpu', 'unknown CPU')}, {m.get('cpu_count') or m.get('cores_visible')} cores"
    if m.get("cpu_flags"):
        text += " (" + " ".join(m["cpu_flags"]) + ")"
    return text + (f", GPU {m['gpu']}" if m.get("gpu") else "")


# ----------------------------------------------------------------------------------------------------- results


def save_json(path: Path, result: dict) -> dict:
    """Write a result atomically (a crash leaves the old file or the new one), with the machine attached when the
    script has not recorded it already, and say where."""
    if "machine" not in result:  # not setdefault: machine() imports torch, seconds of CPU for a torch-free script
        result["machine"] = machine()
    atomic_write_json(path, result)
    print(f"wrote {path}")
    return result


def update_json(path: Path, change: Callable[[dict], None]) -> dict:
    """Read-modify-write of a results file under ``<path>.lock``: two runs pinned to different cores may finish at
    the same time, and each must keep the other's rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        change(data)
        atomic_write_json(path, data)
    return data


# ----------------------------------------------------------------------------------------------------- features


def cached_features(bundle: Path, split: str, *, backend: str = "onnx", cache_dir: Path = FEATURE_CACHE,
                    indices: np.ndarray | None = None, threads: int = 0, data: str = "fashion-mnist") -> Features:
    """Features of ``data``'s ``split`` embedded by ``bundle`` (or raw pixels), cached like ``msn-eval`` (key: the
    bundle's hash, the split, the indices, the transform), so benchmarks and evaluations share one embedding."""
    from msn_core.bundle import load_bundle_info
    from training.data import build_dataset
    from training.evaluation.features import bundle_fingerprint, extract_features, load_embedder

    pre = load_bundle_info(bundle).preprocessing
    dataset = build_dataset(data, split=split, load_size=int(pre.resize))
    tag = "pixels" if backend == "pixels" else bundle_fingerprint(bundle)
    return extract_features(dataset, load_embedder(bundle, backend, threads=threads), preprocessing=pre,
                            indices=indices, batch_size=256, cache_dir=cache_dir, cache_tag=tag, progress=False,
                            desc=split)


def train_test_features(bundle: Path, backend: str = "onnx", cache_dir: Path = FEATURE_CACHE,
                        threads: int = 1) -> dict[str, np.ndarray]:
    """``x_train``, ``y_train``, ``x_test``, ``y_test`` of Fashion-MNIST as float32 features and labels."""
    import numpy as np

    out = {}
    for split in ("train", "test"):
        f = cached_features(bundle, split, backend=backend, cache_dir=cache_dir, threads=threads)
        out[f"x_{split}"], out[f"y_{split}"] = f.features.astype(np.float32), np.asarray(f.labels)
    return out
