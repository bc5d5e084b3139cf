"""msn-export: bundle contents, ONNX Runtime parity with dynamic B/K and padding, atomicity, imports, CLI errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from training.bundle import export, files, onnx_graph
from training.bundle.convert import kwargs_to_hf_config, ours_to_hf, ours_to_official
from training.checkpoint import file_sha256
from training.model import vit
from training.model.heads import ProjectionHead
from training.model.load import load_encoder
from training.model.vit import VisionTransformer, build_encoder, encoder_kwargs

IMAGE, PATCH, DIM = 32, 4, 64
NUM_PATCHES = (IMAGE // PATCH) ** 2
PREPROCESSING = {"resize": 37, "crop": 32, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "channels": 3}


def tiny_encoder(seed: int = 0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    kwargs = {
        "image_size": IMAGE,
        "patch_size": PATCH,
        "embed_dim": DIM,
        "depth": 2,
        "num_heads": 4,
        **overrides,
    }
    return VisionTransformer(**kwargs).eval()


def random_inputs(batch: int, keep: int, seed: int, image: int = IMAGE, num_patches: int = NUM_PATCHES):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image, image, generator=generator)
    keep_idx = torch.stack([torch.randperm(num_patches, generator=generator)[:keep] for _ in range(batch)])
    return images, keep_idx


def run_onnx(bundle: Path, images, keep_idx) -> np.ndarray:
    """The graph as a client runs it: two inputs, -1 padding in keep_idx."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return session.run(["embedding"], {"pixel_values": images.numpy(), "keep_idx": keep_idx.numpy()})[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A training checkpoint in the lead's format, exported through the CLI: (encoder, checkpoint, bundle)."""
    root = tmp_path_factory.mktemp("export")
    encoder = tiny_encoder()
    checkpoint = root / "checkpoint.pt"
    torch.save({
        "target_encoder": encoder.state_dict(), "encoder_kwargs": encoder_kwargs(encoder), "arch": "vit_tiny",
        "preprocessing": PREPROCESSING, "config": {"optim": {"epochs": 3}}, "step": 120, "epoch": 3,
        "encoder": tiny_encoder(seed=1).state_dict(),  # the online encoder must not be the one exported
    }, checkpoint)  # fmt: skip
    bundle = root / "bundles" / "demo"
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(bundle)]) == 0
    return encoder, checkpoint, bundle


