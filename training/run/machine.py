"""The machine a run is planned for, and what one MSN step costs on it: the run planner's view of the hardware.

``Machine`` holds what the planner (``training/run/plan.py``) needs: the device type and how many devices the run
uses (one process each), each device's memory, the CPU cores, bf16 support, and an estimate of the dense
matmul throughput a device sustains. ``detect_machine`` reads them from torch, ``torchrun``'s environment and
``msn_core.hardware`` (the CPU flags); tests build ``Machine`` directly to plan for a CPU-only box, one GPU or eight
without the hardware.

Nothing here is timed: every process of a ``torchrun`` job plans on its own before the processes meet, so the
plan must come out the same on every rank, which a timing would not guarantee. The throughput is a rough figure
from the hardware's kind (CPU vector extensions, GPU multiprocessors and generation); it only chooses the model
size and the EMA's time constant, and a budget run resizes its length from the real step time anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from msn_core.hardware import cpu_info

__all__ = ["Machine", "StepShape", "activation_bytes_per_image", "detect_machine", "encoder_parameters",
           "step_flops_per_image"]

# Sustained dense matmul GFLOP/s per CPU core in the precision `run.precision: auto` picks (bf16 where native).
# Order-of-magnitude figures read from this project's machines (docs: AVX2 EPYC ~60/core fp32, Zen 4 ~100 fp32
# and ~200 bf16, Intel AMX ~800 bf16).
_CPU_GFLOPS_PER_CORE = (("amx_bf16", 800.0), ("avx512_bf16", 200.0), ("avx512f", 100.0), ("avx2", 60.0))
_CPU_GFLOPS_FALLBACK = 20.0
# Dense bf16 tensor-core TFLOP/s per streaming multiprocessor by compute capability (A100: 312 / 108 SMs,
# H100 SXM: 989 / 132); fp32 (TF32) runs at half that.
_GPU_TFLOPS_PER_SM = ((10, 15.0), (9, 7.5), (8, 2.9), (7, 1.0))
# The share of that peak an MSN step sustains (small matrices, elementwise work, augmentation), and the fixed
# cost of one step (kernel launches, optimiser, Python): a 16-token ViT-tiny at batch 64 took 0.036 s per step
# on an H200, far from its FLOP count.
_EFFICIENCY = {"cpu": 0.7, "cuda": 0.3}
_STEP_OVERHEAD_SECONDS = {"cpu": 0.01, "cuda": 0.03}


@dataclass(frozen=True)
class Machine:
    """What a run is planned for. ``device_count`` is the number of processes (one per device) the run uses."""

    device_type: str  # "cpu" or "cuda"
    device_count: int
    device_memory_gib: float  # per device; host memory on CPU
    cpu_cores: int  # on the whole host
    bf16: bool  # `run.precision: auto` trains in bf16
    tflops: float  # sustained dense matmul TFLOP/s per device in that precision, before _EFFICIENCY
    name: str = ""

    def __post_init__(self) -> None:
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type {self.device_type!r}: expected cpu or cuda")
        if self.device_count < 1 or self.cpu_cores < 1 or not self.tflops > 0:
            raise ValueError(f"device_count, cpu_cores and tflops must be positive: {self}")

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def step_seconds(self, flops_per_device: float) -> float:
        """A rough time for one optimiser step doing ``flops_per_device`` on each device."""
        rate = self.tflops * 1e12 * _EFFICIENCY[self.device_type]
        return _STEP_OVERHEAD_SECONDS[self.device_type] + flops_per_device / rate

    def describe(self) -> str:
        count = f"{self.device_count} x " if self.device_count > 1 else ""
        kind = "CPU" if self.device_type == "cpu" else "GPU"
        memory = f", {self.device_memory_gib:.0f} GiB" if self.device_type == "cuda" else ""
        units = self.precision if self.device_type == "cuda" else ("bf16 units" if self.bf16 else "no bf16 units")
        return (f"{count}{self.name or kind}{memory}, {self.cpu_cores} CPU cores, {units}, "
                f"~{self.tflops:.2g} TFLOP/s peak per device")


def detect_machine(device: str = "auto") -> Machine:
    """This machine as ``run.device`` (auto | cpu | cuda) would use it; ``torchrun``'s ``WORLD_SIZE`` is the
    number of devices (one process each; 1 without torchrun)."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cores = os.cpu_count() or 1
    if device != "cpu" and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        per_sm = next((rate for major, rate in _GPU_TFLOPS_PER_SM if props.major >= major), 0.5)
        bf16 = torch.cuda.is_bf16_supported()
        return Machine("cuda", processes, props.total_memory / 2**30, cores, bf16,
                       props.multi_processor_count * per_sm * (1.0 if bf16 else 0.5), props.name)
    cpu = cpu_info()
    per_core = next((rate for flag, rate in _CPU_GFLOPS_PER_CORE if flag in cpu.flags), _CPU_GFLOPS_FALLBACK)
    if not cpu.bf16_native:  # the bf16 figures above only hold where bf16 is native
        per_core = min(per_core, 100.0)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory = 8.0
    return Machine("cpu", processes, memory, cores, cpu.bf16_native, cores * per_core / 1000 / processes,
                   cpu.model)


