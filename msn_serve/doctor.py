"""``msn-doctor``: what this machine offers the project, for the user deciding flags and for a bug report.

Which CPU features, GPUs, runtimes and builds are here decides what ``--device auto``, ``--precision auto`` and
``run.precision: auto`` pick, and a wrong guess about them (the CPU build of onnxruntime, a torch without CUDA) is the
usual reason a GPU sits idle. This prints them in one place, with the reason CUDA is or is not usable. Nothing is
timed and no GPU memory is allocated. It lives in ``msn_serve`` because it must run in the slim serving install:
torch is probed in a subprocess (``python -c``), so this package still never imports it.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from msn_core.gpu import cuda_device_count, cuda_driver_problem
from msn_core.hardware import REPORTED_FLAGS, cpu_info
from msn_core.inference import openvino_capabilities, openvino_status
from msn_core.optional import available, optional
from msn_serve.device import cuda_refusal, resolve_device

TORCH_PROBE = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'version': torch.__version__, "
               "'cuda_build': torch.version.cuda, 'cuda_available': c, 'devices': [torch.cuda.get_device_name(i) "
               "for i in range(torch.cuda.device_count())] if c else [], "
               "'cpu_capability': torch.backends.cpu.get_cpu_capability()}))")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> dict[str, Any]:
    """GPUs and driver from nvidia-smi when it is there, and the CUDA driver's own answer."""
    out: dict[str, Any] = {"nvidia_smi": None, "devices": [], "driver_devices": cuda_device_count(),
                           "problem": cuda_driver_problem()}
    smi = shutil.which("nvidia-smi")
    if smi:
        out["nvidia_smi"] = smi
        try:
            r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=False)
            out["devices"] = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired) as e:
            out["devices"] = [f"nvidia-smi failed: {e}"]
    return out


def torch_probe() -> dict[str, Any]:
    """torch's version, CUDA build and devices, read by a child interpreter (this package never imports torch)."""
    if not available("torch"):
        return {"installed": False}
    try:
        r = subprocess.run([sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=120,
                           check=False)
    except subprocess.TimeoutExpired:
        return {"installed": True, "error": "import torch took over 120 s"}
    if r.returncode != 0:
        return {"installed": True, "error": (r.stderr.strip().splitlines() or ["import failed"])[-1]}
    return {"installed": True, **json.loads(r.stdout.strip().splitlines()[-1])}


def onnxruntime_info() -> dict[str, Any]:
    ort = optional("onnxruntime")
    if ort is None:
        return {"installed": False}
    return {"installed": True, "version": ort.__version__, "providers": list(ort.get_available_providers()),
            "distribution": next((d for d in ("onnxruntime-gpu", "onnxruntime") if _version(d)), None)}


def openvino_info() -> dict[str, Any]:
    ok, why = openvino_status()
    out: dict[str, Any] = {"usable": ok, "status": why}
    if ok:
        import openvino as ov

        out["devices"] = list(ov.Core().available_devices)
        out["cpu_capabilities"] = sorted(openvino_capabilities())
    return out


def faiss_info() -> dict[str, Any]:
    faiss = optional("faiss")
    if faiss is None:
        return {"installed": False}
    gpu_build = hasattr(faiss, "StandardGpuResources")
    try:
        count = int(faiss.get_num_gpus()) if gpu_build else 0
    except RuntimeError:
        count = 0
    return {"installed": True, "version": faiss.__version__, "gpu_support": gpu_build, "gpus": count,
            "distribution": next((d for d in ("faiss-gpu-cuvs", "faiss-gpu", "faiss-cpu") if _version(d)), None)}


def auto_choices(cpu_bf16: bool, ov_ok: bool, ov_bf16: bool, precision: str) -> dict[str, Any]:
    """What the ``auto`` settings decide here without timing: the device, training's precision, and the serving
    candidates ``--precision auto`` would measure (int8 also where the bundle carries a guarded int8 graph)."""
    device = resolve_device("auto")
    candidates = ["onnxruntime/fp32"] + (["openvino/fp32"] if ov_ok else []) + (
        ["openvino/bf16"] if ov_ok and ov_bf16 and cpu_bf16 else [])
    return {"serve_device": device.device, "serve_device_reason": device.reason,
            "serve_cpu_candidates": candidates, "train_cpu_precision": precision}


def report() -> dict[str, Any]:
    """Everything ``msn-doctor`` prints, JSON-ready."""
    cpu = cpu_info()
    ov = openvino_info()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "os": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
               "platform": platform.platform()},
        "cpu": {**cpu.describe(), "flags_checked": list(REPORTED_FLAGS)},
        "gpu": gpus(),
        "torch": torch_probe(),
        "onnxruntime": onnxruntime_info(),
        "openvino": ov,
        "faiss": faiss_info(),
        "packages": {name: _version(name) for name in ("msn", "pyarrow", "transformers", "fastapi", "cyanure")},
        "cuda": {"serve_refusal": cuda_refusal()},
        "auto": auto_choices(cpu.bf16_native, ov["usable"], "BF16" in ov.get("cpu_capabilities", []),
                             cpu.auto_precision),
    }


def _text(r: dict[str, Any]) -> str:
    def line(key: str, value: Any) -> str:
        if isinstance(value, (list, tuple)):
            value = ", ".join(map(str, value)) or "none"
        return f"  {key}: {'none' if value is None else value}"

    lines = []
    for section, body in r.items():
        lines.append(f"[{section}]")
        lines.extend(line(k, v) for k, v in body.items())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="msn-doctor", description="Print the CPU features, GPUs, runtimes and builds "
                                "this machine offers MSN, what the auto settings pick here, and why CUDA is or is "
                                "not usable (paste it into bug reports).")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    r = report()
    print(json.dumps(r, indent=2) if args.json else _text(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
