"""One path for every embedding route: ``POST /embed``, ``POST /v1/embeddings`` and OIP ``/v2/models/{m}/infer``.

Each route reads its request its own way (multipart or JSON, OpenAI's fields, OIP tensors), then hands an
:class:`Embedder` its *preparation*: a function that, given the facts of the model that will embed
(:class:`~msn_core.bundle.BundleInfo`) and a decoder, returns the items the batcher takes. Encoded images are
decoded, cropped and normalised (:func:`msn_serve.embedding.preprocess.preprocess_bytes`) and their masks resolved to
kept patches on that model's grid; OIP's ``pixel_values`` already are the graph's input and are only checked. Either
way an item is ``(float32 (C, H, W) normalised, kept patch indices)``: the one form the batcher takes.

Where the preparation and the engine run is the embedder's business, not the route's:

- :class:`LocalEmbedder` (one process): both here, the model held (:meth:`ServedModel.use`) from the preparation to
  the answer, decoding in the model's own pool;
- :class:`msn_serve.workers.prepare.LinkEmbedder` (``--http-workers``): the preparation in the HTTP process, the
  images written to its ring in shared memory, the engine in the engine process; crops prepared for a model replaced
  meanwhile by one that prepares otherwise are prepared again.

So the three routes answer the same bits, with the same errors, with HTTP worker processes or without.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from msn_core.bundle import BundleInfo
from msn_serve.config import Settings
from msn_serve.embedding.models import ModelLookups

if TYPE_CHECKING:  # the HTTP worker processes import this module: not the runtime
    from msn_serve.runtime import Runtime

Items = list[tuple[np.ndarray, np.ndarray]]  # (float32 (C, H, W) normalised pixels, kept patch indices) per image
Decode = Callable[[list[tuple[str, bytes]]], Awaitable[list[np.ndarray]]]  # (name, file bytes) -> pixels, in order
Prepare = Callable[[BundleInfo, Decode], Awaitable[Items]]


@dataclass(frozen=True)
class Embedded:
    """What a route answers with: the id of the model that embedded, its embeddings, and the items it prepared."""

    model_id: str
    embeddings: np.ndarray
    items: Items

    @property
    def embed_dim(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def keeps(self) -> list[np.ndarray]:
        return [keep for _, keep in self.items]


class Embedder:
    """Where an embedding route's images are prepared and embedded."""

    settings: Settings

    @property
    def models(self) -> ModelLookups:
        """The models served, as a route looks one up (404 for an unknown name)."""
        raise NotImplementedError

    def count_error(self, kind: str) -> None:
        """Count an error of ``kind`` in ``msn_errors_total``."""
        raise NotImplementedError

    async def embed(self, name: str, prepare: Prepare, *, status: int) -> Embedded:
        """Prepare for the model served as ``name`` and embed; ``status`` answers non-finite embeddings."""
        raise NotImplementedError


class LocalEmbedder(Embedder):
    """One process: the runtime's own models."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.settings = runtime.settings

    @property
    def models(self) -> ModelLookups:
        return self.runtime.models

    def count_error(self, kind: str) -> None:
        self.runtime.metrics.errors.labels(kind).inc()

    async def embed(self, name: str, prepare: Prepare, *, status: int) -> Embedded:
        model = self.runtime.models.get(name)
        with model.use():
            items = await prepare(model.info, model.embedding.preprocess)
            emb = await model.embedding.embed_items(items, status=status)
        return Embedded(model.info.model_id, emb, items)
