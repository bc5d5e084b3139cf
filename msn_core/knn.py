"""Weighted k-nearest-neighbour classification on frozen features, as DINO's ``eval_knn.py``.

Features are L2-normalised, the k most cosine-similar training samples vote for their class with weight
``exp(similarity / T)`` (T = 0.07), and the class with the largest total vote wins.

Here in the core (numpy only) because two packages score with it: ``msn-eval knn`` (``training.evaluation``) and
the kNN probe during pretraining (``training.run.probe``), which must not import each other.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DEFAULT_K", "DEFAULT_TEMPERATURE", "knn_accuracy", "knn_predict", "l2_normalize"]

DEFAULT_K = 20
DEFAULT_TEMPERATURE = 0.07


def l2_normalize(features: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (C-contiguous float32 copy)."""
    x = np.array(features, dtype=np.float32, order="C", copy=True)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


def knn_predict(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray, *,
                k: int = DEFAULT_K, temperature: float = DEFAULT_TEMPERATURE, chunk_size: int = 512) -> np.ndarray:
    """Predicted labels of the test samples; ties in the vote go to the smaller class index."""
    train = l2_normalize(train_features)
    test = l2_normalize(test_features)
    classes, train_y = np.unique(np.asarray(train_labels), return_inverse=True)
    k = min(k, len(train))
    if k < 1 or temperature <= 0:
        raise ValueError(f"need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    predictions = np.empty(len(test), dtype=np.int64)
    for start in range(0, len(test), chunk_size):
        sims = test[start:start + chunk_size] @ train.T  # (c, n)
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        top_sims = np.take_along_axis(sims, top, axis=1)
        weights = np.exp(top_sims / temperature)
        votes = np.zeros((len(top), len(classes)), dtype=np.float64)
        np.add.at(votes, (np.arange(len(top))[:, None], train_y[top]), weights)
        predictions[start:start + len(top)] = np.argmax(votes, axis=1)
    return classes[predictions]


def knn_accuracy(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                 test_labels: np.ndarray, *, k: int = DEFAULT_K, temperature: float = DEFAULT_TEMPERATURE) -> float:
    """Top-1 accuracy in %."""
    predictions = knn_predict(train_features, train_labels, test_features, k=k, temperature=temperature)
    return 100.0 * float(np.mean(predictions == np.asarray(test_labels)))
