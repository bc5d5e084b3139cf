"""The MSN low-shot classifier, as the official ``logistic_eval.py``: used by ``msn-eval`` and ``/fewshot/fit``.

Each feature row is centred and L2-normalised, then an L2-regularised multinomial logistic regression without
intercept is fitted with cyanure, with ``lambda_1 = lambd / n`` (the official ``lambd /= len(embs)``). The official
code ran cyanure 0.22's ``MultiClassifier.fit(lambd=...)``; cyanure 1.2's ``Classifier(lambda_1=...)`` minimises the
same objective ``(1/n) sum_i L(y_i, W^T x_i) + lambda_1/2 ||W||^2``. Two cyanure 1.2 pitfalls are handled here:
its ``preprocess`` silently does nothing on Fortran-ordered arrays (so centring is done in numpy), and its
multiclass loss silently becomes *square* loss for two classes (so two classes fit the binary logistic loss and
store the equivalent softmax columns ``[-w/2, w/2]``). cyanure is imported only when fitting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from msn_core.openmp import openmp_kept
from msn_core.optional import require

__all__ = ["DEFAULT_LAMBD", "LinearClassifier", "center_and_normalize", "fit_logistic"]

# The official logistic_eval.py default (its README example passes 0.0025 at 5 images per class). One value for
# msn-eval and the service: a classifier fitted over HTTP then matches the low-shot numbers msn-eval reports.
DEFAULT_LAMBD = 0.00025
_EPS = 1e-12


def center_and_normalize(features: np.ndarray) -> np.ndarray:
    """Row-wise centring then L2 normalisation (``cyanure.preprocess(centering=True, normalize=True,
    columns=False)``), as a new C-ordered float64 array whatever the input's order (float64 also keeps cyanure
    from warning about float32 instability)."""
    x = np.array(features, dtype=np.float64, order="C", copy=True)
    if x.ndim != 2:
        raise ValueError(f"features must be (n, d), got shape {x.shape}")
    x -= x.mean(axis=1, keepdims=True)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _EPS)
    return x


@dataclass
class LinearClassifier:
    """A fitted classifier: ``scores = center_and_normalize(x) @ coef``.

    ``coef`` is (d, k), column j = ``classes[j]``.
    """

    coef: np.ndarray
    classes: np.ndarray
    fit_seconds: float = 0.0

    def scores(self, features: np.ndarray) -> np.ndarray:
        return center_and_normalize(features) @ np.asarray(self.coef, dtype=np.float64)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """Softmax over the classes, ``(n, k)``."""
        logits = self.scores(features)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, features: np.ndarray) -> np.ndarray:
        return np.asarray(self.classes)[np.argmax(self.scores(features), axis=1)]

    def accuracy(self, features: np.ndarray, labels: np.ndarray) -> float:
        return float(np.mean(self.predict(features) == np.asarray(labels)))


def fit_logistic(features: np.ndarray, labels: np.ndarray, *, lambd: float = DEFAULT_LAMBD, max_iter: int = 300,
                 tol: float = 1e-3, n_threads: int = 1, seed: int = 0) -> LinearClassifier:
    """Fit the low-shot classifier on raw features (normalised here); ``labels`` may be ints or strings.

    One thread by default: low-shot problems are small enough that threads gain little. The fit runs inside
    :func:`msn_core.openmp.openmp_kept`: cyanure turns on OpenMP's dynamic thread adjustment and changes the thread
    count in whatever runtime it binds to (torch's, when torch came first), and left so, torch's backward in the
    same process could spin for ever afterwards.

    Raises ``ValueError`` for unusable input (shape mismatch, NaN, fewer than two classes, ``lambd <= 0``) and when
    the fit diverges. Settings follow the official call: ``tol=1e-3``, 300 epochs, duality gap every 10, seed 0.
    """
    raw, y = np.asarray(features), np.asarray(labels)
    if raw.ndim != 2 or y.ndim != 1 or len(y) != len(raw):
        raise ValueError(f"{len(y)} labels for {len(raw)} examples (features must be (n, d), labels (n,))")
    if not np.isfinite(raw).all():
        raise ValueError("features contain NaN or infinity")
    x = center_and_normalize(raw)
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError(f"need at least 2 distinct labels to fit a classifier, got {classes.tolist()}")
    if not (np.isfinite(lambd) and lambd > 0):
        raise ValueError(f"lambd must be a positive number, got {lambd}")
    start = time.perf_counter()
    with openmp_kept():
        coef = _fit_cyanure(x, y, classes, lambd=lambd, max_iter=max_iter, tol=tol, n_threads=n_threads, seed=seed)
    if coef.shape != (x.shape[1], len(classes)) or not np.isfinite(coef).all():
        raise ValueError(f"the fit diverged or returned coefficients of shape {coef.shape}; try a larger lambd")
    return LinearClassifier(coef, classes, time.perf_counter() - start)


def _fit_cyanure(x: np.ndarray, y: np.ndarray, classes: np.ndarray, *, lambd: float, max_iter: int, tol: float,
                 n_threads: int, seed: int) -> np.ndarray:
    """The (d, k) coefficients of the official objective on normalised rows ``x``."""
    Classifier = require("cyanure.estimators", "the low-shot classifier fit").Classifier  # ~1 s, only here
    common = {"penalty": "l2", "fit_intercept": False, "lambda_1": lambd / len(y), "tol": tol, "solver": "auto",
              "max_iter": max_iter, "n_threads": n_threads, "random_state": seed, "duality_gap_interval": 10,
              "verbose": False}
    if len(classes) == 2:
        clf = Classifier(loss="logistic", **common)
        clf.fit(x, np.where(y == classes[1], 1, -1))
        w = np.asarray(clf.coef_, dtype=np.float64).reshape(-1)
        coef = np.stack([-w / 2, w / 2], axis=1)
    else:
        codes = np.searchsorted(classes, y)
        clf = Classifier(loss="multiclass-logistic", **common)
        clf.fit(x, codes)
        order = [list(clf.classes_).index(c) for c in range(len(classes))]
        coef = np.asarray(clf.coef_, dtype=np.float64)[:, order]
    return coef
