"""The label loop over stored items: select, fit-from-ids' lookup, suggest and predict_index (blocking calls).

Each reads an index's stored vectors (:mod:`msn_serve.classifiers.indexvectors`), works on a seeded candidate sample
of at most ``select_candidates`` items (so a call costs the same at 100k or 10M items) and is run in the work pool by
:class:`~msn_serve.classifiers.service.ClassifierService`. The algorithms (which items to pick) live in
:mod:`msn_serve.classifiers.label_strategies`; the policies here: which ids are excluded (the caller's
``exclude_ids``, and a classifier's own fit ids on the index it was fitted from), how a classifier and an index must
agree (dimension), and how large a page may be. Results are plain values; :mod:`msn_serve.http.responses` writes a
page as JSON.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from msn_serve.classifiers import label_strategies
from msn_serve.classifiers.fewshot import FewShotClassifier
from msn_serve.classifiers.indexvectors import positions, stored_vectors
from msn_serve.config import check_results
from msn_serve.errors import unprocessable
from msn_serve.indexes.base import VectorIndex
from msn_serve.indexes.store import IndexStore

DEFAULT_PAGE = 1000
CHUNK = 8192  # rows per probability block (bounds memory at many classes)


def _nonempty(idx: VectorIndex, name: str) -> tuple[np.ndarray, np.ndarray]:
    ids, vecs = stored_vectors(idx)
    if not len(ids):
        raise unprocessable(f"index {name!r} holds no items: add vectors or images first")
    return ids, vecs


def _excluded(all_ids: np.ndarray, exclude: np.ndarray | None) -> np.ndarray:
    """Positions of the excluded ids that the index holds (others cannot be selected anyway)."""
    if exclude is None or not len(exclude):
        return np.zeros(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(all_ids, exclude), len(all_ids) - 1)
    return pos[all_ids[pos] == exclude]


def select(indexes: IndexStore, name: str, *, n: int, strategy: str, seed: int, exclude_ids: np.ndarray | None,
           candidates: int) -> dict[str, Any]:
    """``{"ids", "strategy", "seed", "available", "candidates"}``: ``n`` ids (fewer when fewer are available)."""
    ids, vecs = _nonempty(indexes.bound(name), name)
    covered = _excluded(ids, exclude_ids)
    cand = label_strategies.candidate_positions(len(ids), candidates, seed, covered)
    cov = vecs[covered] if len(covered) else None
    picks = label_strategies.select(vecs[cand], n, strategy, seed, cov) if len(cand) else np.zeros(0, np.int64)
    return {"index": name, "ids": ids[cand[picks]].tolist(), "strategy": strategy, "seed": seed,
            "available": int(len(ids) - len(covered)), "candidates": len(cand)}


def fit_vectors(indexes: IndexStore, name: str, wanted: np.ndarray) -> np.ndarray:
    """The stored vectors of ``wanted`` ids (422 naming ids the index lacks)."""
    ids, vecs = stored_vectors(indexes.bound(name))
    return vecs[positions(ids, wanted, name)]


def _check_dims(clf: FewShotClassifier, idx: VectorIndex, name: str) -> None:
    if clf.weights.shape[0] != idx.cfg.dim:
        raise unprocessable(f"classifier {clf.name!r} takes {clf.weights.shape[0]}-d vectors but index {name!r} "
                            f"holds {idx.cfg.dim}-d ones")


def _probabilities(clf: FewShotClassifier, space: np.ndarray) -> np.ndarray:
    """Softmax of ``space @ weights`` in float32 (rows already centred and normalised, so this equals
    :meth:`msn_core.lowshot.LinearClassifier.probabilities` without its per-call float64 copy)."""
    out = np.empty((len(space), len(clf.classes)), np.float32)
    for i in range(0, len(space), CHUNK):
        logits = space[i: i + CHUNK] @ clf.weights
        logits -= logits.max(axis=1, keepdims=True)
        np.exp(logits, out=logits)
        out[i: i + CHUNK] = logits / logits.sum(axis=1, keepdims=True)
    return out


def suggest(indexes: IndexStore, clf: FewShotClassifier, *, index: str, n: int, strategy: str, seed: int,
            exclude_ids: np.ndarray | None, candidates: int) -> dict[str, Any]:
    """Unlabelled ids, most useful first; a classifier's fit ids on this index never come back."""
    idx = indexes.bound(index)
    _check_dims(clf, idx, index)
    ids, vecs = _nonempty(idx, index)
    skip = [exclude_ids] if exclude_ids is not None else []
    if clf.fit_ids is not None and clf.info.get("index") == index:
        skip.append(clf.fit_ids)
    covered = _excluded(ids, np.unique(np.concatenate(skip)) if skip else None)
    cand = label_strategies.candidate_positions(len(ids), candidates, seed, covered)
    out: dict[str, Any] = {"name": clf.name, "index": index, "strategy": strategy, "seed": seed,
                           "available": int(len(ids) - len(covered)), "candidates": len(cand)}
    if not len(cand):
        return {**out, "ids": [], "uncertainty": []}
    space = vecs[cand]
    probs = _probabilities(clf, space)
    cov = vecs[covered] if len(covered) else None
    picks = label_strategies.suggest(space, probs, n, strategy, seed, cov)
    unc = label_strategies.uncertainty(probs[picks], "entropy" if strategy == "entropy" else "margin")
    return {**out, "ids": ids[cand[picks]].tolist(), "uncertainty": [round(float(u), 6) for u in unc]}


