"""The prepared GPU run, dry: the same scripts on the CPU with tiny sizes and the CUDA parts skipped with their
reason (docs/gpu-run.md), so a lent GPU's minutes are never lost to a typo. Also the parts' round trip: pack,
split, receive, join, hash-check and unpack."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _wheel(path: Path, module: str, body: str) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{module}/__init__.py", body)
        z.writestr(f"{module}-1.0.dist-info/METADATA", f"Name: {module}\nVersion: 1.0\n")
        z.writestr(f"{module}-1.0.data/purelib/{module}_extra.py", "EXTRA = 1\n")
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


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["serving", "training"])  # one stage a test: the suite's workers share them
def test_the_gpu_run_dry_on_the_cpu(tmp_path: Path, stage: str) -> None:
    # the CUDA tests (stage "tests") are collected by this suite itself
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--dry-run", "--out", str(tmp_path),
                        "--deadline", "400", "--official", str(tmp_path / "no-official"), "--only", stage],
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    summary = json.loads((tmp_path / "gpu_run.json").read_text())
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:] + (tmp_path / "gpu_run.log").read_text()[-3000:]
    assert set(summary["stages"]) == {stage}
    assert all(s["exit"] == 0 for s in summary["stages"].values()), summary
    if stage == "serving":
        serving = json.loads((tmp_path / "serving.json").read_text())
        assert serving["cuda"] is False and "ort-cuda/fp16" in serving["offline"]["skipped"]
        assert serving["http"]["clients"][-1]["errors"] == 0
    else:
        training = json.loads((tmp_path / "training.json").read_text())
        assert [r["implementation"] for r in training["rows"]][:2] == ["ours", "official"]
        assert training["rows"][0]["images_per_sec"] > 0 and "skipped" in training["rows"][1]
        breakdown = training["breakdown"]  # our step split into step / step on made views / augmentation
        assert set(breakdown) == {"bf16", "fp32"} and breakdown["bf16"]["phases"]["augment"]["s_per_step"] > 0
        assert (tmp_path / "training-profile" / "bf16-profile.txt").is_file()  # one precision profiled