def test_bundle_holds_exactly_the_contract(exported):
    _, checkpoint, bundle = exported
    assert sorted(p.name for p in bundle.iterdir()) == ["encoder.safetensors", "model.onnx", "msn.json"]
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]  # no staging leftovers
    meta = json.loads((bundle / "msn.json").read_text())
    assert meta["format_version"] == 2
    assert meta["model_id"].startswith("msn-tiny4-") and len(meta["model_id"]) == len("msn-tiny4-") + 12
    assert meta["architecture"] == {"name": "vit_tiny", "image_size": IMAGE, "patch_size": PATCH, "in_chans": 3,
                                    "embed_dim": DIM, "depth": 2, "num_heads": 4, "mlp_ratio": 4.0}  # fmt: skip
    assert meta["preprocessing"] == {**PREPROCESSING, "interpolation": "bicubic"}
    assert meta["feature"] == "cls_pre_norm"
    assert meta["onnx"]["opset"] == 18 and meta["onnx"]["external_data"] is None
    assert meta["onnx"]["inputs"] == [
        {"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, IMAGE, IMAGE]},
        {"name": "keep_idx", "dtype": "int64", "shape": ["batch", "num_keep"]},
    ]
    assert meta["onnx"]["outputs"] == [{"name": "embedding", "dtype": "float32", "shape": ["batch", DIM]}]
    assert meta["source"] == {"kind": "training", "path": "checkpoint.pt",
                              "sha256": file_sha256(checkpoint)}  # fmt: skip
    assert meta["training"] == {"step": 120, "epoch": 3, "config": {"optim": {"epochs": 3}}}
    diffs = meta["parity"]["max_abs_diff"]
    assert set(diffs) == {"keep_all", "keep_30pct", "padded_mixed"} and max(diffs.values()) <= 1e-4
    assert meta["weights"]["sha256"] == file_sha256(bundle / "encoder.safetensors")
    assert meta["model_id"].endswith(files.weights_digest(exported[0].state_dict())[:12])


def test_model_id_depends_on_the_weights_not_on_the_file_bytes(exported, tmp_path):
    """safetensors orders its metadata differently from process to process; the model id must not follow."""
    from safetensors.torch import load_file, save_file

    _, _, bundle = exported
    state = load_file(bundle / "encoder.safetensors")
    save_file(state, str(tmp_path / "a.safetensors"), metadata={"x": "1", "y": "2"})
    save_file(state, str(tmp_path / "b.safetensors"), metadata={"y": "2", "x": "1", "z": "3"})
    assert file_sha256(tmp_path / "a.safetensors") != file_sha256(tmp_path / "b.safetensors")
    assert files.weights_digest(load_file(tmp_path / "a.safetensors")) == files.weights_digest(state)
    changed = {**state, "cls_token": state["cls_token"] + 1e-6}
    assert files.weights_digest(changed) != files.weights_digest(state)


@pytest.mark.parametrize(("batch", "keep"), [(1, NUM_PATCHES), (5, NUM_PATCHES), (5, 19), (1, 1)])
def test_onnx_matches_torch_for_dynamic_batch_and_keep(exported, batch, keep):
    encoder, _, bundle = exported
    images, keep_idx = random_inputs(batch, keep, seed=batch * 100 + keep)
    with torch.no_grad():
        expected = encoder(images, keep_idx)[0].numpy()
    got = run_onnx(bundle, images, keep_idx)
    assert got.shape == (batch, DIM)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_onnx_padded_mixed_keep_batch_equals_unpadded(exported):
    encoder, _, bundle = exported
    images, keep_idx = random_inputs(3, NUM_PATCHES, seed=7)
    counts = [NUM_PATCHES, 19, 4]
    padded = keep_idx.clone()
    for row, count in enumerate(counts):
        padded[row, count:] = -1
    got = run_onnx(bundle, images, padded)
    for row, count in enumerate(counts):
        with torch.no_grad():
            solo = encoder(images[row : row + 1], keep_idx[row : row + 1, :count])[0].numpy()
        np.testing.assert_allclose(got[row : row + 1], solo, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(got[row : row + 1], run_onnx(bundle, images[row : row + 1],
                                                                   keep_idx[row : row + 1, :count]))
    assert np.abs(run_onnx(bundle, images, keep_idx)[2] - got[2]).max() > 1e-3


def test_load_encoder_gives_the_exported_torch_encoder(exported):
    encoder, _, bundle = exported
    loaded, info = load_encoder(bundle)
    assert info.embed_dim == DIM and info.format_version == 2 and not loaded.training
    images = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images)[0], encoder(images)[0], atol=0, rtol=0)


