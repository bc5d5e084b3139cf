"""How a Milvus index is tuned: the index Milvus builds for each kind and the knobs of one search.

An index's :class:`~msn_serve.indexes.config.IndexConfig` means the same on both backends: ``nlist`` and the HNSW
``m``/``ef_construction`` when the collection's index is built, ``nprobe``/``ef_search`` (a request's override
first) at every search. Milvus builds and maintains the index itself, so there is no re-tuning here: FAISS' ``auto``
kind is refused (:func:`check_spec`).
"""
from __future__ import annotations

from typing import Any

from msn_serve.errors import unprocessable
from msn_serve.indexes.config import IndexConfig

__all__ = ["KINDS", "TOPK_MAX", "check_spec", "index_params", "search_params"]

KINDS = {"flat": "FLAT", "ivf": "IVF_FLAT", "hnsw": "HNSW"}
TOPK_MAX = 16_384  # Milvus' limit on k (and on queries per search)


def check_spec(spec: dict[str, Any]) -> None:
    """What a Milvus index cannot be (422 naming it): FAISS' self-tuning ``auto`` kind."""
    if spec.get("type") == "auto":
        raise unprocessable("type 'auto' re-tunes a FAISS index as it grows; a Milvus index is 'flat', 'ivf' or "
                            "'hnsw' (Milvus builds and maintains it), or create it with backend 'faiss'")


def index_params(client: Any, cfg: IndexConfig) -> Any:
    """The ``IndexParams`` of a new collection's ``vector`` field: ``cfg``'s kind, metric and build sizes."""
    params = client.prepare_index_params()
    extra = {"ivf": {"nlist": cfg.nlist}, "hnsw": {"M": cfg.m, "efConstruction": cfg.ef_construction}}
    params.add_index(field_name="vector", index_type=KINDS[cfg.type], metric_type=cfg.metric.upper(),
                     params=extra.get(cfg.type, {}))
    return params


def search_params(cfg: IndexConfig, k: int, nprobe: int | None = None, ef_search: int | None = None) -> dict[str, Any]:
    """One search's ``search_params`` for ``k`` > 0 neighbours (422 past Milvus' limit): ``nprobe`` capped at
    ``nlist``, ``ef`` at least ``k`` (HNSW returns no more than it explores)."""
    if k > TOPK_MAX:
        raise unprocessable(f"k={k}: Milvus returns at most {TOPK_MAX} neighbours per query")
    params = {"ivf": {"nprobe": min(nprobe or cfg.nprobe, cfg.nlist)},
              "hnsw": {"ef": max(ef_search or cfg.ef_search, k)}}.get(cfg.type, {})
    return {"metric_type": cfg.metric.upper(), "params": params}
