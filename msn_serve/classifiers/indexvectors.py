"""Stored vectors of an index, given back in the classifier's space: what fit-from-ids and the label loop read.

It lives with the classifiers, not the indexes, because the space is the classifier's: the index store knows nothing
of classifiers, and the label loop reads indexes (one direction).

Every index kind the service creates can give its vectors back exactly: ``flat`` and ``hnsw`` through their flat
storage (``IndexIDMap2`` keeps the id of each row), ``ivf`` (``IndexIVFFlat``) from its inverted lists, which hold
the raw float32 rows. ``ivfpq`` (only from ``msn-index build``) keeps product-quantised codes, so its vectors
cannot be recovered: the label loop refuses it with a 422 that says so.

The vectors are kept in the low-shot classifier's space (each row centred and L2-normalised,
:func:`msn_serve.classifiers.label_strategies.as_space`): the classifier normalises its input the same way, so a fit
on them equals a fit on the raw embeddings (whether the index normalised them or not), and select/suggest/predict_index
work on them without converting anything per call. The matrix is built once per index version (``seq``) and kept beside the
index (FAISS' own storage may change under a later add): one more copy of the vectors, 77 MB at 100k x 192.
"""
from __future__ import annotations

import faiss
import numpy as np

from msn_serve.classifiers.label_strategies import as_space
from msn_serve.errors import unprocessable
from msn_serve.indexes.managed import ManagedIndex

LOOP_KINDS = ("flat", "ivf", "hnsw")


def check_kind(idx: ManagedIndex) -> None:
    if idx.cfg.type not in LOOP_KINDS:
        raise unprocessable(f"index {idx.path.name!r} is {idx.cfg.type}: its vectors are compressed codes and "
                            f"cannot be given back, so the label loop works on {', '.join(LOOP_KINDS)} indexes "
                            "only (build one of those for labelling)")


def stored_vectors(idx: ManagedIndex) -> tuple[np.ndarray, np.ndarray]:
    """``(ids ascending int64 (n,), vectors float32 (n, d) in the classifier's space)`` of every stored item,
    cached per index version."""
    check_kind(idx)
    with idx.lock:
        idx._check_open()
        cached = getattr(idx, "_loop_vectors", None)
        if cached is not None and cached[0] == idx.seq:
            return cached[1], cached[2]
        ids, vecs = _read_all(idx.index, idx.cfg.type, idx.cfg.dim)
        order = np.argsort(ids, kind="stable")
        ids, vecs = ids[order], as_space(vecs[order])
        idx._loop_vectors = (idx.seq, ids, vecs)
        return ids, vecs


def _read_all(index: faiss.Index, kind: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(index.ntotal)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    if kind == "ivf":
        ivf = faiss.extract_index_ivf(index)
        lists = ivf.invlists
        id_parts, vec_parts = [], []
        for lst in range(ivf.nlist):
            size = lists.list_size(lst)
            if not size:
                continue
            id_parts.append(faiss.rev_swig_ptr(lists.get_ids(lst), size).copy())
            codes = faiss.rev_swig_ptr(lists.get_codes(lst), size * lists.code_size).copy()
            vec_parts.append(codes.view(np.float32).reshape(size, dim))
        return np.concatenate(id_parts).astype(np.int64), np.concatenate(vec_parts)
    idmap = faiss.downcast_index(index)
    ids = faiss.vector_to_array(idmap.id_map).astype(np.int64)
    vecs = faiss.downcast_index(idmap.index).reconstruct_n(0, n)
    return ids, np.asarray(vecs, dtype=np.float32).reshape(n, dim)


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
