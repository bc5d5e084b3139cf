"""Indexes as a service: create, add, search, remove, stats and drop, by name, on FAISS or Milvus alike.

Methods take names, id arrays, :class:`~msn_serve.embedding.service.Inputs` and the option dicts of
:func:`msn_serve.indexes.config.config_from_spec`; they give back stats dicts and :class:`SearchHits`. The policies
live here: a missing index is created with the defaults on the first add, ``k`` is capped at the index size, and the
number of queries and results is bounded before any work. A reader's reload swaps :attr:`IndexService.store`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from msn_serve.config import Settings, check_results
from msn_serve.embedding.service import Inputs
from msn_serve.errors import read_only_replica, too_large
from msn_serve.indexes.base import VectorIndex
from msn_serve.indexes.metadata import Texts
from msn_serve.indexes.store import IndexStore
from msn_serve.work import WorkPool

if TYPE_CHECKING:
    from msn_serve.embedding.models import ModelRegistry


@dataclass(frozen=True)
class SearchHits:
    """Nearest neighbours of each query: arrays (``-1`` ids pad rows with fewer hits) and stored metadata."""

    metric: str
    scores: np.ndarray  # (queries, k)
    ids: np.ndarray  # (queries, k) int64
    metadata: dict[int, str]  # id -> metadata JSON text, for the ids that have some


class IndexService:
    """The index store (swapped on a reader's reload) and what a caller may do with its indexes.

    Images sent to an index are embedded by the model that made it (``models``: the models served, by name and by
    model id), whichever model a request would otherwise use.
    """

    def __init__(self, settings: Settings, store: IndexStore, *, models: ModelRegistry, work: WorkPool,
                 read_only: bool):
        self.settings, self.store, self.read_only = settings, store, read_only
        self.models, self.work = models, work

    def get(self, name: str) -> VectorIndex:
        """The index named ``name`` (404 when there is none)."""
        return self.store.get(name)

    def describe(self) -> list[dict[str, Any]]:
        return self.store.describe()

    async def create(self, name: str, spec: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """Create an index bound to ``model`` (a name; the default model for None) with the options in ``spec``
        (the store fills in defaults, the width from that model); its stats."""
        info = self.models.get(model).info
        idx = await self.work.run(lambda: self.store.create(name, spec, model_id=info.model_id,
                                                            default_dim=info.embed_dim, feature=info.feature))
        return idx.stats()

    async def drop(self, name: str) -> None:
        await self.work.run(self.store.drop, name)  # the store refuses on a read-only replica

    async def add(self, name: str, ids: np.ndarray, inputs: Inputs, metadata: Texts | None) -> dict[str, Any]:
        """Add (or replace) vectors or embedded images under ``ids``; a missing index is created with the
        defaults (and the dimension of what was sent)."""
        if self.read_only:
            raise read_only_replica()
        idx = self.store.find(name)
        if idx is not None:
            self.store.bound(name)  # 409 before any embedding when no model served made it
        model = self.models.for_store("index", name, idx.cfg.model_id if idx is not None else None)
        dim = idx.cfg.dim if idx is not None else model.info.embed_dim
        with model.use():
            vecs = await model.embedding.vectors(inputs, "vectors", dim)
        if idx is None:
            idx = await self.work.run(lambda: self.store.create(name, {"dim": vecs.shape[1]}, exist_ok=True,
                                                                model_id=model.info.model_id,
                                                                feature=model.info.feature))
        out = await self.work.run(idx.add, ids, vecs, metadata)
        return {"name": name, **out, "ntotal": idx.ntotal}

    async def search(self, name: str, inputs: Inputs, *, k: int, nprobe: int | None = None,
                     ef_search: int | None = None) -> SearchHits:
        """The ``k`` nearest neighbours (``k`` capped at the index size) of each query image or vector (also for
        vectors sent as is: the index holds another model's vectors when its model differs, a 409)."""
        idx = self.store.bound(name)
        s = self.settings
        queries = inputs.count
        if queries > s.max_queries_per_search:
            raise too_large(f"{queries} query images exceed the limit of {s.max_queries_per_search} "
                            "(max_queries_per_search)")
        k = min(k, idx.ntotal)
        check_results(queries, k, s.max_results_per_request)
        model = self.models.for_store("index", name, idx.cfg.model_id)
        with model.use():
            vecs = await model.embedding.vectors(inputs, "vectors", idx.cfg.dim)
        scores, ids, texts = await self.work.run(idx.query, vecs, k, nprobe, ef_search)
        return SearchHits(metric=idx.cfg.metric, scores=scores, ids=ids, metadata=texts)

    async def remove(self, name: str, ids: np.ndarray) -> dict[str, Any]:
        if self.read_only:
            raise read_only_replica()
        idx = self.store.bound(name)
        out = await self.work.run(idx.remove, ids)
        return {"name": name, **out, "ntotal": idx.ntotal}
