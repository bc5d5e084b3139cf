"""Which precision the step runs in: ``run.precision: auto | fp32 | bf16``, decided once from the hardware.

``auto`` picks bf16 autocast where the silicon multiplies bf16 natively (CUDA GPUs that support it; CPUs with AMX
or AVX512-BF16, read by :mod:`msn_core.hardware`) and fp32 elsewhere: on an AVX2-only CPU bf16 matmuls are emulated
and slower than fp32. Only the forward/backward matmuls run in bf16: the master weights, AdamW's state, the EMA
target update and the loss (softmax, Sinkhorn, mean-entropy; :mod:`training.model.losses` upcasts) stay in fp32.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from msn_core.hardware import CpuInfo, cpu_info

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, device: torch.device, cpu: CpuInfo | None = None) -> str:
    """``fp32`` or ``bf16`` for ``requested`` on ``device``; ``cpu`` replaces the reading of this machine's CPU."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cpu":
        return (cpu or cpu_info()).auto_precision
    return "fp32"


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A fresh autocast context per use (``with run.autocast(): ...``); fp32 is a no-op context."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext
