"""Which precision the step runs in: ``run.precision: auto | fp32 | bf16``, decided once per run.

bf16 can only pay where the silicon multiplies bf16 natively (CUDA GPUs that support it; CPUs with AMX or
AVX512-BF16, read by :mod:`msn_core.hardware`): on an AVX2-only CPU bf16 matmuls are emulated and slower than fp32,
so ``auto`` is fp32 there without further ado. Native units do not make every step faster, though (a 2-core Xeon
with AVX512-BF16 but no AMX trained the demo ~35 % slower in bf16), so on such a CPU ``auto`` has two candidates and
``training/run/precision_timing.py`` times both on the run's first steps. ``resolve_precision`` is the flag rule:
what ``auto`` is on a GPU, and on a CPU whenever the run is not timed. Only the forward/backward matmuls run in
bf16: the master weights, AdamW's state, the EMA target update and the loss (softmax, Sinkhorn, mean-entropy;
:mod:`training.model.losses` upcasts) stay in fp32.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from msn_core.hardware import CpuInfo, cpu_info

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, device: torch.device, cpu: CpuInfo | None = None) -> str:
    """``fp32`` or ``bf16`` for ``requested`` on ``device`` by the flag rule; ``cpu`` replaces this machine's CPU."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cpu":
        return (cpu or cpu_info()).auto_precision
    return "fp32"


def precision_candidates(requested: str, device: torch.device, cpu: CpuInfo | None = None) -> tuple[str, ...]:
    """The precisions worth timing for ``requested``: fp32 and bf16 for ``auto`` on a CPU with bf16 units, else the
    one the flag rule gives (an explicit choice; a GPU, where bf16 wins wherever it is supported; emulated bf16)."""
    if requested == "auto" and device.type == "cpu" and (cpu or cpu_info()).bf16_native:
        return ("fp32", "bf16")
    return (resolve_precision(requested, device, cpu),)


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A fresh autocast context per use (``with run.autocast(): ...``); fp32 is a no-op context."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext
