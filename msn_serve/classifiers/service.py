"""Few-shot classifiers as a service: fit (in the fit pool), predict, list/delete, and the label loop.

Methods take names, arrays and :class:`~msn_serve.embedding.service.Inputs` and give back classifiers, arrays and
dicts; blocking work (stores, FAISS, numpy over many rows) runs in the shared :class:`~msn_serve.work.WorkPool`. The
label loop reads the indexes through the :class:`~msn_serve.indexes.service.IndexService` at call time, so a reader's
reload (which swaps both stores) is seen by the next call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from msn_serve.classifiers import label_loop
from msn_serve.classifiers.fewshot import ClassifierStore, FewShotClassifier, check_fit_data, from_fit
from msn_serve.classifiers.fitpool import FitPool
from msn_serve.config import Settings, check_results
from msn_serve.embedding.service import Inputs
from msn_serve.errors import conflict, read_only_replica, unprocessable
from msn_serve.indexes.base import VectorIndex
from msn_serve.indexes.service import IndexService
from msn_serve.metrics import Metrics
from msn_serve.work import WorkPool

if TYPE_CHECKING:
    from msn_serve.embedding.models import ModelRegistry


@dataclass(frozen=True)
class Predictions:
    """Top-k classes of each query, most probable first."""

    classes: list[str]
    top: np.ndarray  # (n, k') indices into classes
    probability: np.ndarray  # (n, k')


class ClassifierService:
    """The classifier store (swapped on a reader's reload), the fit pool and the label loop's prediction cache.

    A classifier is fitted on one model's embeddings (the ``model`` of the fit, or the model of the index its ids
    come from) and records that model's id; its predictions embed images with that model, whichever model a request
    would otherwise use, and the label loop refuses an index of another model (409).
    """

    def __init__(self, settings: Settings, store: ClassifierStore, *, models: ModelRegistry,
                 indexes: IndexService, work: WorkPool, metrics: Metrics, read_only: bool):
        self.settings, self.store, self.read_only = settings, store, read_only
        self.models, self.indexes, self.work = models, indexes, work
        self.fits = FitPool(workers=settings.fit_workers, max_queued=settings.max_queued_fits,
                            timeout_s=settings.fit_timeout_s, threads=settings.fit_threads,
                            on_change=metrics.fits.set)
        self.predictions = label_loop.PredictionCache()

    def close(self) -> None:
        self.fits.close()

    # ---- the store ---------------------------------------------------------------------------------------------
    def get(self, name: str) -> FewShotClassifier:
        """The classifier named ``name`` (404 when there is none)."""
        return self.store.get(name)

    def describe(self) -> list[dict[str, Any]]:
        return self.store.describe()

    async def delete(self, name: str) -> None:
        await self.work.run(self.store.delete, name)  # the store refuses on a read-only replica

    # ---- fit and predict ---------------------------------------------------------------------------------------
    async def fit(self, name: str, labels: list[str], inputs: Inputs, *, lambd: float | None = None,
                  overwrite: bool = False, index: str | None = None, ids: np.ndarray | None = None,
                  model: str | None = None) -> FewShotClassifier:
        """Fit (in a worker process) and store a classifier on images, vectors, or the stored vectors of ``ids``
        of ``index``, one label each; ``lambd`` defaults to the settings' (the low-shot protocol's). It is bound to
        ``model`` (a name; the default model for None), or to the model of ``index``."""
        if self.read_only:
            raise read_only_replica()
        s = self.settings
        self.store.check_free(name, overwrite=overwrite)  # before the embedding and fitting work
        if index is not None:  # the label loop: the stored vectors of ids of an index
            if inputs.images:
                raise unprocessable("send either index + ids or images, not both")
            if len(labels) != len(ids):
                raise unprocessable(f"{len(labels)} labels for {len(ids)} ids")
            idx = self.indexes.store.bound(index)
            model_id = idx.cfg.model_id or self.models.default.info.model_id
            if model is not None and self.models.get(model).info.model_id != model_id:
                raise conflict(f"index {index!r} holds model {model_id!r}'s vectors, not model {model!r}'s: "
                               "leave model out to fit on the index's model")
            x = await self.work.run(label_loop.fit_vectors, self.indexes.store, index, ids)
        elif len(labels) != inputs.count:
            raise unprocessable(f"{len(labels)} labels for {inputs.count} images/embeddings")
        else:
            served = self.models.get(model)
            model_id = served.info.model_id
            with served.use():
                x = await served.embedding.vectors(inputs, "embeddings", served.info.embed_dim)
        await self.work.run(lambda: check_fit_data(x, labels, max_classes=s.max_fit_classes))
        lambd = lambd if lambd is not None else s.default_lambd
        fitted = await self.fits.fit(x, labels, lambd=lambd)
        clf = from_fit(name, fitted, labels, dim=int(x.shape[1]), lambd=lambd, seconds=fitted.fit_seconds)
        clf.info["model_id"] = model_id
        if index is not None:
            clf.info["index"], clf.fit_ids = index, ids
        await self.work.run(lambda: self.store.put(clf, overwrite=overwrite))
        return clf

    async def predict(self, name: str, inputs: Inputs, k: int) -> Predictions:
        """Top-``k`` classes (capped at the class count) of each image or vector."""
        clf = self.store.bound(name)  # 409 when fitted on the embeddings of a model not served
        check_results(inputs.count, min(k, len(clf.classes)), self.settings.max_results_per_request)
        served = self.models.for_store("classifier", name, clf.info.get("model_id"))
        with served.use():
            x = await served.embedding.vectors(inputs, "embeddings", served.info.embed_dim)
        top, prob = await self.work.run(clf.top_k, x, k)
        return Predictions(classes=clf.classes, top=top, probability=prob)

    # ---- the label loop (msn_serve.classifiers.label_loop) -----------------------------------------------------
    async def select(self, index: str, *, n: int, strategy: str, seed: int,
                     exclude_ids: np.ndarray | None) -> dict[str, Any]:
        """What to label first: ``n`` diverse, representative ids of ``index``."""
        return await self.work.run(lambda: label_loop.select(
            self.indexes.store, index, n=n, strategy=strategy, seed=seed, exclude_ids=exclude_ids,
            candidates=self.settings.select_candidates))

    async def suggest(self, name: str, *, index: str, n: int, strategy: str, seed: int,
                      exclude_ids: np.ndarray | None) -> dict[str, Any]:
        """The next ids of ``index`` to label for classifier ``name``."""
        clf = self.store.bound(name)
        self._same_model(clf, self.indexes.store.bound(index))
        return await self.work.run(lambda: label_loop.suggest(
            self.indexes.store, clf, index=index, n=n, strategy=strategy, seed=seed, exclude_ids=exclude_ids,
            candidates=self.settings.select_candidates))

    async def predict_index(self, name: str, *, index: str, offset: int, limit: int | None, k: int,
                            order: str) -> label_loop.IndexPage:
        """One page of classifier ``name``'s predictions over the items of ``index``."""
        clf, s = self.store.bound(name), self.settings
        self._same_model(clf, self.indexes.store.bound(index))
        return await self.work.run(lambda: label_loop.predict_index(
            self.indexes.store, clf, self.predictions, index=index, offset=offset, limit=limit, k=k, order=order,
            max_page=s.max_page, max_results=s.max_results_per_request))

    def _same_model(self, clf: FewShotClassifier, idx: VectorIndex) -> None:
        """409 when a classifier and an index hold different models' vectors (both served, so neither check on
        its own refuses them); a store that recorded no model is taken as the default model's."""
        default = self.models.default.info.model_id
        fitted, stored = clf.info.get("model_id") or default, idx.cfg.model_id or default
        if fitted != stored:
            raise conflict(f"classifier {clf.name!r} was fitted on model {fitted!r}'s embeddings but index "
                           f"{idx.name!r} holds model {stored!r}'s vectors: use an index of the same model")
