"""Whether a CUDA GPU is usable here, and if not the one reason that says what is missing and how to fix it.

``--device cuda`` used to start anyway and quietly run on the CPU; a user then learnt from the throughput, not from
the program, that the GPU was never used. Every GPU path (``msn-serve``, ``msn-embed``, the trainer, ``msn-doctor``)
now asks here first and refuses with the reason. The checks are cheap (no GPU memory is allocated, nothing is
timed): the NVIDIA driver library is opened with :mod:`ctypes` and asked for its device count, and ONNX Runtime is
asked which providers it was built with. Each check that reads the machine has a pure twin taking the observation
as arguments, so both outcomes are tested on a CPU-only machine.
"""
from __future__ import annotations

import ctypes
import os
import shutil
from functools import cache

from msn_core.optional import require

__all__ = ["CudaUnavailable", "cuda_device_count", "cuda_driver_problem", "driver_problem", "ort_cuda_problem",
           "ort_problem"]

LIBCUDA = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


class CudaUnavailable(ValueError):
    """A CUDA device was asked for and cannot be used; the message is one line naming what is missing and the fix
    (a ValueError, so the command-line tools report it as a start-up error rather than a traceback)."""


def driver_problem(loaded: str | None, device_count: int, error: str = "") -> str | None:
    """Why no CUDA device is usable given what the driver said: ``loaded`` is the library that opened (None: none
    did), ``device_count`` what ``cuDeviceGetCount`` returned, ``error`` a failed ``cuInit``'s code."""
    smi = "nvidia-smi is on PATH" if shutil.which("nvidia-smi") else "no nvidia-smi"
    if loaded is None:
        return f"no CUDA device is visible (libcuda not loadable: no NVIDIA driver, {smi})"
    if error:
        return f"no CUDA device is visible ({loaded}: cuInit failed with {error}, {smi})"
    if device_count < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return f"no CUDA device is visible (the driver finds 0 GPUs{hidden}, {smi})"
    return None


@cache
def _driver_reading() -> tuple[str | None, int, str]:
    """``(library, devices, cuInit error)`` from the CUDA driver API; cached: the driver does not change under us."""
    for name in LIBCUDA:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        rc = lib.cuInit(0)
        if rc != 0:
            return name, 0, f"CUDA error {rc}"
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
        return name, count.value if rc == 0 else 0, "" if rc == 0 else f"CUDA error {rc}"
    return None, 0, ""


def cuda_driver_problem() -> str | None:
    """None when the NVIDIA driver loads and sees at least one GPU, else why not (one clause)."""
    return driver_problem(*_driver_reading())


def cuda_device_count() -> int:
    """GPUs the driver sees (0 without a driver)."""
    return _driver_reading()[1]


def ort_problem(version: str, providers: list[str]) -> str | None:
    """Why ONNX Runtime ``version`` with ``providers`` cannot run a graph on CUDA (None: it has the provider)."""
    if "CUDAExecutionProvider" in providers:
        return None
    return f"onnxruntime-gpu with its CUDA provider (this onnxruntime {version} is the CPU build)"


def ort_cuda_problem() -> str | None:
    """:func:`ort_problem` for the onnxruntime installed here (its absence says which install brings it)."""
    ort = require("onnxruntime", "--device cuda")
    return ort_problem(ort.__version__, list(ort.get_available_providers()))
