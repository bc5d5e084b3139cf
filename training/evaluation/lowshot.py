"""Low-shot evaluation with the protocol of the official ``logistic_eval.py``.

Frozen trunk features (one resize + centre crop per image, the pre-norm CLS by default) are centred and L2-normalised
row by row, then an L2-regularised multinomial logistic regression without intercept is fitted with cyanure, with
``lambda_1 = lambd / n`` as the official ``lambd /= len(embs)``. The official code ran cyanure 0.22's
``MultiClassifier.fit(lambd=...)``; cyanure 1.2's ``Classifier(lambda_1=...)`` minimises the same objective
``(1/n) sum_i L(y_i, W^T x_i) + lambda_1/2 ||W||^2``. scikit-learn's ``LogisticRegression`` with
``C = 1 / (lambda_1 n)`` is the same problem and is offered as a cross-check.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DEFAULT_LAMBD",
    "LAMBD_SWEEP",
    "LinearModel",
    "LowShotResult",
    "center_and_normalize",
    "fit_logistic",
    "lowshot_accuracy",
    "summarize",
]

DEFAULT_LAMBD = 0.00025  # official logistic_eval.py default (its README example uses 0.0025 at 5 imgs/class)
LAMBD_SWEEP: tuple[float, ...] = (2.5e-5, 0.00025, 0.0025, 0.025, 0.25)
_EPS = 1e-12


def center_and_normalize(features: np.ndarray) -> np.ndarray:
    """Row-wise centring then row L2 normalisation, as ``cyanure.preprocess(centering=True, columns=False)``.

    Returns a new C-contiguous float64 array whatever the input's memory order: cyanure's own in-place
    ``preprocess`` silently does nothing on Fortran-ordered arrays, so it is not used here. float64 also keeps
    cyanure from warning about float32 numerical instability.
    """
    x = np.array(features, dtype=np.float64, order="C", copy=True)
    if x.ndim != 2:
        raise ValueError(f"features must be (n, d), got shape {x.shape}")
    x -= x.mean(axis=1, keepdims=True)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _EPS)
    return x


@dataclass
class LinearModel:
    """A fitted multinomial classifier: ``scores = x @ coef`` for preprocessed ``x``; ``coef`` is (d, k)."""

    coef: np.ndarray
    classes: np.ndarray
    fit_seconds: float

    def predict(self, features: np.ndarray) -> np.ndarray:
        return self.classes[np.argmax(center_and_normalize(features) @ self.coef, axis=1)]

    def accuracy(self, features: np.ndarray, labels: np.ndarray) -> float:
        return float(np.mean(self.predict(features) == np.asarray(labels)))


def fit_logistic(features: np.ndarray, labels: np.ndarray, *, lambd: float = DEFAULT_LAMBD,
                 solver: str = "cyanure", max_iter: int = 300, tol: float = 1e-3, n_threads: int = -1,
                 seed: int = 0) -> LinearModel:
    """Fit the official low-shot classifier on raw features (preprocessed here); ``lambd`` is divided by n.

    ``solver`` is ``"cyanure"`` (the paper's) or ``"sklearn"`` (lbfgs on the identical objective).
    """
    x = center_and_normalize(features)
    y = np.asarray(labels).astype(np.int64)
    n = len(y)
    lambda_1 = lambd / n
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError("low-shot classification needs at least two classes")
    start = time.perf_counter()
    if solver == "cyanure":
        from cyanure.estimators import Classifier

        common = {"penalty": "l2", "fit_intercept": False, "lambda_1": lambda_1, "tol": tol, "solver": "auto",
                  "max_iter": max_iter, "n_threads": n_threads, "random_state": seed, "duality_gap_interval": 10,
                  "verbose": False}
        if len(classes) == 2:
            # cyanure's multiclass loss silently becomes *square* loss for two classes: fit the binary logistic
            # loss instead; softmax over scores (-w/2, w/2) is the same model.
            clf = Classifier(loss="logistic", **common)
            clf.fit(x, np.where(y == classes[1], 1, -1))
            w = np.asarray(clf.coef_, dtype=np.float64).reshape(-1)
            coef, model_classes = np.stack([-w / 2, w / 2], axis=1), classes
        else:
            clf = Classifier(loss="multiclass-logistic", **common)
            clf.fit(x, y)
            coef = np.asarray(clf.coef_, dtype=np.float64)  # (d, k)
            model_classes = np.asarray(clf.classes_)
    elif solver == "sklearn":
        from sklearn.linear_model import LogisticRegression

        clf = LogisticRegression(C=1.0 / (lambda_1 * n), fit_intercept=False, max_iter=max(max_iter, 1000),
                                 tol=1e-6)
        clf.fit(x, y)
        coef = clf.coef_.T.astype(np.float64)
        if len(classes) == 2:  # scikit-learn keeps one weight vector (for classes_[1]) in the binary case
            coef = np.concatenate([-coef / 2, coef / 2], axis=1)
        model_classes = clf.classes_
    else:
        raise ValueError(f"unknown solver {solver!r}; expected 'cyanure' or 'sklearn'")
    if coef.shape != (x.shape[1], len(classes)):
        raise RuntimeError(f"{solver} returned coefficients of shape {coef.shape}, expected "
                           f"{(x.shape[1], len(classes))}")
    return LinearModel(coef, model_classes, time.perf_counter() - start)


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
