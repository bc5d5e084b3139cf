"""Few-shot classifiers: the MSN low-shot evaluation protocol, served.

Protocol (facebookresearch/msn ``logistic_eval.py``, ported to cyanure >= 1.0): each embedding row is centred and
L2-normalised (done here in numpy: cyanure's ``preprocess`` silently does nothing on Fortran-ordered arrays), then
a multinomial logistic regression without intercept is fit with L2 strength ``lambd / n``. Two classes use
cyanure's binary ``logistic`` loss (its multiclass loss falls back to *square* loss for two classes); the weight
vector is stored as the equivalent two-column softmax ``[-w/2, w/2]``, so prediction is always
``softmax(x @ W)``. Stored as one ``.npz`` (float arrays + JSON as bytes, loaded with ``allow_pickle=False``).
"""
from __future__ import annotations

import io
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import check_name, conflict, not_found, read_only_replica, unprocessable
from .storage import atomic_write, quarantine, remove_durably

log = logging.getLogger("msn_serve.fewshot")
MAX_CLASSES = 10_000


def row_normalise(x: np.ndarray) -> np.ndarray:
    """Centre each row, then scale it to unit L2 norm (``cyan.preprocess(centering=True, normalize=True,
    columns=False)``); C-ordered float32 output."""
    x = np.array(x, dtype=np.float64, order="C", copy=True)
    x -= x.mean(axis=1, keepdims=True)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.maximum(norms, 1e-12)
    return np.ascontiguousarray(x, dtype=np.float32)