def test_failed_parity_leaves_existing_bundle_untouched(exported, tmp_path, monkeypatch):
    _, _, bundle = exported
    target = tmp_path / "bundle"
    shutil.copytree(bundle, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real_run = onnx_graph.run_onnx
    monkeypatch.setattr(onnx_graph, "run_onnx", lambda path, inputs: real_run(path, inputs) + 1e-3)
    with pytest.raises(export.ExportError, match="differs from torch by more than 0.0001"):
        export.export_bundle(tiny_encoder(seed=5), target, arch="vit_tiny", preprocessing=PREPROCESSING)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # staging directory removed


def test_refuses_to_replace_a_directory_that_is_not_a_bundle(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(export.ExportError, match="not an MSN bundle"):
        export.export_bundle(tiny_encoder(), tmp_path, arch="vit_tiny", preprocessing=PREPROCESSING)
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_from_official_checkpoint_gives_identical_features(exported, tmp_path, monkeypatch):
    _, _, existing = exported
    monkeypatch.setitem(vit.ARCHS, "vit_tiny", (DIM, 2, 4))  # a 2-block "deit_tiny" keeps the export fast
    torch.manual_seed(3)
    encoder = build_encoder("vit_tiny", 16, 32).eval()  # patch 16 as deit_tiny; 32 px -> 2x2 patches
    head = ProjectionHead(DIM, hidden_dim=32, out_dim=16).state_dict()
    path = tmp_path / "msn_deit_tiny.pth.tar"
    torch.save({"target_encoder": ours_to_official(encoder.state_dict(), head),
                "prototypes": torch.randn(8, 16)}, path)  # fmt: skip
    out = tmp_path / "official"
    shutil.copytree(existing, out)  # an older bundle there gets replaced
    assert export.main(["--from-official", str(path), "--arch", "deit_tiny", "--out", str(out),
                        "--image-size", "32"]) == 0  # fmt: skip
    loaded, info = load_encoder(out)
    assert info.extra["source"]["kind"] == "official" and info.architecture.name == "vit_tiny"
    assert info.preprocessing.crop == 32 and info.preprocessing.resize == round(32 * 256 / 224)
    images, keep_idx = random_inputs(2, 4, seed=11, num_patches=4)
    with torch.no_grad():
        expected = encoder(images)[0]
        torch.testing.assert_close(loaded(images)[0], expected, atol=0, rtol=0)
    np.testing.assert_allclose(
        run_onnx(out, images, keep_idx), expected.numpy(), atol=1e-4, rtol=0
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_from_hf_directory_gives_identical_features(tmp_path):
    encoder = tiny_encoder(seed=4)
    hf_dir = tmp_path / "vit-msn-tiny"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(kwargs_to_hf_config(encoder_kwargs(encoder))))
    save_file(ours_to_hf(encoder.state_dict()), str(hf_dir / "model.safetensors"))
    out = tmp_path / "hf"
    assert export.main(["--from-hf", str(hf_dir), "--out", str(out), "--feature", "cls_post_norm"]) == 0
    loaded, info = load_encoder(out)
    assert info.extra["source"]["kind"] == "hf" and info.feature == "cls_post_norm"
    images, keep_idx = random_inputs(2, NUM_PATCHES, seed=12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images)[0], encoder(images)[0], atol=0, rtol=0)
        expected = encoder(images, keep_idx)[1].numpy()  # post-norm feature
    np.testing.assert_allclose(run_onnx(out, images, keep_idx), expected, atol=1e-4, rtol=0)


def cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as excinfo:
        export.main(argv)
    message = str(excinfo.value.code) if isinstance(excinfo.value.code, str) else capsys.readouterr().err
    assert excinfo.value.code != 0 and "Traceback" not in message
    return message


def test_cli_errors_are_clear(capsys, tmp_path, exported):
    _, checkpoint, _ = exported
    out = str(tmp_path / "out")
    assert "checkpoint not found" in cli_error(
        capsys, ["--checkpoint", str(tmp_path / "nope.pt"), "--out", out]
    )
    assert "deit_small" in cli_error(capsys, ["--from-official", str(checkpoint), "--arch", "deit_gigantic",
                                              "--out", out])  # fmt: skip
    assert "--arch" in cli_error(capsys, ["--from-official", str(checkpoint), "--out", out])
    missing = cli_error(
        capsys, ["--from-official", str(tmp_path / "x.pth.tar"), "--arch", "deit_small", "--out", out]
    )
    assert "official checkpoint not found" in missing
    mismatch = cli_error(capsys, ["--from-official", str(checkpoint), "--arch", "deit_small", "--out", out])
    assert "2 blocks, the encoder expects 12" in mismatch  # our 2-block checkpoint is not deit_small
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert "junk.pt" in cli_error(capsys, ["--checkpoint", str(tmp_path / "junk.pt"), "--out", out])
    assert "config.json" in cli_error(capsys, ["--from-hf", str(tmp_path), "--out", out])
    assert not (tmp_path / "out").exists()
