import numpy as np
import pytest

from msn_core.bundle import load_bundle_info
from training.data import SyntheticDataset
from training.evaluation.features import (
    OnnxEmbedder,
    TorchEmbedder,
    bundle_fingerprint,
    dataset_identity,
    extract_features,
    keep_indices,
    load_embedder,
)


@pytest.fixture(scope="module")
def dataset():
    return SyntheticDataset(12, num_classes=3, load_size=16)


@pytest.mark.parametrize("mask_ratio", [0.0, 0.5])
def test_onnx_and_torch_give_the_same_features(tiny_bundle, dataset, mask_ratio):
    pre = load_bundle_info(tiny_bundle).preprocessing
    onnx = extract_features(dataset, OnnxEmbedder(tiny_bundle), preprocessing=pre, mask_ratio=mask_ratio,
                            batch_size=5, progress=False)
    torch_ = extract_features(dataset, TorchEmbedder.from_bundle(tiny_bundle), preprocessing=pre,
                              mask_ratio=mask_ratio, batch_size=5, progress=False)
    assert onnx.features.shape == (12, 32)
    np.testing.assert_allclose(onnx.features, torch_.features, atol=1e-4)
    np.testing.assert_array_equal(onnx.labels, dataset.labels)


def test_feature_choice(tiny_bundle, dataset):
    pre = load_bundle_info(tiny_bundle).preprocessing
    post = extract_features(dataset, load_embedder(tiny_bundle, "torch", feature="cls_post_norm"),
                            preprocessing=pre, progress=False).features
    pre_norm = extract_features(dataset, load_embedder(tiny_bundle, "torch"), preprocessing=pre,
                                progress=False).features
    assert not np.allclose(post, pre_norm)
    np.testing.assert_allclose(post.mean(axis=1), 0.0, atol=1e-4)  # LayerNorm output (default affine init)
    with pytest.raises(ValueError, match="torch backend"):
        OnnxEmbedder(tiny_bundle, feature="cls_post_norm")
    assert load_embedder(tiny_bundle, "pixels")(np.ones((2, 3, 4, 4), np.float32), None).shape == (2, 48)


def test_masks_depend_only_on_seed_and_index():
    a = keep_indices(np.array([4, 9]), 16, 0.5, seed=3)
    assert a.shape == (2, 8) and np.all(np.diff(a, axis=1) > 0)
    np.testing.assert_array_equal(a[1:], keep_indices(np.array([9]), 16, 0.5, seed=3))
    assert not np.array_equal(a, keep_indices(np.array([4, 9]), 16, 0.5, seed=4))
    np.testing.assert_array_equal(keep_indices(np.array([1]), 16, 0.0, seed=0), [np.arange(16)])


def test_masked_features_do_not_depend_on_batch_size(tiny_bundle, dataset):
    embedder, pre = OnnxEmbedder(tiny_bundle), load_bundle_info(tiny_bundle).preprocessing
    runs = [extract_features(dataset, embedder, preprocessing=pre, mask_ratio=0.7, batch_size=b,
                             progress=False).features for b in (3, 12)]
    np.testing.assert_allclose(runs[0], runs[1], atol=1e-5)


class Counting:
    """Wraps an embedder and counts the images it embeds."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.backend, self.feature, self.patch_size = inner.backend, inner.feature, inner.patch_size

    def __call__(self, pixel_values, keep_idx):
        self.calls += len(pixel_values)
        return self.inner(pixel_values, keep_idx)


def test_cache_hit_and_miss(tiny_bundle, dataset, tmp_path):
    embedder = Counting(OnnxEmbedder(tiny_bundle))
    pre = load_bundle_info(tiny_bundle).preprocessing.to_dict()
    tag = bundle_fingerprint(tiny_bundle)

    def run(**kwargs):
        options = {"preprocessing": pre, "cache_dir": tmp_path, "cache_tag": tag, "progress": False, **kwargs}
        return extract_features(dataset, embedder, **options)

    first = run(indices=[0, 2, 4])
    assert not first.from_cache and embedder.calls == 3
    second = run(indices=[0, 2, 4], batch_size=1)  # batch size is not part of the key
    assert second.from_cache and embedder.calls == 3
    np.testing.assert_array_equal(first.features, second.features)
    np.testing.assert_array_equal(second.indices, [0, 2, 4])
    for changed in ({"indices": [0, 2]}, {"indices": [0, 2, 4], "mask_ratio": 0.5},
                    {"indices": [0, 2, 4], "mask_ratio": 0.5, "mask_seed": 1},
                    {"indices": [0, 2, 4], "preprocessing": {**pre, "mean": [0.5] * 3}},
                    {"indices": [0, 2, 4], "cache_tag": "other-weights"}):
        before = embedder.calls
        assert not run(**changed).from_cache and embedder.calls > before, changed
    assert len(list(tmp_path.glob("features-*.npz"))) == 6
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_identities_distinguish_data_and_weights(tiny_bundle, dataset, tmp_path):
    assert dataset_identity(dataset) == dataset_identity(SyntheticDataset(12, num_classes=3, load_size=16))
    assert dataset_identity(dataset) != dataset_identity(SyntheticDataset(12, num_classes=3, load_size=16, seed=1))
    copy = tmp_path / "bundle"
    copy.mkdir()
    for f in tiny_bundle.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert bundle_fingerprint(copy) == bundle_fingerprint(tiny_bundle)
    (copy / "encoder.safetensors").write_bytes(b"changed")
    assert bundle_fingerprint(copy) != bundle_fingerprint(tiny_bundle)
