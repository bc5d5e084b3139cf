"""msn_core.preprocessing (the bundle's preprocessing, one definition) and msn_core.inference (running a graph).

The graph here is a hand-built ONNX model with the bundle's inputs (``pixel_values``, ``keep_idx``) whose output is
computable by hand, so the runner is checked without torch. Serving's and training's use of both modules are
checked against a real exported ViT in tests/serve and tests/evaluation. OpenVINO runs in a separate interpreter
only (its CPU plugin must not share a process with torch, which other tests of the session load).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from msn_core.bundle import BundleError, Preprocessing
from msn_core.inference import OrtGraph, openvino_config, ort_device
from msn_core.preprocessing import normalise, preprocess_uint8, resize_crop, resize_plan

REPO = Path(__file__).resolve().parents[2]


def test_resize_plan_is_the_contract_geometry():
    landscape = resize_plan(30, 40, resize=36, crop=32)  # shorter side 30 -> 36, 40 -> 48; floored offsets
    assert (landscape.height, landscape.width, landscape.top, landscape.left) == (36, 48, 2, 8)
    portrait = resize_plan(41, 20, resize=16, crop=15)  # 41 * 0.8 = 32.8 -> 33
    assert (portrait.height, portrait.width, portrait.top, portrait.left) == (33, 16, 9, 0)
    assert resize_plan(7, 7, resize=7, crop=7) == resize_plan(7, 7, 7, 7)  # no resize, no offset
    with pytest.raises(ValueError, match="crop 32 is larger than the resized shorter side 24"):
        resize_plan(30, 30, resize=24, crop=32)


def test_pillow_pipeline_follows_the_plan_and_normalises():
    pre = Preprocessing(resize=8, crop=6, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    image = np.zeros((3, 10, 20), dtype=np.uint8)
    image[:, :, 10:] = 255  # left half black, right half white: the crop window decides what is seen
    out = preprocess_uint8(image, pre)
    assert out.shape == (3, 6, 6) and out.dtype == np.float32
    plan = resize_plan(10, 20, 8, 6)
    assert (plan.width, plan.left) == (16, 5)  # the window spans the middle: black on its left, white on its right
    np.testing.assert_allclose(out[:, :, 0], np.array([[-1.0], [-1.0], [0.0]]).repeat(6, 1), atol=1e-6)
    np.testing.assert_allclose(out[:, :, -1], np.array([[1.0], [3.0], [1.0]]).repeat(6, 1), atol=1e-6)
    grey = Preprocessing(resize=4, crop=4, mean=(0.5,), std=(0.5,), channels=1)
    assert preprocess_uint8(np.full((3, 4, 4), 255, np.uint8), grey).tolist() == [[[1.0] * 4] * 4]
    assert normalise(np.full((2, 2), 51, np.uint8), (0.2,), (1.0,)).shape == (1, 2, 2)
    from PIL import Image

    with pytest.raises(ValueError, match="unsupported interpolation 'cubic'"):
        resize_crop(Image.new("RGB", (8, 8)), Preprocessing(4, 4, (0,) * 3, (1,) * 3, interpolation="cubic"))


def test_normalise_table_gives_the_formula_bits_for_every_level():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    levels = np.arange(256, dtype=np.uint8)
    image = np.stack([levels, levels[::-1], np.roll(levels, 7)], axis=1).reshape(16, 16, 3)
    formula = ((image.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32))
    out = normalise(image, mean, std)
    assert out.shape == (3, 16, 16) and out.flags.c_contiguous
    assert np.array_equal(out.view(np.uint32), formula.transpose(2, 0, 1).view(np.uint32))
    assert normalise(image[:, :, 0], mean, std).shape == (3, 16, 16)  # grey broadcast, as the formula does
    with pytest.raises(ValueError, match="2 mean/std values for an image of 3 channels"):
        normalise(image, (0.5, 0.5), (1.0, 1.0))


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos", "nearest", "box"])
def test_resampling_the_crop_window_equals_resize_then_crop(interpolation: str):
    """The window-only resample (one pass, the window's cost) against the definition written out."""
    from PIL import Image

    rng = np.random.default_rng(3)
    worst = 0
    for h, w, resize, crop in [(224, 224, 256, 224), (240, 320, 256, 224), (97, 61, 40, 32), (500, 300, 36, 32)]:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        plan = resize_plan(h, w, resize, crop)
        resample = Image.Resampling[interpolation.upper()]
        expected = np.asarray(image.resize((plan.width, plan.height), resample).crop(
            (plan.left, plan.top, plan.left + crop, plan.top + crop)), dtype=np.int16)
        got = np.asarray(resize_crop(image, Preprocessing(resize, crop, (0,) * 3, (1,) * 3,
                                                          interpolation=interpolation)), dtype=np.int16)
        assert got.shape == expected.shape == (crop, crop, 3)
        worst = max(worst, int(np.abs(got - expected).max()))
        if (h, w) == (224, 224):
            assert worst == 0  # the common upload: bit-identical
    assert worst <= (1 if interpolation in ("bicubic", "bilinear", "lanczos") else 0)


def _graph(path: Path, first_input: str = "pixel_values") -> Path:
    """``embedding = [mean of each channel, largest kept index]``: (B,3,H,W) + (B,K) -> (B,4)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("ReduceMean", [first_input], ["channel_mean"], axes=[2, 3], keepdims=0),
        helper.make_node("Cast", ["keep_idx"], ["keep_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["keep_f"], ["keep_max"], axes=[1], keepdims=1),
        helper.make_node("Concat", ["channel_mean", "keep_max"], ["embedding"], axis=1),
    ]
    graph = helper.make_graph(nodes, "tiny", [
        helper.make_tensor_value_info(first_input, TensorProto.FLOAT, ["B", 3, "H", "W"]),
        helper.make_tensor_value_info("keep_idx", TensorProto.INT64, ["B", "K"]),
    ], [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["B", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_ort_graph_runs_the_bundle_contract_with_one_set_of_settings(tmp_path: Path):
    graph = OrtGraph(_graph(tmp_path / "tiny.onnx"), intra_op_threads=1)
    assert (graph.runtime, graph.device, graph.output_name) == ("onnxruntime", "cpu", "embedding")
    options = graph.session.get_session_options()
    assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((2, 3, 5, 6))
    keep = np.array([[0, 4, -1], [2, 7, 3]])  # -1: padding, passed through as the graph expects
    out = graph.run(pixels, keep)  # float64 pixels and int32-able keeps are cast by the feeds
    assert out.dtype == np.float32 and out.shape == (2, 4)
    np.testing.assert_allclose(out[:, :3], pixels.mean(axis=(2, 3)), rtol=1e-5)
    assert out[:, 3].tolist() == [4.0, 7.0]
    with pytest.raises(BundleError, match=r"wrong\.onnx: graph inputs .* are not a bundle's"):
        OrtGraph(_graph(tmp_path / "wrong.onnx", first_input="image"))


def test_cuda_without_the_provider_is_refused_with_the_install_line():
    import onnxruntime as ort

    from msn_core.gpu import CudaUnavailable

    assert ort_device("cpu") == "cpu"
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime here has a CUDA provider")
    with pytest.raises(CudaUnavailable) as e:
        ort_device("cuda:0")
    assert str(e.value).startswith(f"--device cuda:0 needs onnxruntime-gpu with its CUDA provider (this onnxruntime "
                                   f"{ort.__version__} is the CPU build)")
    assert "pip install 'msn[gpu]'" in str(e.value) and "\n" not in str(e.value)


def test_openvino_settings_are_one_table():
    assert openvino_config("bf16", 3) == {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY",
                                          "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": 3, "ENABLE_CPU_PINNING": False}
    assert openvino_config("int8")["INFERENCE_PRECISION_HINT"] == "f32"  # the graph's own Q/DQ, f32 around them
    assert openvino_config("fp32")["INFERENCE_NUM_THREADS"] >= 1
    with pytest.raises(ValueError, match="fp32, bf16 or int8, not 'fp16'"):
        openvino_config("fp16")


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")
def test_openvino_graph_matches_onnx_runtime_in_a_fresh_interpreter(tmp_path: Path):
    path = _graph(tmp_path / "tiny.onnx")
    code = """
import json, sys
import numpy as np
from msn_core.inference import OpenVinoGraph, OrtGraph
pixels = np.random.default_rng(1).standard_normal((3, 3, 4, 4)).astype(np.float32)
keep = np.array([[0, 1], [5, -1], [2, 3]])
ov = OpenVinoGraph(sys.argv[1], threads=1)
print(json.dumps([ov.runtime, ov.run(pixels, keep).tolist(), OrtGraph(sys.argv[1]).run(pixels, keep).tolist()]))
"""
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                       check=False, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    runtime, ov, ort = json.loads(r.stdout.strip().splitlines()[-1])
    assert runtime == "openvino"
    np.testing.assert_allclose(ov, ort, rtol=1e-5, atol=1e-6)
