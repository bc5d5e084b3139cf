"""``msn-serve --precision auto``: the runtime and precision are chosen on the CPU found, by measurement, and gated.

Real ONNX Runtime and OpenVINO sessions of the tiny test bundle (and of its QDQ int8 copy); the CPU's flags are
simulated with ``MSN_CPU_FLAGS`` for the branches this machine does not take. Timings are never asserted: only that
the fastest *measured* candidate is the one served, and that what cannot run here is excluded with a reason.

OpenVINO never loads into the pytest process: with its CPU plugin loaded, torch later crashed (a segfault in the
two-rank gloo test) and, in a benchmark, returned wrong bf16 results. The service never imports torch, so it never
meets this; here every check that touches OpenVINO in-process (``check_*``) runs in a fresh interpreter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image

from msn_core.bundle import load_bundle_info
from msn_core.hardware import cpu_info
from msn_core.inference import openvino_capabilities
from msn_serve.embedding.choice import CHOICE_FILE, Candidate, Request, choose_engine, plan, probe_inputs
from msn_serve.embedding.engine import Engine, OpenVinoEngine

OPENVINO = importlib.util.find_spec("openvino") is not None  # found, not imported (see above)
needs_openvino = pytest.mark.skipif(not OPENVINO, reason="openvino is not installed")
AVX2 = "avx2 fma"  # an AVX2-only CPU: no bf16 units, no VNNI
BF16_CPU = "avx2 fma avx512f avx512_bf16 avx512_vnni"


@pytest.fixture(scope="module")
def qdq_bundle(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.bundle.export import add_int8
    from training.bundle.quantize import QuantizeOptions

    out = tmp_path_factory.mktemp("qdq") / "bundle"
    shutil.copytree(bundle_dir, out)
    add_int8(out, QuantizeOptions(method="qdq", data="synthetic", calibration_images=32, guard_images=256,
                                  speed_seconds=0.2))
    return out


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def isolated(check: str, *paths: Path) -> None:
    """Run ``check(*paths)`` of this module in a fresh interpreter; its assertion errors fail the test."""
    code = (f"import sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[2])]!r}; "
            f"from pathlib import Path; import test_runtime_choice as t; "
            f"t.{check}(*[Path(p) for p in sys.argv[1:]])")
    r = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "MSN_CPU_FLAGS"}, check=False)
    assert r.returncode == 0, r.stderr[-4000:]


def test_plan_excludes_what_this_cpu_or_bundle_cannot_run(bundle_dir: Path):
    isolated("check_plan", bundle_dir)


def test_openvino_runs_int8_only_from_a_qdq_graph(qdq_bundle: Path):
    isolated("check_qdq_plan", qdq_bundle)


@needs_openvino
def test_openvino_engine_matches_onnxruntime_on_padded_masked_batches(bundle_dir: Path, qdq_bundle: Path):
    isolated("check_openvino_engine", bundle_dir, qdq_bundle)


def test_auto_serves_the_fastest_gated_candidate_and_caches_the_choice(qdq_bundle: Path, tmp_path: Path):
    isolated("check_auto_choice", qdq_bundle, tmp_path)


def check_plan(bundle_dir: Path) -> None:
    info = load_bundle_info(bundle_dir)
    candidates, excluded = plan(info, Request(), cpu_info(AVX2))
    names = {c.name for c in candidates}
    assert "onnxruntime/fp32" in names and not {n for n in names if n.endswith(("/bf16", "/int8"))}
    assert "no int8 graph" in excluded["onnxruntime/int8"] and "--quantize int8" in excluded["onnxruntime/int8"]
    assert "no bf16 kernels" in excluded["onnxruntime/bf16"]
    if OPENVINO:
        assert "no bf16 matrix units" in excluded["openvino/bf16"]
        assert "openvino/fp32" in names
    else:
        assert "not installed" in excluded["openvino/fp32"]
    candidates, excluded = plan(info, Request(), cpu_info(BF16_CPU))
    bf16 = Candidate("openvino", "bf16") in candidates
    assert bf16 == (OPENVINO and "BF16" in openvino_capabilities()), excluded.get("openvino/bf16")
    candidates, _ = plan(info, Request(precision="fp32", runtime="onnxruntime"), cpu_info(BF16_CPU))
    assert candidates == [Candidate("onnxruntime", "fp32")]


def check_qdq_plan(qdq_bundle: Path) -> None:
    info = load_bundle_info(qdq_bundle)
    assert info.int8 is not None and info.int8.method == "qdq"
    assert info.int8.details["settings"]["format"] == "QDQ" and info.int8.guard["passed"]
    candidates, excluded = plan(info, Request(precision="int8"), cpu_info(AVX2))
    assert Candidate("onnxruntime", "int8") in candidates
    assert (Candidate("openvino", "int8") in candidates) == OPENVINO, excluded


def check_openvino_engine(bundle_dir: Path, qdq_bundle: Path) -> None:
    info = load_bundle_info(bundle_dir)
    reference, ov = Engine(info, intra_op_threads=1), OpenVinoEngine(info, precision="fp32", intra_op_threads=1)
    assert (ov.runtime, ov.precision, ov.device) == ("openvino", "fp32", "cpu")
    pixels, _ = probe_inputs(info, 4)[0]
    keep = np.tile(np.arange(info.num_patches, dtype=np.int64), (4, 1))
    keep[1, info.num_patches // 2:] = -1  # a mixed-K batch as the batcher pads it
    keep[2] = np.roll(keep[2], 3)
    for k in (keep, keep[:, :5]):  # the shape changes between calls (dynamic B and K)
        a, b = reference.run(pixels, k), ov.run(pixels, k)
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)
    int8 = OpenVinoEngine(load_bundle_info(qdq_bundle), precision="int8", intra_op_threads=1)
    a, b = reference.run(pixels, keep), int8.run(pixels, keep)
    assert _cos(a, b).min() >= 0.99 and not np.allclose(a, b, atol=1e-6)  # int8 ran, and is close


def check_auto_choice(qdq_bundle: Path, tmp_path: Path) -> None:
    info = load_bundle_info(qdq_bundle)
    engine, choice = choose_engine(info, Request(threads=1), cache_dir=tmp_path, seconds=0.1)
    assert choice.how == "measured" and choice.batch == 8 and choice.cpu["cpu_model"]
    measured = {n: f for n, f in choice.candidates.items() if f["passed"]}
    assert "onnxruntime/fp32" in measured and "onnxruntime/int8" in measured
    assert all(f["cosine_min"] >= 0.99 and f["images_per_s"] > 0 for f in measured.values())
    fastest = max(measured, key=lambda n: measured[n]["images_per_s"])
    assert f"{engine.runtime}/{engine.precision}" == f"{choice.runtime}/{choice.precision}" == fastest
    assert set(choice.candidates) | set(choice.excluded) >= {"onnxruntime/bf16", "openvino/fp32"}
    cache = json.loads((tmp_path / CHOICE_FILE).read_text())
    assert len(cache) == 1
    again, cached = choose_engine(info, Request(threads=1), cache_dir=tmp_path, seconds=0.1)
    assert cached.how == "cached" and (again.runtime, again.precision) == (engine.runtime, engine.precision)
    _, other = choose_engine(info, Request(threads=1, precision="fp32"), cache_dir=tmp_path, seconds=0.1)
    assert other.precision == "fp32"  # timed (and cached) only when there is a choice: ORT and OpenVINO fp32
    assert len(json.loads((tmp_path / CHOICE_FILE).read_text())) == (2 if OPENVINO else 1)


def test_auto_server_reports_its_choice_and_falls_back_without_bf16_units(bundle_dir: Path, tmp_path: Path):
    srv = Server(bundle_dir, tmp_path / "data", "--precision", "auto", env={"MSN_CPU_FLAGS": AVX2}).start()
    try:
        with srv.client() as c:
            ready = c.get("/readyz").json()
            info = c.get("/info").json()
            metrics = c.get("/metrics").text
            r = c.post("/embed", files=[("images", encode(random_image(s))) for s in range(3)],
                       data={"mask": '{"ratio": 0.5, "seed": 1}'})
    finally:
        srv.stop()
    choice = ready["runtime_choice"]
    assert ready["ready"] and ready["precision"] in ("fp32", "int8") and ready["runtime"] == choice["runtime"]
    if OPENVINO:
        assert "no bf16 matrix units" in choice["excluded"]["openvino/bf16"]
    assert "(flags simulated)" in choice["cpu"]["cpu_model"] and not choice["cpu"]["bf16_native"]
    assert info["runtime_choice"] == choice
    if OPENVINO:  # two fp32 candidates, so both were timed
        assert 'msn_runtime_candidate_images_per_second{candidate="onnxruntime/fp32"}' in metrics
    assert f'runtime="{choice["runtime"]}"' in metrics
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 3
    assert (tmp_path / "data" / "cache" / CHOICE_FILE).is_file() == OPENVINO


def _serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msn_serve", *args], check=False, capture_output=True, text=True,
                          timeout=60, env=env)


def test_explicit_choices_that_cannot_run_here_are_start_up_errors(bundle_dir: Path, tmp_path: Path):
    env = {**os.environ, "MSN_CPU_FLAGS": AVX2}
    r = _serve("--bundle", str(bundle_dir), "--data-dir", str(tmp_path / "a"), "--precision", "bf16", env=env)
    assert r.returncode == 2 and "cannot serve --precision bf16" in r.stderr
    assert "no bf16 kernels" in r.stderr  # ONNX Runtime's reason, whatever OpenVINO's is
    r = _serve("--bundle", str(bundle_dir), "--precision", "bf16", "--device", "cuda", env=env)
    assert r.returncode == 2 and "precision bf16 is the bundle's CPU graph" in r.stderr
    r = _serve("--bundle", str(bundle_dir), "--runtime", "openvino", "--device", "cuda", env=env)
    assert r.returncode == 2 and "runtime openvino is CPU-only" in r.stderr
    r = _serve("--bundle", str(bundle_dir), "--runtime", "tensorrt", env=env)
    assert r.returncode == 2 and "invalid choice: 'tensorrt'" in r.stderr


@needs_openvino
def test_openvino_server_embeds_like_onnxruntime(bundle_dir: Path, server: Server, tmp_path: Path):
    srv = Server(bundle_dir, tmp_path / "data", "--runtime", "openvino", "--precision", "fp32").start()
    images = [encode(random_image(s)) for s in range(5)]
    try:
        for mask in (None, '{"ratio": 0.4, "seed": 2}'):
            out = []
            for s in (server, srv):
                with s.client() as c:
                    r = c.post("/embed", files=[("images", im) for im in images],
                               data={"mask": mask} if mask else None)
                assert r.status_code == 200, r.text
                out.append(np.asarray(r.json()["embeddings"]))
            np.testing.assert_allclose(out[1], out[0], rtol=1e-3, atol=1e-4)
        with srv.client() as c:
            ready = c.get("/readyz").json()
        assert ready["runtime"] == "openvino" and ready["runtime_choice"]["how"] == "requested"
    finally:
        srv.stop()
