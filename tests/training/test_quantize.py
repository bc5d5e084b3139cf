"""msn-export --quantize int8: a guarded int8 graph beside the fp32 one, refused when the guard fails.

Real ONNX Runtime quantization of tiny encoders, calibrated and guarded on the synthetic dataset (labelled, so the
low-shot check runs too); timings are not asserted (numbers belong to benchmarks/serving/serve_bench.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.training.test_export import NUM_PATCHES, PREPROCESSING, exported, random_inputs, tiny_encoder
from training.bundle import export
from training.bundle.quantize import QuantizeOptions

__all__ = ["exported"]  # the module fixture, shared with test_export
# One ONNX Runtime thread (all cores spin against the rest of the suite) and 0.2 s of timing per graph, as OPTIONS
SMALL = ["--calibration-data", "synthetic", "--calibration-images", "32", "--guard-images", "256",
         "--quantize-threads", "1", "--quantize-speed-seconds", "0.2"]
OPTIONS = QuantizeOptions(method="dynamic", data="synthetic", calibration_images=32, guard_images=256,
                          speed_seconds=0.2)


def embed(path, images, keep_idx) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(["embedding"], {"pixel_values": images.numpy(), "keep_idx": keep_idx.numpy()})[0]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_quantize_int8_writes_a_guarded_graph_chosen_by_measurement(exported, tmp_path):
    _, checkpoint, _ = exported
    out = tmp_path / "bundle"
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(out), "--quantize", "int8", *SMALL]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["encoder.safetensors", "model.int8.onnx", "model.onnx",
                                                     "msn.json"]
    meta = json.loads((out / "msn.json").read_text())
    int8, guard = meta["int8"], meta["int8"]["guard"]
    assert int8["file"] == "model.int8.onnx" and guard["passed"] and not guard["failures"]
    candidates = int8["speed"]["candidates"]
    assert sorted(candidates) == ["dynamic", "qdq", "static"]  # auto: each measured, the fastest that passed kept
    passed = [m for m, c in candidates.items() if c["passed"]]
    served = {m: max(c["images_per_s"], c.get("openvino_images_per_s", 0.0)) for m, c in candidates.items()}
    assert int8["method"] == max(passed, key=served.get)  # ORT, or OpenVINO for the QDQ graph
    assert guard["cosine"]["min"] >= 0.99 and guard["cosine_masked"]["min"] >= 0.99
    assert sorted(guard["lowshot"]) == ["1imgs_class", "2imgs_class", "5imgs_class"]
    assert all(abs(v["gap"]) <= 1.0 for v in guard["lowshot"].values())
    assert guard["data"]["source"] == "synthetic" and guard["data"]["heldout_split"] == "test split"
    # The int8 graph keeps the bundle's contract: dynamic B and K, -1 padding.
    images, keep = random_inputs(3, NUM_PATCHES, seed=7)
    keep[1, 10:] = -1
    a, b = embed(out / "model.onnx", images, keep), embed(out / "model.int8.onnx", images, keep)
    assert b.shape == a.shape and cosines(a, b).min() >= 0.99
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_model_int8_cannot_represent_is_refused_and_nothing_is_written(exported, tmp_path):
    _, _, bundle = exported
    target = tmp_path / "bundle"
    shutil.copytree(bundle, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    encoder = tiny_encoder(seed=2)
    with torch.no_grad():  # one huge input weight per output channel: per-channel int8 zeroes all the others
        for block in encoder.blocks:
            block.mlp.fc1.weight[:, 0] = 30.0
            block.attn.qkv.weight[:, 0] = 30.0
    with pytest.raises(export.ExportError, match=r"int8 graph refused.*cosine to fp32 is 0\.\d+ .*< 0\.99"):
        export.export_bundle(encoder, target, arch="vit_tiny", preprocessing=PREPROCESSING, quantize=OPTIONS)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_bundle_flag_adds_int8_in_place_without_touching_the_rest(exported, tmp_path, capsys):
    _, _, bundle = exported
    target = tmp_path / "bundle"
    shutil.copytree(bundle, target)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in target.iterdir() if p.name != "msn.json"}
    assert export.main(["--bundle", str(target), "--quantize", "int8", "--quantize-method", "static",
                        *SMALL]) == 0
    assert "added model.int8.onnx" in capsys.readouterr().out
    meta = json.loads((target / "msn.json").read_text())
    assert meta["int8"]["method"] == "static" and list(meta["int8"]["speed"]["candidates"]) == ["static"]
    assert {n: hashlib.sha256((target / n).read_bytes()).hexdigest() for n in digest} == digest
    before = json.loads((bundle / "msn.json").read_text())
    assert {k: v for k, v in meta.items() if k != "int8"} == before


def test_quantize_errors_are_clear(exported, tmp_path, capsys):
    _, _, bundle = exported
    with pytest.raises(SystemExit) as e:
        export.main(["--bundle", str(bundle)])
    assert e.value.code != 0 and "--quantize int8" in capsys.readouterr().err
    # A source that records no training data needs --calibration-data; nothing is written.
    with pytest.raises(export.ExportError, match="--calibration-data"):
        export.export_bundle(tiny_encoder(), tmp_path / "b", arch="vit_tiny", preprocessing=PREPROCESSING,
                             quantize=QuantizeOptions())
    assert not list(tmp_path.iterdir())
