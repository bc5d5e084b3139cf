"""Stored vectors of an index, given back in the classifier's space: what fit-from-ids and the label loop read.

It lives with the classifiers, not the indexes, because the space is the classifier's: the index store knows nothing
of classifiers, and the label loop reads indexes (one direction).

Each store gives its vectors back (:meth:`~msn_serve.indexes.base.VectorIndex.stored_vectors`): FAISS ``flat``,
``hnsw`` and ``ivf`` exactly from their storage, a Milvus collection by reading it; ``ivfpq`` (only from
``msn-index build``) keeps product-quantised codes, so its vectors cannot be recovered: the label loop refuses it
with a 422 that says so.

The vectors are kept in the low-shot classifier's space (each row centred and L2-normalised,
:func:`msn_serve.classifiers.label_strategies.as_space`): the classifier normalises its input the same way, so a fit
on them equals a fit on the raw embeddings (whether the index normalised them or not), and select/suggest/predict_index
work on them without converting anything per call. The matrix is built once per index version (``seq``) and kept
beside the index (the store's own storage may change under a later add): one more copy of the vectors, 77 MB at
100k x 192.
"""
from __future__ import annotations

import numpy as np

from msn_serve.classifiers.label_strategies import as_space
from msn_serve.errors import unprocessable
from msn_serve.indexes.base import VectorIndex


def stored_vectors(idx: VectorIndex) -> tuple[np.ndarray, np.ndarray]:
    """``(ids ascending int64 (n,), vectors float32 (n, d) in the classifier's space)`` of every stored item,
    cached per index version."""
    with idx.lock:
        cached = getattr(idx, "_loop_vectors", None)
        if cached is not None and cached[0] == idx.seq and not idx.closed:
            return cached[1], cached[2]
        ids, vecs = idx.stored_vectors()
        ids = np.asarray(ids, dtype=np.int64)
        vecs = np.asarray(vecs, dtype=np.float32).reshape(len(ids), idx.cfg.dim)
        order = np.argsort(ids, kind="stable")
        ids, vecs = ids[order], as_space(vecs[order])
        idx._loop_vectors = (idx.seq, ids, vecs)
        return ids, vecs


def positions(all_ids: np.ndarray, wanted: np.ndarray, index_name: str) -> np.ndarray:
    """Positions of ``wanted`` ids in the sorted ``all_ids``; 422 naming (the first few) ids the index lacks."""
    pos = np.searchsorted(all_ids, wanted)
    pos = np.minimum(pos, max(len(all_ids) - 1, 0))
    found = (all_ids[pos] == wanted) if len(all_ids) else np.zeros(len(wanted), bool)
    if not found.all():
        missing = wanted[~found]
        shown = ", ".join(str(i) for i in missing[:10].tolist())
        raise unprocessable(f"{len(missing)} id(s) are not in index {index_name!r}: {shown}"
                            + (", ..." if len(missing) > 10 else ""))
    return pos