@dataclass
class FewShotClassifier:
    name: str
    weights: np.ndarray  # (D, C)
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    def predict(self, x: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        logits = row_normalise(x).astype(np.float64) @ self.weights.astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        k = min(k, len(self.classes))
        top = np.argsort(-p, axis=1, kind="stable")[:, :k]
        return [[{"label": self.classes[j], "probability": float(p[i, j])} for j in row] for i, row in enumerate(top)]

    def to_bytes(self) -> bytes:
        meta = json.dumps({"name": self.name, "classes": self.classes, "info": self.info}).encode()
        buf = io.BytesIO()
        np.savez(buf, weights=self.weights.astype(np.float32), meta=np.frombuffer(meta, dtype=np.uint8))
        return buf.getvalue()

    @classmethod
    def from_file(cls, path: Path) -> FewShotClassifier:
        with np.load(path, allow_pickle=False) as z:
            weights = np.asarray(z["weights"], dtype=np.float32)
            meta = json.loads(bytes(z["meta"]).decode())
        classes = [str(c) for c in meta["classes"]]
        if weights.ndim != 2 or weights.shape[1] != len(classes) or not np.isfinite(weights).all():
            raise ValueError(f"weights {weights.shape} inconsistent with {len(classes)} classes")
        return cls(name=str(meta["name"]), weights=weights, classes=classes, info=dict(meta.get("info", {})))


def fit(name: str, x: np.ndarray, labels: list[str], *, lambd: float, threads: int = 1,
        max_iter: int = 300, tol: float = 1e-3) -> FewShotClassifier:
    """Fit on embeddings ``x`` (n, D) with string ``labels``; raises 422 on unusable data."""
    from cyanure.estimators import Classifier  # imported lazily: ~1 s and noisy, only needed when fitting

    if x.ndim != 2 or x.shape[0] != len(labels):
        raise unprocessable(f"{len(labels)} labels for {x.shape[0]} examples")
    if not np.isfinite(x).all():
        raise unprocessable("embeddings contain NaN or infinity")
    classes = sorted(set(labels))
    if len(classes) < 2:
        raise unprocessable(f"need at least 2 distinct labels to fit a classifier, got {classes}")
    if len(classes) > MAX_CLASSES:
        raise unprocessable(f"at most {MAX_CLASSES} classes")
    if not np.isfinite(lambd) or lambd <= 0:
        raise unprocessable(f"lambd must be a positive number, got {lambd}")
    xn = row_normalise(x)
    if (np.abs(xn).sum(axis=1) == 0).any():
        raise unprocessable("an embedding is constant across dimensions (nothing left after centring)")
    y = np.array([classes.index(lbl) for lbl in labels], dtype=np.int64)
    n = xn.shape[0]
    t0 = time.perf_counter()
    common = {"penalty": "l2", "lambda_1": lambd / n, "fit_intercept": False, "tol": tol, "max_iter": max_iter,
              "n_threads": threads, "random_state": 0, "verbose": False}
    if len(classes) == 2:
        clf = Classifier(loss="logistic", **common)
        clf.fit(xn, np.where(y == 1, 1, -1))
        w = np.asarray(clf.coef_, dtype=np.float64).reshape(-1)
        weights = np.stack([-w / 2, w / 2], axis=1)
    else:
        clf = Classifier(loss="multiclass-logistic", **common)
        clf.fit(xn, y)
        coef = np.asarray(clf.coef_, dtype=np.float64)
        order = [list(clf.classes_).index(c) for c in range(len(classes))]
        weights = coef[:, order]
    if not np.isfinite(weights).all():
        raise unprocessable("the fit diverged (non-finite weights); try a larger lambd")
    info = {"n": int(n), "dim": int(xn.shape[1]), "lambd": float(lambd), "lambda_1": float(lambd / n),
            "counts": {c: int((y == i).sum()) for i, c in enumerate(classes)},
            "fit_seconds": round(time.perf_counter() - t0, 4), "created": time.time(),
            "protocol": "row centre + L2 normalise; cyanure multinomial logistic, no intercept"}
    return FewShotClassifier(name=name, weights=weights.astype(np.float32), classes=classes, info=info)


class ClassifierStore:
    """``<data-dir>/classifiers/<name>.npz``, each written atomically (snapshot + fsync) before acknowledging."""

    def __init__(self, data_dir: Path, model_id: str, *, root: Path | None = None, read_only: bool = False):
        self.data_dir, self.read_only = data_dir, read_only
        self.root = root or data_dir / "classifiers"
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.model_id = model_id
        self._lock = threading.Lock()
        self.items: dict[str, FewShotClassifier] = {}

    def load_all(self) -> list[str]:
        problems = []
        for p in sorted(self.root.glob("*.npz")):
            if p.name.startswith("."):
                continue
            try:
                clf = FewShotClassifier.from_file(p)
                if clf.name != p.stem:
                    raise ValueError(f"file name {p.stem!r} does not match stored name {clf.name!r}")
                self.items[clf.name] = clf
            except Exception as e:
                if self.read_only:  # a published snapshot is all or nothing; never move files on a reader
                    raise ValueError(f"cannot load published classifier {p}: {e!r}") from e
                quarantine(self.data_dir, p, f"cannot load classifier: {e!r}")
                problems.append(p.name)
        return problems

    def put(self, clf: FewShotClassifier, *, overwrite: bool) -> None:
        check_name(clf.name, "classifier name")
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            if clf.name in self.items and not overwrite:
                raise conflict(f"classifier {clf.name!r} exists; pass overwrite=true to replace it")
            clf.info["model_id"] = self.model_id
            atomic_write(self.root / f"{clf.name}.npz", clf.to_bytes())
            self.items[clf.name] = clf

    def get(self, name: str) -> FewShotClassifier:
        clf = self.items.get(name)
        if clf is None:
            raise not_found(f"no classifier named {name!r}")
        return clf

    def delete(self, name: str) -> None:
        if self.read_only:
            raise read_only_replica()
        with self._lock:
            self.get(name)
            remove_durably(self.root / f"{name}.npz")
            del self.items[name]

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": c.name, "classes": c.classes, **{k: c.info.get(k) for k in ("n", "dim", "lambd", "created")}}
                for c in sorted(self.items.values(), key=lambda c: c.name)]
