"""The serving installs resolve as documented: `.[serve]` (CPU) and `.[gpu]` (GPU builds instead of the CPU ones).

onnxruntime / onnxruntime-gpu and faiss-cpu / faiss-gpu provide the same modules and overwrite each other, so the GPU
install must select the GPU builds and neither CPU build, and no serving install may pull torch. A pip resolution
dry run (no download of the wheels, no install) checks it against the real package index; without network access
the test is skipped with pip's reason.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                         r"Failed to establish a new connection|No matching distribution found for (onnx|faiss|fastapi)")


def resolve(target: str, tmp_path: Path) -> set[str]:
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--no-build-isolation", "--disable-pip-version-check", "--report", str(report), target],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 0 and UNREACHABLE.search(r.stderr + r.stdout):
        pytest.skip(f"package index unreachable: {UNREACHABLE.search(r.stderr + r.stdout).group(0)}")
    assert r.returncode == 0, r.stderr[-3000:]
    return {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_gpu_install_selects_the_gpu_builds_and_no_torch(tmp_path):
    names = resolve(".[gpu]", tmp_path)
    assert {"onnxruntime-gpu", "faiss-gpu", "fastapi", "cyanure", "orjson"} <= names
    assert not names & {"onnxruntime", "faiss-cpu"}, "a CPU build would overwrite the GPU module"
    assert not {n for n in names if n.startswith("torch")}


@pytest.mark.slow
def test_serve_install_is_cpu_only_and_has_no_torch(tmp_path):
    names = resolve(".[serve]", tmp_path)
    assert {"onnxruntime", "openvino", "faiss-cpu", "fastapi", "cyanure", "orjson"} <= names
    assert not names & {"onnxruntime-gpu", "faiss-gpu"}
    assert not {n for n in names if n.startswith(("torch", "nvidia-"))}
