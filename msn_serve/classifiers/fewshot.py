"""Few-shot classifiers over HTTP: the MSN low-shot classifier of :mod:`msn_core.lowshot`, fitted and stored.

The fit (row centring + L2, cyanure multinomial logistic regression with ``lambd / n``, the two-class case, the
default lambda) is the one ``msn-eval`` reports accuracy with; the service runs it in a worker process
(:mod:`msn_serve.classifiers.fitpool`). This module adds the service's checks, string labels, top-k predictions and
durable storage: one ``.npz`` per classifier (float weights + JSON as bytes, loaded with ``allow_pickle=False``),
written atomically before a fit is acknowledged.
"""
from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import atomic_write, quarantine, remove_durably
from msn_core.lowshot import LinearClassifier, center_and_normalize, fit_logistic
from msn_serve.errors import (
    check_model,
    check_name,
    conflict,
    model_matches,
    not_found,
    persisting,
    read_only_replica,
    too_large,
    unprocessable,
)

log = logging.getLogger("msn_serve.classifiers.fewshot")


@dataclass
class FewShotClassifier:
    name: str
    weights: np.ndarray  # (D, C): column j scores classes[j]
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    fit_ids: np.ndarray | None = None  # ids of the index items it was fitted on (info["index"] names the index)

    def top_k(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(class indices (n, k'), probabilities (n, k'))``, most probable first, ``k' = min(k, classes)``."""
        p = LinearClassifier(self.weights, np.asarray(self.classes)).probabilities(x)
        top = np.argsort(-p, axis=1, kind="stable")[:, : min(k, len(self.classes))]
        return top, np.take_along_axis(p, top, axis=1)

    def predict(self, x: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        top, prob = self.top_k(x, k)
        return [[{"label": self.classes[j], "probability": p} for j, p in zip(row, prow, strict=True)]
                for row, prow in zip(top.tolist(), prob.tolist(), strict=True)]

    def to_bytes(self) -> bytes:
        meta = json.dumps({"name": self.name, "classes": self.classes, "info": self.info}).encode()
        buf = io.BytesIO()
        extra = {} if self.fit_ids is None else {"fit_ids": np.asarray(self.fit_ids, dtype=np.int64)}
        np.savez(buf, weights=self.weights.astype(np.float32), meta=np.frombuffer(meta, dtype=np.uint8), **extra)
        return buf.getvalue()

    @classmethod
    def from_file(cls, path: Path) -> FewShotClassifier:
        with np.load(path, allow_pickle=False) as z:
            weights = np.asarray(z["weights"], dtype=np.float32)
            meta = json.loads(bytes(z["meta"]).decode())
            fit_ids = np.asarray(z["fit_ids"], dtype=np.int64) if "fit_ids" in z.files else None
        classes = [str(c) for c in meta["classes"]]
        if weights.ndim != 2 or weights.shape[1] != len(classes) or not np.isfinite(weights).all():
            raise ValueError(f"weights {weights.shape} inconsistent with {len(classes)} classes")
        return cls(name=str(meta["name"]), weights=weights, classes=classes, info=dict(meta.get("info", {})),
                   fit_ids=fit_ids)


def check_fit_data(x: np.ndarray, labels: list[str], *, max_classes: int) -> None:
    """What a fit request must satisfy before any fitting work (422/413 naming the problem)."""
    if len(labels) != len(x):
        raise unprocessable(f"{len(labels)} labels for {len(x)} images/embeddings")
    classes = len(set(labels))
    if classes < 2:
        raise unprocessable(f"need at least 2 distinct labels to fit a classifier, got {sorted(set(labels))[:1]}")
    if classes > max_classes:
        raise too_large(f"{classes} distinct labels exceed the limit of {max_classes} (max_fit_classes)")
    if not np.isfinite(x).all():
        raise unprocessable("embeddings contain NaN or infinity")
    if not np.abs(center_and_normalize(x)).sum(axis=1).all():  # a client error msn-eval has no reason to refuse
        raise unprocessable("an embedding is constant across dimensions (nothing left after centring)")


def from_fit(name: str, model: LinearClassifier, labels: list[str], *, dim: int, lambd: float,
             seconds: float) -> FewShotClassifier:
    """The stored classifier for a fitted model (weights as float32, the fit's facts in ``info``)."""
    classes = [str(c) for c in model.classes]
    n = len(labels)
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    info = {"n": n, "dim": dim, "lambd": float(lambd), "lambda_1": float(lambd / n),
            "counts": {c: counts[c] for c in classes}, "fit_seconds": round(seconds, 4), "created": time.time(),
            "protocol": "row centre + L2 normalise; cyanure multinomial logistic, no intercept"}
    return FewShotClassifier(name=name, weights=model.coef.astype(np.float32), classes=classes, info=info)


def fit(name: str, x: np.ndarray, labels: list[str], *, lambd: float, threads: int = 1, max_iter: int = 300,
        tol: float = 1e-3, max_classes: int = 1000) -> FewShotClassifier:
    """Fit in this process (tests, tools); the service fits in a worker process with the same checks."""
    check_fit_data(x, labels, max_classes=max_classes)
    t0 = time.perf_counter()
    try:
        model = fit_logistic(x, np.asarray(labels, dtype=str), lambd=lambd, max_iter=max_iter, tol=tol,
                             n_threads=threads)
    except ValueError as e:
        raise unprocessable(str(e)) from None
    return from_fit(name, model, labels, dim=int(x.shape[1]), lambd=lambd, seconds=time.perf_counter() - t0)


class ClassifierStore:
    """``<data-dir>/classifiers/<name>.npz``, each written atomically (snapshot + fsync) before acknowledging."""

    def __init__(self, data_dir: Path, model_id: str, *, root: Path | None = None, read_only: bool = False):
        self.data_dir, self.read_only = data_dir, read_only
        self.root = root or data_dir / "classifiers"
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.model_id = model_id
        # Every model id the server runs (a live set the model registry keeps current; this one model otherwise).
        self.served: Collection[str] = (model_id,)
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
        with self._lock, persisting(f"store classifier {clf.name!r}"):
            self.check_free(clf.name, overwrite=overwrite)
            clf.info.setdefault("model_id", self.model_id)  # the service sets the model it fitted with
            atomic_write(self.root / f"{clf.name}.npz", clf.to_bytes())  # a failure leaves the old file
            self.items[clf.name] = clf

    def check_free(self, name: str, *, overwrite: bool) -> None:
        """409 unless ``name`` is unused or may be replaced (checked before a fit, and again when storing it)."""
        if name in self.items and not overwrite:
            raise conflict(f"classifier {name!r} exists; pass overwrite=true to replace it")

    def get(self, name: str) -> FewShotClassifier:
        clf = self.items.get(name)
        if clf is None:
            raise not_found(f"no classifier named {name!r}")
        return clf

    def bound(self, name: str) -> FewShotClassifier:
        """The classifier named ``name`` for a prediction: 404 when there is none, 409
        (:class:`~msn_serve.errors.ModelMismatch`) when it was fitted on another model's embeddings."""
        clf = self.get(name)
        check_model("classifier", name, clf.info.get("model_id"), self.served)
        return clf

    def mismatched(self) -> dict[str, str]:
        """``{name: model_id}`` of the classifiers fitted on another model's embeddings."""
        return {name: str(clf.info.get("model_id")) for name, clf in self.items.items()
                if not model_matches(clf.info.get("model_id"), self.served)}

    def delete(self, name: str) -> None:
        if self.read_only:
            raise read_only_replica()
        with self._lock, persisting(f"delete classifier {name!r}"):
            self.get(name)
            remove_durably(self.root / f"{name}.npz")
            del self.items[name]

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": c.name, "classes": c.classes, **{k: c.info.get(k) for k in ("n", "dim", "lambd", "created")},
                 "model_id": c.info.get("model_id"), "model_matches": model_matches(c.info.get("model_id"),
                                                                                    self.served)}
                for c in sorted(self.items.values(), key=lambda c: c.name)]
