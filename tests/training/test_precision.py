"""run.precision: auto picks bf16 only where the hardware multiplies bf16 natively; bf16 steps track fp32 and learn."""
from __future__ import annotations

import pytest
import torch

from msn_core.hardware import cpu_info
from training import distributed as dist
from training.config import load_config
from training.run.build import build_run
from training.run.precision import resolve_precision
from training.run.schedules import StepHyperparameters
from training.run.step import train_step

CPU = torch.device("cpu")
AVX2_ONLY = cpu_info("sse4_2 avx avx2 fma")
AVX512_BF16 = cpu_info("avx2 avx512f avx512_bf16 avx512_vnni")
AMX = cpu_info("avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8")
TINY = ["data.source=synthetic", "data.synthetic_size=64", "data.load_size=16", "data.batch_size=16",
        "data.num_workers=0", "model.image_size=16", "model.patch_size=4", "model.embed_dim=64", "model.depth=2",
        "model.num_heads=2", "model.head_hidden_dim=128", "model.head_out_dim=32", "model.num_prototypes=64",
        "mask.num_focal=0", "mask.ratio=0.3", "optim.fused=false"]


def test_auto_follows_the_cpu():
    assert resolve_precision("auto", CPU, AVX2_ONLY) == "fp32"  # bf16 would be emulated, slower than fp32
    assert resolve_precision("auto", CPU, AVX512_BF16) == "bf16"
    assert resolve_precision("auto", CPU, AMX) == "bf16"
    assert resolve_precision("fp32", CPU, AMX) == "fp32" and resolve_precision("bf16", CPU, AVX2_ONLY) == "bf16"
    with pytest.raises(ValueError, match="expected one of"):
        resolve_precision("fp16", CPU, AMX)


def test_auto_reads_the_simulated_cpu_in_a_real_build(monkeypatch):
    cfg = load_config(None, TINY)
    info = dist.init_distributed("cpu")
    monkeypatch.setenv("MSN_CPU_FLAGS", "avx2 fma")
    assert build_run(cfg, info).precision == "fp32"
    monkeypatch.setenv("MSN_CPU_FLAGS", "avx2 avx512_bf16")
    assert build_run(cfg, info).precision == "bf16"


def _steps(precision: str, n: int) -> list[float]:
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, f"run.precision={precision}"])
    run = build_run(cfg, dist.init_distributed("cpu"))
    hyper = StepHyperparameters(lr=1e-3, weight_decay=0.04, ema_momentum=0.99, sharpen_temperature=0.25)
    images = next(iter(run.loader))[0]
    losses = []
    for _ in range(n):
        out = train_step(run, hyper, images)
        losses.append(out.loss.item())
        # the master weights, AdamW's state and the EMA target stay fp32 under autocast
        assert all(p.dtype == torch.float32 for p in run.online.parameters())
        assert all(p.dtype == torch.float32 for p in run.target.parameters())
        assert out.loss.dtype == torch.float32
    return losses


def test_bf16_steps_track_fp32_and_the_loss_falls():
    fp32, bf16 = _steps("fp32", 12), _steps("bf16", 12)
    # the first step sees identical weights: only bf16 rounding of the matmuls differs
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-3)
    # later steps drift apart step by step (different roundings take different paths: up to 4 % on an AMX Xeon,
    # where the step-to-step loss itself moves 5-10 %), but each stays near and the run's mean loss tracks fp32's
    for a, b in zip(fp32, bf16, strict=True):
        assert b == pytest.approx(a, rel=8e-2)
    assert sum(bf16) / len(bf16) == pytest.approx(sum(fp32) / len(fp32), rel=1e-2)
    assert sum(bf16[-4:]) / 4 < sum(bf16[:4]) / 4 - 0.1  # and bf16 learns: the loss on the repeated batch falls
