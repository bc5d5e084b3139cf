"""``msn-serve --precision int8``: the bundle's guarded int8 graph, served and reported in /readyz, /info, /metrics."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image

from training.bundle.export import add_int8
from training.bundle.quantize import QuantizeOptions


@pytest.fixture(scope="module")
def int8_bundle(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("int8") / "bundle"
    shutil.copytree(bundle_dir, out)
    add_int8(out, QuantizeOptions(method="dynamic", data="synthetic", calibration_images=32, guard_images=256,
                                  speed_seconds=0.2))
    return out


@pytest.fixture(scope="module")
def int8_server(int8_bundle: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(int8_bundle, tmp_path_factory.mktemp("serve-int8") / "data", "--precision", "int8").start()
    yield srv
    srv.stop()


def _embed(srv: Server, images: list[bytes], mask: str | None = None) -> np.ndarray:
    with srv.client() as c:
        data = {"mask": mask} if mask else None
        r = c.post("/embed", files=[("images", im) for im in images], data=data)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"])


def test_int8_is_served_and_reported(int8_server: Server, server: Server):
    with int8_server.client() as c:
        ready = c.get("/readyz").json()
        assert ready["ready"] and ready["precision"] == "int8" and ready["device"] == "cpu"
        assert c.get("/info").json()["precision"] == "int8"
        metrics = c.get("/metrics").text
    model_id = ready["model_id"]
    assert (f'msn_model_info{{device="cpu",model_id="{model_id}",precision="int8",runtime="onnxruntime"}} 1.0'
            in metrics)
    with server.client() as c:
        assert c.get("/readyz").json()["precision"] == "fp32"
        assert 'precision="fp32"' in c.get("/metrics").text
    images = [encode(random_image(s)) for s in range(6)]
    for mask in (None, '{"ratio": 0.5, "seed": 3}'):
        a, b = _embed(server, images, mask), _embed(int8_server, images, mask)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert a.shape == b.shape and cos.min() >= 0.99 and not np.array_equal(a, b)  # int8 ran, and is close


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msn_serve", *args], check=False, capture_output=True, text=True,
                          timeout=60)


def test_int8_needs_an_int8_bundle_and_a_cpu(bundle_dir: Path, int8_bundle: Path, tmp_path: Path):
    r = _serve("--bundle", str(bundle_dir), "--data-dir", str(tmp_path / "a"), "--precision", "int8")
    assert r.returncode == 2 and "has no int8 graph" in r.stderr and "--quantize int8" in r.stderr
    r = _serve("--bundle", str(int8_bundle), "--data-dir", str(tmp_path / "b"), "--precision", "int8",
               "--device", "cuda")
    assert r.returncode == 2 and "precision int8 is the bundle's CPU graph" in r.stderr
    r = _serve("--bundle", str(int8_bundle), "--precision", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr
