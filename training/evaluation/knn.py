"""Weighted k-nearest-neighbour classification on frozen features, as DINO's ``eval_knn.py``: implemented in
:mod:`msn_core.knn` (the pretraining probe scores with it too); this is the evaluation package's name for it."""

from __future__ import annotations

from msn_core.knn import DEFAULT_K, DEFAULT_TEMPERATURE, knn_accuracy, knn_predict, l2_normalize

__all__ = ["DEFAULT_K", "DEFAULT_TEMPERATURE", "knn_accuracy", "knn_predict", "l2_normalize"]
