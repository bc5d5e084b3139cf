"""``msn-embed --index NAME --index-backend milvus``: the finished msn-embed shards as a Milvus index msn-serve serves.

The copy is :func:`msn_serve.index_tools.milvus_copy.copy_checked`'s (every id read back before it is marked
ready), in a new collection; the name then moves to it (:func:`~msn_serve.index_tools.milvus_copy.point`), and with
``--overwrite-index`` the old collection is dropped only after that, so a ``kill -9`` at any step leaves the old
index or the new one under the name, whole. The data directory's lock is held, so msn-serve must be stopped, as for
``msn-index build``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.corpus import load_corpus
from msn_core.durable import lock_data_dir
from msn_serve.index_tools.milvus_copy import CopyError, copy_checked, milvus_steps, point
from msn_serve.indexes.config import IndexConfig
from msn_serve.indexes.milvus_conn import MilvusConnection


def shards_to_milvus(embeddings: Path, data_dir: Path, name: str, uri: str, *, index_type: str, store_paths: bool,
                     overwrite: bool) -> dict[str, Any]:
    """``msn-embed --index NAME --index-backend milvus``: the msn-embed shards as a Milvus index msn-serve serves
    (``flat`` unless ``ivf``/``hnsw`` is asked for: Milvus builds its own index; paths stored absolute)."""
    corpus = load_corpus(embeddings)
    chunks = list(corpus.chunks())
    ids = np.concatenate([c[0] for c in chunks]).astype(np.int64)
    vecs = np.concatenate([np.asarray(c[1], np.float32) for c in chunks])
    meta: dict[int, Any] = {}
    if store_paths:
        base = Path(corpus.manifest.get("base") or corpus.root)
        for row in corpus.paths():
            meta[int(row["id"])] = {"path": str(base / row["path"]),
                                    **({"label": row["label"]} if row.get("label") is not None else {})}
    cfg = IndexConfig(dim=corpus.dim, type=index_type if index_type in ("ivf", "hnsw") else "flat",
                      model_id=str(corpus.manifest.get("model_id") or ""))
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = lock_data_dir(data_dir, owner="msn-serve")
    except OSError as e:
        raise CopyError(f"{e}: stop msn-serve first, then start it again to load the index") from None
    conn = MilvusConnection(uri)
    try:
        if (data_dir / "indexes" / name).exists():
            raise CopyError(f"index {name!r} exists on FAISS in {data_dir}; drop it first")
        with milvus_steps(f"write index {name!r}"):
            conn.finish_swaps()
            conn.drop_orphans(name)
            if conn.resolve(name) is not None and not overwrite:
                raise CopyError(f"index {name!r} exists in {conn.describe()}; pass --overwrite-index to replace it")
        idx = copy_checked(conn, name, cfg, str(corpus.manifest.get("feature") or ""), ids, vecs, meta)
        with milvus_steps(f"write index {name!r}"):
            idx.set_state("ready")
        point(conn, name, idx.collection)  # the old collection, if any, is dropped once the name has moved
    finally:
        conn.close()
        os.close(lock)
    return {"name": name, "backend": "milvus", "ids": len(ids), "type": cfg.type, "model_id": cfg.model_id}
