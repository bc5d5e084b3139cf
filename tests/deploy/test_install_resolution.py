"""The installs resolve as documented: `.[serve]` (CPU), `.[gpu]` (GPU builds instead of the CPU ones) and
`.[client]` (the Python client alone).

onnxruntime / onnxruntime-gpu and faiss-cpu / faiss-gpu-cuvs provide the same modules and overwrite each other, so the
GPU install must select the GPU builds and neither CPU build, all on CUDA 13 (ONNX Runtime's CUDA and cuDNN wheels
included, no `*-cu12` wheel: faiss-gpu, the CUDA 12 build, would add a second CUDA runtime), and no serving install
may pull torch; the client install pulls none of the server's stack. A pip resolution dry run (no download of the
wheels, no install) checks it against the real package index; without network access the test is skipped with
pip's reason. Offline, the same question is answered from pyproject.toml and the installed packages' metadata
(:func:`closure`).
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                         r"Failed to establish a new connection|"
                         r"No matching distribution found for (onnx|faiss|fastapi)")


def resolve(target: str, tmp_path: Path) -> set[str]:
    """The distributions pip would install for ``target``. fast-deps: each wheel's METADATA read by HTTP range
    requests (pip falls back to the whole wheel where an index refuses them), the same resolution without
    downloading the GPU install's 3 GB of CUDA wheels from an index that serves no separate metadata files."""
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--no-build-isolation", "--disable-pip-version-check", "--use-feature=fast-deps",
                        "--report", str(report), target],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 0 and UNREACHABLE.search(r.stderr + r.stdout):
        pytest.skip(f"package index unreachable: {UNREACHABLE.search(r.stderr + r.stdout).group(0)}")
    assert r.returncode == 0, r.stderr[-3000:]
    return {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_gpu_install_selects_the_gpu_builds_and_no_torch(tmp_path):
    names = resolve(".[gpu]", tmp_path)
    assert {"onnxruntime-gpu", "faiss-gpu-cuvs", "fastapi", "cyanure", "orjson"} <= names
    assert {"nvidia-cudnn-cu13", "nvidia-cuda-runtime"} <= names, "ONNX Runtime's CUDA 13 and cuDNN wheels"
    assert not names & {"onnxruntime", "faiss-cpu"}, "a CPU build would overwrite the GPU module"
    assert "faiss-gpu" not in names and not {n for n in names if n.endswith("-cu12")}, "one CUDA major: 13"
    assert not {n for n in names if n.startswith("torch")}


@pytest.mark.slow
def test_serve_install_is_cpu_only_and_has_no_torch(tmp_path):
    names = resolve(".[serve]", tmp_path)
    assert {"onnxruntime", "openvino", "faiss-cpu", "fastapi", "cyanure", "orjson"} <= names
    assert not names & {"onnxruntime-gpu", "faiss-gpu", "faiss-gpu-cuvs"}
    assert not {n for n in names if n.startswith(("torch", "nvidia-"))}


SERVER_STACK = {"onnxruntime", "onnxruntime-gpu", "openvino", "faiss-cpu", "faiss-gpu", "faiss-gpu-cuvs", "cyanure",
                "fastapi", "starlette", "uvicorn", "torch"}


def closure(extra: str) -> set[str]:
    """The distributions ``pip install '.[extra]'`` brings, read offline: the project's requirements from
    pyproject.toml (``msn[...]`` self-references followed), then each dependency's from its installed metadata
    (a dependency that is not installed here is counted but not followed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    extras_done: set[str] = set()
    names: set[str] = set()

    def add_extra(name: str) -> None:
        if name not in extras_done:
            extras_done.add(name)
            todo.extend(Requirement(r) for r in project["optional-dependencies"][name])

    add_extra(extra)
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) == project["name"]:
            for name in req.extras:
                add_extra(name)
            continue
        name = canonicalize_name(req.name)
        if name in names:
            continue
        names.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for dep in map(Requirement, requires):
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return names


def test_client_extra_has_none_of_the_server_stack():
    client, serve = closure("client"), closure("serve")
    assert {"httpx", "numpy", "pillow"} <= client and not client & SERVER_STACK, sorted(client)
    assert not {n for n in client if n.startswith(("torch", "nvidia-"))}
    assert {"onnxruntime", "fastapi", "httpx"} <= serve  # the walk does follow msn[serve-common] and msn[client]
    assert client < serve and client < closure("viz")  # serving and the visualizer's labelling tab include it


@pytest.mark.slow
def test_client_install_has_none_of_the_server_stack(tmp_path):
    names = resolve(".[client]", tmp_path)
    assert {"httpx", "numpy", "pillow"} <= names and not names & SERVER_STACK, sorted(names)
    assert not {n for n in names if n.startswith(("torch", "nvidia-"))}
