"""``run.device=cuda`` without a usable GPU stops with one line naming torch's CUDA build or the driver."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from training.distributed import pinned_torch, torch_problem

REPO = Path(__file__).resolve().parents[2]


def test_torch_problem_names_the_cpu_build_or_the_missing_device():
    cpu_build = torch_problem("2.13.0+cpu", None, 0, None)
    assert "this torch 2.13.0+cpu is the CPU build" in cpu_build and f"pip install {pinned_torch()} " in cpu_build
    no_gpu = torch_problem("2.11.0", "13.0", 0, "no CUDA device is visible (libcuda not loadable)")
    assert no_gpu.startswith("a GPU torch 2.11.0 (CUDA 13.0) can use: no CUDA device is visible")
    assert torch_problem("2.11.0", "13.0", 1, None) is None


def test_the_advice_names_the_pin_pyproject_holds():
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    assert pinned_torch() in train and pinned_torch().startswith("torch==")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nothing to refuse")
def test_pretrain_with_run_device_cuda_exits_with_one_line(tmp_path: Path):
    r = subprocess.run([sys.executable, "training/pretrain.py", "--config", "configs/fmnist_vit_tiny.yaml",
                        "--set", "run.device=cuda", "--output-dir", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pretrain: ")]
    assert len(lines) == 1 and lines[0].startswith("pretrain: run.device=cuda needs "), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