@dataclass(frozen=True)
class StepShape:
    """One image's share of an MSN step: the encoder, the views, the head and the prototypes."""

    embed_dim: int
    depth: int
    num_heads: int
    patch_size: int
    image_size: int
    mask_ratio: float
    num_focal: int
    focal_size: int
    head_hidden_dim: int
    head_out_dim: int = 256
    num_prototypes: int = 1024
    mlp_ratio: float = 4.0

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def kept_tokens(self) -> int:
        patches = (self.image_size // self.patch_size) ** 2
        return max(1, int(patches * (1 - self.mask_ratio))) + 1

    @property
    def focal_tokens(self) -> int:
        return (self.focal_size // self.patch_size) ** 2 + 1


def _encoder_flops(s: StepShape, tokens: int) -> float:
    d = s.embed_dim
    per_token = 2 * (4 + 2 * s.mlp_ratio) * d * d + 4 * tokens * d  # qkv, proj, MLP; attention scores and mixing
    return s.depth * tokens * per_token + tokens * 2 * 3 * s.patch_size ** 2 * d


def _head_flops(s: StepShape) -> float:
    h = s.head_hidden_dim
    return 2 * (s.embed_dim * h + h * h + h * s.head_out_dim) + 2 * s.head_out_dim * s.num_prototypes


def step_flops_per_image(s: StepShape) -> float:
    """Forward FLOPs of the target view, plus forward and backward (3x) of the masked anchor and focal views."""
    target = _encoder_flops(s, s.tokens) + _head_flops(s)
    anchors = _encoder_flops(s, s.kept_tokens) + s.num_focal * _encoder_flops(s, s.focal_tokens)
    return target + 3 * (anchors + (1 + s.num_focal) * _head_flops(s))


def activation_bytes_per_image(s: StepShape, bf16: bool) -> float:
    """Memory the backward pass keeps per image: Korthikanti et al. (2022)'s 34 d + 5 a n bytes per token and
    block at 16-bit, doubled in fp32. For ViT-S/16 with 10 focal views in bf16 that is 99 MB; an H100 peaked at
    23.6 GB for a batch of 256 (92 MB per image, weights and optimiser included)."""
    def per_view(tokens: int) -> float:
        return s.depth * tokens * (34 * s.embed_dim + 5 * s.num_heads * tokens)

    total = per_view(s.kept_tokens) + s.num_focal * per_view(s.focal_tokens)
    return total * (1 if bf16 else 2)


def encoder_parameters(embed_dim: int, depth: int, mlp_ratio: float = 4.0) -> int:
    """Trunk parameters (blocks only): what the data has to constrain."""
    return int(depth * (4 + 2 * mlp_ratio) * embed_dim * embed_dim)
