"""visualizer.measures: each figure on cases whose answer is known (real Fashion-MNIST images where a judge is)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import uniform_filter

from training.data import FashionMNIST
from visualizer.measures import PixelJudge, kid, recall_at, reencoded_ranks, sharpness_ratio, spread, wilson


def test_ranks_put_a_copy_first_and_a_neighbour_behind():
    rng = np.random.default_rng(0)
    gallery = rng.normal(size=(100, 16))
    ranks = reencoded_ranks(gallery[[3, 7]], np.array([3, 7]), gallery)
    assert ranks.tolist() == [1, 1]
    moved = reencoded_ranks(gallery[[5]], np.array([3]), gallery)  # a sample that looks like image 5, not 3
    assert moved[0] > 1 and recall_at(np.array([1, 5, 20]), 10) == pytest.approx(2 / 3)


def test_wilson_interval():
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-3) and high == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


def test_pixel_judge_tells_fashion_mnist_classes():
    train, test = FashionMNIST(split="train"), FashionMNIST(split="test")
    judge = PixelJudge(train.images[:6000], train.labels[:6000])
    accuracy = np.mean(judge.predict(test.images[:500]) == test.labels[:500])
    assert 0.7 < accuracy < 0.95  # kNN on raw pixels: well above chance, below a learned feature


def test_blur_lowers_sharpness_and_kid_sees_a_shift():
    images = FashionMNIST(split="test").images[:64].astype(np.float64)
    blurred = np.stack([uniform_filter(im, 3) for im in images])
    assert sharpness_ratio(images, images) == pytest.approx(1.0)
    assert sharpness_ratio(blurred, images) < 0.5
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(400, 8)), rng.normal(size=(400, 8))
    assert abs(kid(a, b, subsets=5)) < 0.05 < kid(a + 1.0, b, subsets=5)
    assert spread(np.stack([images[0]] * 3)) == 0.0 < spread(images[:3])
