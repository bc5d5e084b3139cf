"""Frozen features read out of the encoder: widths, agreement with the CLS forward, and what masking does."""
from __future__ import annotations

import pytest
import torch

from msn_core.features import FeatureError, feature_dim, parse_feature
from training.model.readout import feature_spec, read_feature
from training.model.vit import VisionTransformer

FEATURES = ("cls_pre_norm", "cls_post_norm", "cls_last2", "patch_tokens", "patch_grid2", "patch_grid1",
            "cls_patch_tokens")


@pytest.fixture(scope="module")
def encoder() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(image_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2).eval()


@pytest.mark.parametrize("name", FEATURES)
def test_width_matches_the_core(encoder, name):
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = read_feature(encoder, feature_spec(encoder, name), images)
    assert out.shape == (2, feature_dim(name, embed_dim=32, depth=3, grid=4))


def test_cls_features_are_the_forward_outputs(encoder):
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        pre, post = encoder(images)
        assert torch.equal(read_feature(encoder, parse_feature("cls_pre_norm"), images), pre)
        assert torch.equal(read_feature(encoder, parse_feature("cls_post_norm"), images), post)
        last2 = read_feature(encoder, parse_feature("cls_last2"), images)
    assert torch.allclose(last2[:, 32:], post)


def test_cls_patch_tokens_is_the_scaled_cls_then_the_map(encoder):
    images = torch.randn(2, 3, 16, 16)
    keep = torch.tensor([[0, 5, 6, 15], [1, 2, -1, -1]])
    with torch.no_grad():
        both = read_feature(encoder, parse_feature("cls_patch_tokens"), images, keep, keep >= 0)
        post = read_feature(encoder, parse_feature("cls_post_norm"), images, keep, keep >= 0)
        tokens = read_feature(encoder, parse_feature("patch_tokens"), images, keep, keep >= 0)
    assert torch.allclose(both[:, :32], 4.0 * post, atol=1e-5)  # sqrt(16 patches)
    assert torch.equal(both[:, 32:], tokens)  # dropped patches stay zero


def test_a_dropped_patch_is_zero_on_the_map_and_padding_changes_nothing(encoder):
    images = torch.randn(2, 3, 16, 16)
    keep = torch.tensor([[0, 5, 6, 15], [1, 2, -1, -1]])
    keep_mask = keep >= 0
    spec = parse_feature("patch_tokens")
    with torch.no_grad():
        full = read_feature(encoder, spec, images, keep, keep_mask).reshape(2, 16, 32)
        alone = read_feature(encoder, spec, images[1:], keep[1:, :2]).reshape(1, 16, 32)
    kept0 = {0, 5, 6, 15}
    for p in range(16):
        assert bool(full[0, p].abs().sum() > 0) == (p in kept0)
    assert torch.allclose(full[1], alone[0], atol=1e-5)  # padding is not seen by any token


def test_pooling_averages_only_kept_patches(encoder):
    images = torch.randn(1, 3, 16, 16)
    keep = torch.tensor([[0, 1, 4]])  # three of the four patches of the top-left 2x2 cell
    with torch.no_grad():
        tokens = read_feature(encoder, parse_feature("patch_tokens"), images, keep).reshape(16, 32)
        pooled = read_feature(encoder, parse_feature("patch_grid2"), images, keep).reshape(4, 32)
    assert torch.allclose(pooled[0], tokens[[0, 1, 4]].mean(0), atol=1e-6)
    assert torch.count_nonzero(pooled[1:]) == 0


def test_names_that_do_not_fit_are_refused(encoder):
    with pytest.raises(FeatureError, match="3 blocks"):
        feature_spec(encoder, "cls_last4")
    with pytest.raises(FeatureError, match="does not divide"):
        feature_spec(encoder, "patch_grid3")
    with pytest.raises(FeatureError, match="expected one of"):
        parse_feature("mean_pool")


@pytest.mark.parametrize("name", ["patch_grid2", "cls_last2"])
def test_exported_graph_computes_the_feature_with_masks_and_padding(tmp_path, name):
    import numpy as np
    import onnxruntime as ort

    from msn_core.bundle import load_bundle_info
    from training.bundle.export import export_bundle

    torch.manual_seed(1)
    enc = VisionTransformer(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2).eval()
    pre = {"resize": 16, "crop": 16, "mean": [0.5] * 3, "std": [0.25] * 3, "channels": 3}
    export_bundle(enc, tmp_path / "b", arch="vit_tiny", preprocessing=pre, feature=name)  # its own parity check
    info = load_bundle_info(tmp_path / "b")
    assert info.feature == name and info.embed_dim == feature_dim(name, embed_dim=32, depth=2, grid=4)
    assert info.model_dim == 32
    images = torch.randn(2, 3, 16, 16)
    keep = torch.tensor([[0, 1, 2, 3, 4, 5], [10, 11, 14, 15, -1, -1]])  # row 1 sees only the bottom-right cell
    session = ort.InferenceSession(str(tmp_path / "b" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["embedding"], {"pixel_values": images.numpy(), "keep_idx": keep.numpy()})[0]
    with torch.no_grad():
        want = read_feature(enc, parse_feature(name), images, keep, keep >= 0).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    if name == "patch_grid2":
        cells = got.reshape(2, 4, 32)
        assert np.count_nonzero(cells[1, :3]) == 0 and np.count_nonzero(cells[1, 3]) > 0
