"""``--device cuda`` refuses to start when the GPU path cannot work; ``--device auto`` picks and says why.

The GPU side is simulated where the machine has none by changing what the libraries themselves report
(onnxruntime's provider list, faiss' GPU classes, the driver library ctypes opens), never the project's own checks.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from pathlib import Path

import faiss
import httpx
import onnxruntime
import pytest
from serve_helpers import Server

from msn_core import gpu
from msn_serve.device import DeviceUnavailable, faiss_problem, refusal, resolve_device

GPU_HERE = gpu.cuda_driver_problem() is None and gpu.ort_cuda_problem() is None


class _FakeLibcuda:  # the driver API's method names
    """What ``ctypes.CDLL("libcuda.so.1")`` returns on a machine with ``n`` GPUs."""

    def __init__(self, n: int):
        self.n = n

    def cuInit(self, flags: int) -> int:
        return 0

    def cuDeviceGetCount(self, ref) -> int:
        ref._obj.value = self.n
        return 0


@pytest.fixture
def simulated_gpu(monkeypatch: pytest.MonkeyPatch):
    """A machine with onnxruntime-gpu, faiss-gpu-cuvs and one GPU, as the libraries would report it."""
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(faiss, "StandardGpuResources", object, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeLibcuda(1))
    gpu._driver_reading.cache_clear()
    yield
    gpu._driver_reading.cache_clear()


def test_refusal_names_each_missing_piece_and_the_install_that_fixes_it():
    assert refusal([], None) is None
    ort = gpu.ort_problem("1.32.0", ["CPUExecutionProvider"])
    assert ort == "onnxruntime-gpu with its CUDA provider (this onnxruntime 1.32.0 is the CPU build)"
    assert gpu.ort_problem("1.31.1", ["CUDAExecutionProvider", "CPUExecutionProvider"]) is None
    line = refusal([ort, faiss_problem("1.15.1", False)], None)
    assert line == ("--device cuda needs onnxruntime-gpu with its CUDA provider (this onnxruntime 1.32.0 is the "
                    "CPU build) and faiss-gpu-cuvs (this faiss 1.15.1 is the CPU build): pip install 'msn[gpu]' "
                    "(instead of 'msn[serve]')")
    driver = gpu.driver_problem(None, 0)
    assert driver.startswith("no CUDA device is visible (libcuda not loadable")
    assert refusal([], driver) == f"--device cuda {driver}" and "pip install" not in refusal([], driver)
    assert "finds 0 GPUs" in gpu.driver_problem("libcuda.so.1", 0) and gpu.driver_problem("libcuda.so.1", 2) is None
    assert "cuInit failed with CUDA error 100" in gpu.driver_problem("libcuda.so.1", 0, "CUDA error 100")


@pytest.mark.skipif(GPU_HERE, reason="a usable GPU is here: nothing to refuse")
def test_this_cpu_machine_refuses_cuda_and_auto_takes_the_cpu_with_the_reason():
    with pytest.raises(DeviceUnavailable) as e:
        resolve_device("cuda")
    line = str(e.value)
    assert "\n" not in line and line.startswith("--device cuda ")
    if gpu.ort_cuda_problem():  # the CPU build of onnxruntime is what this machine has
        assert f"this onnxruntime {onnxruntime.__version__} is the CPU build" in line
        assert "pip install 'msn[gpu]'" in line
    auto = resolve_device("auto")
    assert (auto.requested, auto.device) == ("auto", "cpu") and auto.reason == line.replace("--device cuda", "cuda")
    assert resolve_device("cpu").device == "cpu"


def test_everything_present_serves_cuda_and_cpu_only_flags_keep_auto_on_the_cpu(simulated_gpu):
    assert gpu.cuda_driver_problem() is None and gpu.cuda_device_count() == 1
    assert resolve_device("cuda").device == "cuda"
    auto = resolve_device("auto")
    assert auto.device == "cuda" and "all here" in auto.reason
    for flags in ({"precision": "int8"}, {"precision": "bf16"}, {"runtime": "openvino"}):
        choice = resolve_device("auto", **flags)
        assert choice.device == "cpu" and "runs on the CPU only" in choice.reason


def test_only_the_driver_missing_is_named_alone(simulated_gpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeLibcuda(0))
    gpu._driver_reading.cache_clear()
    with pytest.raises(DeviceUnavailable, match=r"^--device cuda no CUDA device is visible \(the driver finds 0"):
        resolve_device("cuda")


@pytest.mark.skipif(GPU_HERE, reason="a usable GPU is here: nothing to refuse")
def test_msn_serve_device_cuda_exits_with_one_line_before_loading_anything(bundle_dir: Path, tmp_path: Path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "msn_serve", "--bundle", str(bundle_dir), "--data-dir",
                        str(tmp_path / "d"), "--device", "cuda", "--port", "0"],
                       check=False, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("msn-serve: ")]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("msn-serve: --device cuda "), r.stderr
    assert "Uvicorn running" not in r.stderr and not (tmp_path / "d").exists()  # nothing loaded, nothing bound
    assert elapsed < 30


@pytest.mark.skipif(GPU_HERE, reason="a usable GPU is here: auto would take it")
def test_auto_server_reports_the_device_and_why_in_readyz(bundle_dir: Path, tmp_path: Path):
    srv = Server(bundle_dir, tmp_path / "data", "--device", "auto").start()
    try:
        ready = httpx.get(f"{srv.url}/readyz", timeout=10).json()
        info = httpx.get(f"{srv.url}/info", timeout=10).json()
    finally:
        srv.stop()
    assert ready["device"] == "cpu" and ready["device_requested"] == "auto"
    assert ready["device_reason"].startswith("cuda ") and "no CUDA device is visible" in ready["device_reason"]
    assert info["device"] == "cpu"
    assert "--device auto: cpu (cuda " in srv.log()
