"""Low-shot evaluation with the protocol of the official ``logistic_eval.py``.

Frozen trunk features (one resize + centre crop per image, the pre-norm CLS by default) go to the low-shot classifier
of :mod:`msn_core.lowshot` (row centring + L2, cyanure multinomial logistic regression with ``lambd / n``, the
default lambda), the same one the service fits. This module adds the evaluation around it: accuracy over seeded
splits and lambda sweeps, and scikit-learn's ``LogisticRegression`` with ``C = 1 / (lambda_1 n)`` (the same
problem) as a cross-check of the solver.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from msn_core.lowshot import DEFAULT_LAMBD, LinearClassifier, center_and_normalize
from msn_core.lowshot import fit_logistic as fit_cyanure
from msn_core.optional import require

__all__ = [
    "DEFAULT_LAMBD",
    "LAMBD_SWEEP",
    "LinearClassifier",
    "LowShotResult",
    "fit_logistic",
    "lowshot_accuracy",
    "summarize",
]

LAMBD_SWEEP: tuple[float, ...] = (2.5e-5, 0.00025, 0.0025, 0.025, 0.25)


def fit_logistic(features: np.ndarray, labels: np.ndarray, *, lambd: float = DEFAULT_LAMBD,
                 solver: str = "cyanure", max_iter: int = 300, tol: float = 1e-3, n_threads: int = 1,
                 seed: int = 0) -> LinearClassifier:
    """Fit the official low-shot classifier on raw features (preprocessed here); ``lambd`` is divided by n.

    ``solver`` is ``"cyanure"`` (the paper's, :func:`msn_core.lowshot.fit_logistic`) or ``"sklearn"`` (lbfgs on
    the identical objective).
    """
    if solver == "cyanure":
        return fit_cyanure(features, labels, lambd=lambd, max_iter=max_iter, tol=tol, n_threads=n_threads,
                           seed=seed)
    if solver != "sklearn":
        raise ValueError(f"unknown solver {solver!r}; expected 'cyanure' or 'sklearn'")
    LogisticRegression = require("sklearn.linear_model", "the sklearn solver").LogisticRegression

    x, y = center_and_normalize(features), np.asarray(labels).astype(np.int64)
    if len(np.unique(y)) < 2:
        raise ValueError("low-shot classification needs at least two classes")
    start = time.perf_counter()
    clf = LogisticRegression(C=1.0 / lambd, fit_intercept=False, max_iter=max(max_iter, 1000), tol=1e-6)
    clf.fit(x, y)
    coef = clf.coef_.T.astype(np.float64)
    if coef.shape[1] == 1:  # scikit-learn keeps one weight vector (for classes_[1]) in the binary case
        coef = np.concatenate([-coef / 2, coef / 2], axis=1)
    return LinearClassifier(coef, clf.classes_, time.perf_counter() - start)


def lowshot_accuracy(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                     test_labels: np.ndarray, *, lambd: float = DEFAULT_LAMBD, solver: str = "cyanure") -> float:
    """Top-1 accuracy (in %) on the test set of the classifier fitted on the labelled subset."""
    model = fit_logistic(train_features, train_labels, lambd=lambd, solver=solver)
    return 100.0 * model.accuracy(test_features, test_labels)


@dataclass
class LowShotResult:
    """Accuracies (%) of one setting (e.g. 5 images per class) over the splits; ``std`` is the sample std."""

    setting: str
    lambd: float
    accuracies: list[float]
    fit_seconds: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return float(np.mean(self.accuracies))

    @property
    def std(self) -> float:
        return float(np.std(self.accuracies, ddof=1)) if len(self.accuracies) > 1 else 0.0

    def as_dict(self) -> dict:
        return {"setting": self.setting, "lambd": self.lambd, "accuracies": self.accuracies,
                "mean": self.mean, "std": self.std, "fit_seconds": self.fit_seconds}


def summarize(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
              test_labels: np.ndarray, subsets: Mapping[str, Sequence[np.ndarray]], *,
              lambdas: Sequence[float] = (DEFAULT_LAMBD,), solver: str = "cyanure",
              **solver_options) -> list[LowShotResult]:
    """Low-shot accuracy for each setting (``{"1imgs_class": [split1_idx, ...], ...}``) and each ``lambd``.

    Subset indices index the rows of ``train_features`` / ``train_labels``; ``solver_options`` (``max_iter``,
    ``tol``) go to :func:`fit_logistic`.
    """
    results = []
    for setting, splits in subsets.items():
        for lambd in lambdas:
            result = LowShotResult(setting, lambd, [])
            for idx in splits:
                model = fit_logistic(train_features[idx], train_labels[idx], lambd=lambd, solver=solver,
                                     **solver_options)
                result.accuracies.append(100.0 * model.accuracy(test_features, test_labels))
                result.fit_seconds.append(model.fit_seconds)
            results.append(result)
    return results
