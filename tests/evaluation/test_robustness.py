import numpy as np
import pytest
import torch

from training.evaluation.features import extract_features
from training.evaluation.lowshot import summarize
from training.evaluation.robustness import cosine_similarities, masked_lowshot, similarity_by_ratio

PREPROCESSING = {"resize": 8, "crop": 8, "mean": [0.5] * 3, "std": [0.25] * 3}


class Images(torch.utils.data.Dataset):
    """8x8 images (2x2 patches of 4 px); ``constant`` makes every patch identical."""

    load_size = 8

    def __init__(self, n: int, constant: bool) -> None:
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, size=(n, 3, 8, 8), dtype=np.uint8)
        if constant:
            images[:] = rng.integers(0, 256, size=(n, 3, 1, 1), dtype=np.uint8)
        self.images, self.labels = images, np.arange(n) % 2

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.images[i]), int(self.labels[i]), 0


class PatchMean:
    """Mean over kept 4x4 patches of the per-patch pixel vectors: a toy encoder that sees only kept patches."""

    backend, feature, patch_size = "toy", "toy", 4

    def __init__(self, ignore_mask: bool = False) -> None:
        self.ignore_mask = ignore_mask

    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        b = len(pixel_values)
        patches = pixel_values.reshape(b, 3, 2, 4, 2, 4).transpose(0, 2, 4, 1, 3, 5).reshape(b, 4, -1)
        if self.ignore_mask:
            keep_idx = np.broadcast_to(np.arange(4), (b, 4))
        return np.take_along_axis(patches, keep_idx[:, :, None], axis=1).mean(axis=1) + 1.0


def similarities(dataset, embedder, ratios=(0.3, 0.5, 0.8)):
    def embed(ratio):
        return extract_features(dataset, embedder, preprocessing=PREPROCESSING, mask_ratio=ratio, mask_seed=1,
                                batch_size=5, progress=False).features

    return similarity_by_ratio(embed, ratios)


def test_mask_invariant_encoder_gives_one():
    for value in similarities(Images(12, constant=False), PatchMean(ignore_mask=True)).values():
        assert value == pytest.approx(1.0)


def test_constant_images_give_one_under_masking():
    for value in similarities(Images(12, constant=True), PatchMean()).values():
        assert value == pytest.approx(1.0)


def test_masking_lowers_similarity_of_a_patch_sensitive_encoder():
    sims = similarities(Images(12, constant=False), PatchMean())
    assert 1.0 > sims[0.3] > sims[0.8]  # 4 patches: 0.3 keeps 2, 0.8 keeps 1 (num_kept = floor(N(1-r)))


def test_cosine_similarity_values():
    a = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    b = np.array([[-3.0, 0.0], [5.0, 0.0], [2.0, 2.0]])
    np.testing.assert_allclose(cosine_similarities(a, b), [-1.0, 0.0, 1.0])
    with pytest.raises(ValueError):
        cosine_similarities(a, b[:2])


def test_masked_lowshot_uses_masked_train_and_clean_test():
    rng = np.random.default_rng(0)
    labels = np.arange(40) % 4
    clean = np.eye(4)[labels] * 3 + rng.normal(size=(40, 4)) * 0.1
    noisy = rng.normal(size=(40, 4))
    subsets = {"5imgs_class": [np.arange(20)]}
    results = masked_lowshot({0.0: clean, 0.9: noisy}, labels, clean, labels, subsets)
    assert results[0.0][0].mean == pytest.approx(100.0)
    assert results[0.9][0].mean < 60.0
    assert results[0.0][0].accuracies == summarize(clean, labels, clean, labels, subsets)[0].accuracies
