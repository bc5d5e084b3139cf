"""The prepared GPU run, dry: the same scripts on the CPU with tiny sizes and the CUDA parts skipped with their
reason (docs/gpu-run.md), so a lent GPU's minutes are never lost to a typo. Also the parts' round trip: pack,
split, receive, join, hash-check and unpack, for the main payload and the optional FAISS GPU one."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _wheel(path: Path, module: str, body: str, extra: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{module}/__init__.py", body)
        z.writestr(f"{module}-1.0.dist-info/METADATA", f"Name: {module}\nVersion: 1.0\n")
        z.writestr(f"{module}-1.0.data/purelib/{module}_extra.py", "EXTRA = 1\n")
        for name, text in (extra or {}).items():
            z.writestr(name, text)
    return path


def test_parts_round_trip_through_receive_and_install(tmp_path: Path) -> None:
    from benchmarks.gpu.pack import pack

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    random_hex = np.random.default_rng(0).bytes(6000).hex()  # incompressible enough for several parts
    _wheel(wheels / "alpha-1.0-py3-none-any.whl", "alpha", "VALUE = 'alpha'\n# " + random_hex + "\n")
    _wheel(wheels / "beta-1.0-py3-none-any.whl", "beta", "VALUE = 'beta'\n")
    tree = tmp_path / "tree"
    manifest = pack(wheels, None, tree / ".gpu", part_mib=0.002, level=0)
    assert len(manifest["parts"]) >= 2 and set(manifest["wheels"]) == {"alpha-1.0-py3-none-any.whl",
                                                                       "beta-1.0-py3-none-any.whl"}
    store = tmp_path / "store"
    env = {"MSN_GPU_STORE": str(store), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    scripts = REPO / "benchmarks" / "gpu"
    # One part per call, as the device tool sends them: each call carries only its own folder.
    parts = sorted((tree / ".gpu").glob("part-*"))
    for i, part in enumerate(parts):
        call = tmp_path / f"call{i}"
        (call / ".gpu").mkdir(parents=True)
        (call / ".gpu" / part.name).symlink_to(part)
        if i == 0:  # the first call also carries the early archive, unpacked at once
            (call / ".gpu" / "early").symlink_to(tree / ".gpu" / "early")
        r = subprocess.run(["bash", str(scripts / "receive.sh")], cwd=call, env=env,
                           capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr
        last = r.stdout.strip().splitlines()[-1]
        assert ("all parts here" in last) == (i == len(parts) - 1), r.stdout
    assert (store / "early" / ".checked").is_file() and (store / "early" / "site").is_dir()
    (store / "parts" / parts[0].name).write_bytes(b"corrupt")  # a bad part is named, not installed
    r = subprocess.run(["bash", str(scripts / "install.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "BAD HASH" in r.stdout
    (store / "parts" / parts[0].name).write_bytes((parts[0] / "payload.part").read_bytes())
    r = subprocess.run(["bash", str(scripts / "install.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    site = store / "payload" / "site"
    check = subprocess.run([sys.executable, "-c", "import alpha, beta, alpha_extra; print(alpha.VALUE, beta.VALUE)"],
                           env={**env, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=False)
    assert check.stdout.strip() == "alpha beta", check.stderr
    again = subprocess.run(["bash", str(scripts / "install.sh")], cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=False)
    assert again.returncode == 0 and "checked and unpacked" not in again.stdout  # idempotent: kept, not redone


def test_faiss_gpu_payload_travels_beside_the_main_one(tmp_path: Path) -> None:
    """The optional FAISS payload: pruned of headers and archives, split into faiss-part-NN, received in the same
    store as the main payload's parts without disturbing them, installed on its own with the image's CUDA 13
    libraries linked beside the carried runtime."""
    from benchmarks.gpu.pack import pack, pack_faiss_gpu

    main_wheels, faiss_wheels = tmp_path / "main-wheels", tmp_path / "faiss-wheels"
    main_wheels.mkdir()
    faiss_wheels.mkdir()
    _wheel(main_wheels / "alpha-1.0-py3-none-any.whl", "alpha", "VALUE = 'alpha'\n")
    noise = np.random.default_rng(1).bytes(4000).hex()
    _wheel(faiss_wheels / "faissgpu-1.0-py3-none-any.whl", "faissgpu", f"VALUE = 'gpu'\n# {noise}\n",
           {"libcuvs/include/cuvs.hpp": "// header\n" * 500, "libcuvs/lib64/cmake/cuvs.cmake": "# cmake\n",
            "libcuvs/lib64/libcuvs.so": "\x7fELF cuvs\n", "nvidia/cu13/lib/libcudart.so.13": "\x7fELF cudart 13.2\n",
            "nvidia/cu13/lib/libcudart_static.a": "archive\n", "nvidia/cu13/include/cuda.h": "// header\n"})
    tree = tmp_path / "tree"
    pack(main_wheels, None, tree / ".gpu", part_mib=1, level=0)
    manifest = pack_faiss_gpu(faiss_wheels, tree / ".gpu", part_mib=0.002, level=0)
    assert len(manifest["parts"]) >= 2 and manifest["pruned_bytes"] > 0
    assert (tree / ".gpu" / "part-00").is_dir() and (tree / ".gpu" / "manifest.json").is_file()  # kept
    # The GPU image's own CUDA wheels, as `python3` there sees them (a stand-in interpreter puts them on its path).
    image = tmp_path / "image-site"
    for lib in ("nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcudart.so.13", "nvidia/nccl/lib/libnccl.so.2"):
        (image / lib).parent.mkdir(parents=True, exist_ok=True)
        (image / lib).write_text("image\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f"#!/bin/sh\nPYTHONPATH={image} exec {sys.executable} \"$@\"\n")
    (tmp_path / "bin" / "python3").chmod(0o755)
    store = tmp_path / "store"
    env = {"MSN_GPU_STORE": str(store), "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    scripts = REPO / "benchmarks" / "gpu"
    # A FAISS-payload session: the early archive with faiss-part-00, then the other FAISS parts; the main payload's
    # parts come later (here: to show both live in one store).
    faiss_parts = sorted((tree / ".gpu").glob("faiss-part-*"))
    for i, part in enumerate([*faiss_parts, *sorted((tree / ".gpu").glob("part-*"))]):
        call = tmp_path / f"call{i}"
        (call / ".gpu").mkdir(parents=True)
        (call / ".gpu" / part.name).symlink_to(part)
        if i == 0:
            (call / ".gpu" / "early").symlink_to(tree / ".gpu" / "early")
        r = subprocess.run(["bash", str(scripts / "receive.sh")], cwd=call, env=env, capture_output=True, text=True,
                           check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        if part == faiss_parts[-1]:
            assert "receive: faiss: all parts here" in r.stdout, r.stdout
            assert r.stdout.strip().endswith("receive: main payload not carried (the early archive only)")
            r = subprocess.run(["bash", str(scripts / "install.sh"), "faiss"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, check=False)
            assert r.returncode == 0, r.stdout + r.stderr
    assert "receive: faiss: all parts here" in r.stdout and r.stdout.strip().endswith("receive: all parts here")
    site = store / "faiss" / "site"
    assert (site / "faissgpu" / "__init__.py").is_file() and (site / "libcuvs" / "lib64" / "libcuvs.so").is_file()
    assert not (site / "libcuvs" / "include").exists() and not (site / "libcuvs" / "lib64" / "cmake").exists()
    assert not (site / "nvidia" / "cu13" / "include").exists() and not list(site.rglob("*.a"))
    lib = site / "nvidia" / "cu13" / "lib"
    assert (lib / "libcudart.so.13").read_text() == "\x7fELF cudart 13.2\n"  # the carried runtime, not the image's
    assert (lib / "libcublas.so.13").is_symlink() and (site / "nvidia" / "nccl").is_symlink()
    assert json.loads((store / "faiss" / "image-cuda.json").read_text())["linked"] == ["libcublas.so.13", "nccl/"]
    assert not (store / "payload").exists()  # the main payload is installed by its own call
    again = subprocess.run(["bash", str(scripts / "install.sh"), "faiss"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "checked and unpacked" not in again.stdout, again.stdout + again.stderr


def test_faiss_gpu_bench_runs_its_cpu_rows_and_names_what_it_skips(tmp_path: Path) -> None:
    """benchmarks.gpu.faiss_gpu with the CPU build of faiss (the run's faiss_gpu stage itself is skipped then):
    the CPU rows measured, every GPU row skipped with the reason."""
    out = tmp_path / "faiss_gpu.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.faiss_gpu", "--n", "3000", "--dim", "32", "--queries",
                        "100", "--min-seconds", "0.01", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert [(row["kind"], row["device"]) for row in result["rows"]] == [("flat", "cpu"), ("ivf", "cpu")]
    ivf = result["rows"][1]
    assert ivf["recall"] >= 0.95 and ivf["nprobe"] >= 1 and ivf["qps"] > 0 and ivf["tuning_curve"]
    assert set(result["skipped"]) == {"gpu", "cagra", "ivf-cuvs"} and "CPU build" in result["skipped"]["gpu"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["serving", "training", "faiss_gpu", "frontend"])  # one stage a test: the
def test_the_gpu_run_dry_on_the_cpu(tmp_path: Path, stage: str) -> None:               # suite's workers share them
    # the CUDA tests (stage "tests") are collected by this suite itself
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--dry-run", "--out", str(tmp_path),
                        "--deadline", "400", "--official", str(tmp_path / "no-official"), "--faiss-site",
                        str(tmp_path / "no-faiss"), "--only", stage],
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    summary = json.loads((tmp_path / "gpu_run.json").read_text())
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:] + (tmp_path / "gpu_run.log").read_text()[-3000:]
    assert set(summary["stages"]) == {stage}
    if stage == "faiss_gpu":  # faiss-cpu here: skipped, with the reason and what to carry
        assert "CPU build" in summary["stages"][stage]["skipped"], summary
        assert "--faiss-gpu" in summary["stages"][stage]["skipped"]
        return
    assert all(s["exit"] == 0 for s in summary["stages"].values()), summary
    if stage == "frontend":
        frontend = json.loads((tmp_path / "frontend.json").read_text())
        assert [(row["cores"], row["mode"]) for row in frontend["rows"]] == [(1, "http")]
        assert all(row["errors"] == 0 and row["images_per_s"] > 0 for row in frontend["rows"])
    elif stage == "serving":
        serving = json.loads((tmp_path / "serving.json").read_text())
        assert serving["cuda"] is False and "ort-cuda/fp16" in serving["offline"]["skipped"]
        by_workers = serving["http"]["by_workers"]
        assert set(by_workers) == {"0", "auto"} and all(r["clients"][-1]["errors"] == 0 for r in by_workers.values())
    else:
        training = json.loads((tmp_path / "training.json").read_text())
        assert [r["implementation"] for r in training["rows"]][:2] == ["ours", "official"]
        assert training["rows"][0]["images_per_sec"] > 0 and "skipped" in training["rows"][1]
        breakdown = training["breakdown"]  # our step split into step / step on made views / augmentation
        assert set(breakdown) == {"bf16", "fp32"} and breakdown["bf16"]["phases"]["augment"]["s_per_step"] > 0
        assert (tmp_path / "training-profile" / "bf16-profile.txt").is_file()  # one precision profiled