class PredictionCache:
    """Top-1 label, probability and margin of every item, per (classifier, index version): a page of
    ``predict_index`` then costs its own rows, and class counts and the uncertainty order come for free."""

    def __init__(self, size: int = 4):
        self.size, self._lock, self._items = size, threading.Lock(), OrderedDict()

    def get(self, clf: FewShotClassifier, idx: VectorIndex, ids: np.ndarray, vecs: np.ndarray) -> dict[str, Any]:
        key = (clf.name, id(clf), clf.info.get("created"), id(idx), idx.seq, len(ids))
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        top1 = np.zeros(len(ids), np.int32)
        conf = np.zeros(len(ids), np.float32)
        margin = np.zeros(len(ids), np.float32)
        for i in range(0, len(ids), CHUNK):
            p = _probabilities(clf, vecs[i: i + CHUNK])
            part = -np.partition(-p, 1, axis=1)[:, :2] if p.shape[1] > 1 else np.hstack([p, np.zeros_like(p)])
            top1[i: i + CHUNK] = np.argmax(p, axis=1)
            conf[i: i + CHUNK], margin[i: i + CHUNK] = part[:, 0], part[:, 0] - part[:, 1]
        entry = {"top1": top1, "conf": conf, "margin": margin,
                 "uncertain": np.lexsort((ids, margin)),  # smallest margin first, ties by id
                 "counts": np.bincount(top1, minlength=len(clf.classes))}
        with self._lock:
            self._items[key] = entry
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return entry


@dataclass(frozen=True)
class IndexPage:
    """One page of predictions over an index's items, and the class counts over all of them."""

    name: str  # the classifier
    index: str
    total: int
    offset: int
    limit: int
    order: str
    next_offset: int | None
    classes: list[str]
    class_counts: dict[str, int]
    ids: np.ndarray  # (m,) the page's ids, in page order
    label: np.ndarray  # (m,) index into classes of each item's most probable class
    probability: np.ndarray  # (m,) its probability
    margin: np.ndarray  # (m,) top-1 minus top-2 probability
    top: np.ndarray  # (m, k) indices into classes, most probable first
    top_probability: np.ndarray  # (m, k)
    metadata: dict[int, str | None]  # id -> stored metadata JSON text


def predict_index(indexes: IndexStore, clf: FewShotClassifier, cache: PredictionCache, *, index: str, offset: int,
                  limit: int | None, k: int, order: str, max_page: int, max_results: int) -> IndexPage:
    """One page (``limit`` items from ``offset``, by id or least certain first) of predictions over an index."""
    idx = indexes.bound(index)
    _check_dims(clf, idx, index)
    k, limit = min(k, len(clf.classes)), limit or min(DEFAULT_PAGE, max_page)
    check_results(limit, k, max_results)
    ids, vecs = stored_vectors(idx)
    entry = cache.get(clf, idx, ids, vecs)
    ordered = entry["uncertain"] if order == "uncertain" else np.arange(len(ids))
    page = ordered[offset: offset + limit]
    probs = _probabilities(clf, vecs[page])
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    end = offset + len(page)
    texts = idx.metadata_texts(ids[page].tolist())
    return IndexPage(name=clf.name, index=index, total=len(ids), offset=offset, limit=limit, order=order,
                     next_offset=end if end < len(ids) else None, classes=clf.classes,
                     class_counts=dict(zip(clf.classes, entry["counts"].tolist(), strict=True)),
                     ids=ids[page], label=entry["top1"][page], probability=entry["conf"][page],
                     margin=entry["margin"][page], top=top, top_probability=np.take_along_axis(probs, top, axis=1),
                     metadata=texts)
