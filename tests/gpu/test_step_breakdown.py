"""The step breakdown behind the GPU run's training stage (benchmarks/training/step_breakdown.py): its device
override, its three phases and profile on the CPU, and (on a GPU) that its sync counter really counts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gpu.training import QUICK_CPU
from benchmarks.training.step_breakdown import PHASES, count_syncs, for_device, measure, trace_summary
from benchmarks.training.train_throughput import PRESETS


def test_the_device_override_wins_over_the_preset() -> None:
    items = for_device(PRESETS["gpu-s16"], "cpu", batch=8)
    assert "run.device=cuda" not in items and items.count("run.device=cpu") == 1
    # later overrides win: the CPU's worker count and the batch come after the preset's
    assert items[-1] == "data.batch_size=8" and items.index("data.batch_size=64") < items.index("data.batch_size=8")
    workers = [i for i in items if i.startswith("data.num_workers=")]
    assert workers[0] == "data.num_workers=8" and int(workers[-1].split("=")[1]) < 8
    assert for_device(["run.device=cuda"], "cuda") == ["run.device=cuda"]



def test_a_trace_summary_counts_device_time_kernels_and_syncs_per_call() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "softmax", "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 200},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000},  # host time: not the GPU's
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "marker"},  # not a duration event
    ]}
    summary = trace_summary(trace, steps=2)
    assert summary["gpu_busy_s_per_call"] == pytest.approx(300e-6)
    assert summary["kernels_per_call"] == 1 and summary["runtime_syncs_per_call"] == {"cudaStreamSynchronize": 0.5}

def test_three_phases_and_a_profile_table_on_the_cpu(tmp_path: Path) -> None:
    result = measure(None, [*QUICK_CPU, "mask.ratio=0.15", "run.precision=fp32"], steps=1, warmup=0,
                     out=tmp_path, tag="fp32", profile_steps=1)
    assert set(result["phases"]) == set(PHASES) and result["batch"] == 2
    for phase in result["phases"].values():
        assert phase["s_per_step"] > 0 and phase["ms_per_image"] == pytest.approx(1e3 * phase["s_per_step"] / 2)
    assert 0 < result["augment_share_of_step"] < 1 and result["gflop_per_image"] > 0
    assert "syncs_per_step" not in result  # CUDA only
    table = Path(result["profile"]["files"]["table"]).read_text()
    assert "aten::" in table and "trace" not in result["profile"]["files"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sync_counter_sees_an_item_call() -> None:
    x = torch.ones(4, device="cuda")
    counted = count_syncs(lambda: x.sum().item(), steps=3)
    assert counted["per_call"] == 1 and len(counted["sites"]) == 1
    assert count_syncs(lambda: x.mul_(1.0), steps=2)["per_call"] == 0
