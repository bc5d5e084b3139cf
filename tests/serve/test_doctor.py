"""``msn-doctor`` runs in the serving install, prints every section, and its JSON says why CUDA is unusable here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from msn_core.gpu import cuda_driver_problem
from msn_core.hardware import cpu_info

SECTIONS = ("python", "os", "cpu", "gpu", "torch", "onnxruntime", "openvino", "faiss", "packages", "cuda", "auto")


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msn_serve.doctor", *args], capture_output=True, text=True,
                          timeout=180, check=False)


def test_text_report_has_every_section():
    r = _doctor()
    assert r.returncode == 0, r.stderr
    for section in SECTIONS:
        assert f"[{section}]\n" in r.stdout
    assert f"cpu_model: {cpu_info().model}" in r.stdout


def test_json_report_parses_and_matches_this_machine():
    r = _doctor("--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(SECTIONS) <= set(report)
    cpu = cpu_info()
    assert report["cpu"]["bf16_native"] == cpu.bf16_native
    assert report["auto"]["train_cpu_precision"] == ("bf16" if cpu.bf16_native else "fp32")
    assert report["gpu"]["problem"] == cuda_driver_problem()
    if report["torch"]["installed"]:
        assert report["torch"]["version"].split("+")[0][0].isdigit()
    if cuda_driver_problem() is not None:  # this CPU machine: auto stays on the CPU and says why
        assert report["auto"]["serve_device"] == "cpu"
        assert report["cuda"]["serve_refusal"].startswith("--device cuda ")
        assert "no CUDA device is visible" in report["auto"]["serve_device_reason"]


def test_simulated_avx2_cpu_trains_fp32_and_offers_no_bf16_candidate():
    r = subprocess.run([sys.executable, "-m", "msn_serve.doctor", "--json"], capture_output=True, text=True,
                       timeout=180, check=False, env={**os.environ, "MSN_CPU_FLAGS": "avx2 fma"})
    report = json.loads(r.stdout)
    assert report["auto"]["train_cpu_precision"] == "fp32"
    assert "openvino/bf16" not in report["auto"]["serve_cpu_candidates"]
    assert report["cpu"]["cpu_flags"] == ["avx2", "fma"]
