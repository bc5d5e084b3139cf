"""What the CPU under us can do, read from the kernel rather than assumed.

The machines this project runs on change between an AVX2-only AMD EPYC, an AMD EPYC with AVX512-BF16/VNNI and an
Intel Xeon with AMX: bf16 matrix multiplies are several times faster than fp32 on the last two and slower than fp32
on the first (docs/benchmarks.md has the measured ratios), and bf16 units do not make every step faster either.
Training's ``run.precision: auto`` reads here whether bf16 is worth timing at all (it then times both on the run's
first steps, ``training/run/precision_timing.py``); the RCDM decoder still takes the flag rule below. It is where
a serving runtime choice should read the CPU too. ``MSN_CPU_FLAGS`` (a
space-separated flag list) replaces the reading, so tests and users can simulate another CPU, e.g.
``MSN_CPU_FLAGS="avx2 fma"`` to force the fp32 path on an AMX machine.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
FLAGS_ENV = "MSN_CPU_FLAGS"
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # native bf16 dot products (AMX tiles, or AVX512 VDPBF16PS)
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")  # native int8 dot products (VNNI: VPDPBUSD)
REPORTED_FLAGS = ("avx2", "fma", "avx512f", *BF16_FLAGS, *INT8_FLAGS, "amx_tile")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    cores: int
    flags: frozenset[str]

    @property
    def bf16_native(self) -> bool:
        """bf16 matrix units: autocast to bf16 pays (fp32 accumulation in hardware)."""
        return any(f in self.flags for f in BF16_FLAGS)

    @property
    def int8_native(self) -> bool:
        """int8 dot-product instructions: quantized graphs run on VNNI/AMX kernels."""
        return any(f in self.flags for f in INT8_FLAGS)

    @property
    def auto_precision(self) -> str:
        """The flag rule (``msn-doctor`` reports it): bf16 only on bf16 units. Training's ``auto`` times both there."""
        return "bf16" if self.bf16_native else "fp32"

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    def describe(self) -> dict:
        """A JSON-ready record for benchmarks, logs and ``/readyz``."""
        return {"cpu_model": self.model, "cores": self.cores,
                "cpu_flags": sorted(f for f in REPORTED_FLAGS if f in self.flags),
                "bf16_native": self.bf16_native, "int8_native": self.int8_native}


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = CPUINFO.read_text()
    except OSError:  # not Linux: no flags, so every decision takes the portable fp32 path
        return platform.processor() or platform.machine(), frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model or platform.machine(), flags


def cpu_info(flags: str | None = None) -> CpuInfo:
    """This machine's CPU; ``flags`` (or ``$MSN_CPU_FLAGS``) replaces the flags read from ``/proc/cpuinfo``."""
    model, read = _read_cpuinfo()
    override = flags if flags is not None else os.environ.get(FLAGS_ENV)
    if override is not None:
        read = frozenset(override.split())
        model = f"{model} (flags simulated)"
    return CpuInfo(model=model, cores=os.cpu_count() or 1, flags=read)
