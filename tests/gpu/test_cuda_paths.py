"""The CUDA paths, run for real where a GPU is (``pytest -m cuda``; benchmarks/gpu/run.py runs them on a lent GPU
machine). Elsewhere every test here is skipped with the reason, and the CPU fallbacks are tested in tests/serve.

- ONNX Runtime's CUDA provider really runs the session (not a silent CPU fallback), fp32 equal to the CPU
  provider, the fp16 variant gated and close, masked and padded mixed-K batches included;
- a real ``msn-serve --device cuda`` reports CUDA and embeds like a CPU server (masked too);
- a few pretraining steps on the GPU in bf16 (``run.precision=auto``) with finite losses.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _cuda_reason() -> str | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} is the CPU build (needs onnxruntime-gpu)"
    try:
        import torch
    except ImportError:
        return None
    return None if torch.cuda.is_available() else "no CUDA device"


REASON = _cuda_reason()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"needs a CUDA GPU: {REASON}")]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.serving.serve_harness import tiny_bundle

    return tiny_bundle(tmp_path_factory.mktemp("gpu") / "bundle")


def _batches(info) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    n = info.num_patches
    pixels = rng.standard_normal((4, info.in_chans, info.image_size, info.image_size)).astype(np.float32)
    full = np.tile(np.arange(n, dtype=np.int64), (4, 1))
    mixed = np.full((4, n), -1, dtype=np.int64)  # padded mixed-K: 4, n/2, n/4 and n patches kept
    for row, k in enumerate((4, n // 2, n // 4, n)):
        mixed[row, :k] = np.sort(rng.permutation(n)[:k])
    return [(pixels, full), (pixels, mixed)]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def test_ort_cuda_session_runs_on_cuda_and_matches_cpu(bundle: Path, tmp_path: Path) -> None:
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine

    info = load_bundle_info(bundle)
    cpu = Engine(info, device="cpu")
    fp32 = Engine(info, device="cuda", fp16=False, cache_dir=tmp_path)
    assert fp32.device == "cuda" and fp32.graph.provider == "CUDAExecutionProvider"
    for pixels, keep in _batches(info):
        ref, got = cpu.run(pixels, keep), fp32.run(pixels, keep)
        assert got.shape == ref.shape and np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, atol=2e-3, rtol=2e-3)


def test_fp16_variant_is_gated_and_close(bundle: Path, tmp_path: Path) -> None:
    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.engine import Engine

    info = load_bundle_info(bundle)
    cpu, half = Engine(info, device="cpu"), Engine(info, device="cuda", fp16=True, cache_dir=tmp_path)
    assert half.precision in ("fp16", "fp32")  # fp32 only when the gate refused fp16, which it must say
    for pixels, keep in _batches(info):
        assert _cosine(cpu.run(pixels, keep), half.run(pixels, keep)) >= 0.999


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_msn_serve_on_cuda_embeds_like_a_cpu_server(bundle: Path, tmp_path: Path) -> None:
    import httpx

    from benchmarks.serving.serve_harness import start_server

    out = {}
    for device in ("cpu", "cuda"):
        proc, url = start_server(bundle, tmp_path / device, ["--device", device])
        try:
            ready = httpx.get(f"{url}/readyz", timeout=10).json()
            assert ready.get("device", device) == device, ready
            rows = []
            for seed, mask in ((0, None), (1, json.dumps({"ratio": 0.5, "seed": 3}))):
                data = {"mask": mask} if mask else {}
                r = httpx.post(f"{url}/embed", files={"image": ("x.png", _jpeg(seed), "image/png")}, data=data,
                               timeout=60)
                assert r.status_code == 200, r.text
                rows.append(np.asarray(r.json()["embedding"], np.float64))
            out[device] = np.stack(rows)
        finally:
            proc.terminate()
            proc.wait(30)
    assert _cosine(out["cpu"], out["cuda"]) >= 0.999


def test_a_few_pretraining_steps_on_the_gpu_in_bf16(tmp_path: Path) -> None:
    overrides = ["data.source=synthetic", "data.synthetic_size=64", "model.arch=vit_tiny", "model.image_size=32",
                 "model.patch_size=4", "mask.focal_size=16", "mask.num_focal=2", "data.load_size=32",
                 "data.batch_size=8", "data.num_workers=0", "optim.epochs=1", "run.max_steps=4",
                 "run.log_every_steps=1", "run.device=cuda", "run.precision=auto", "run.progress_bar=false"]
    cmd = [sys.executable, "-m", "training.pretrain", "--output-dir", str(tmp_path)]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps and all(np.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["precision"] == "bf16"
