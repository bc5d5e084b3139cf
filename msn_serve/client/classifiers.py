"""``client.classifiers``: few-shot classifiers (``/fewshot/...``) and the label loop's next picks."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from msn_serve.client.options import NOT_GIVEN, NotGiven, Timeout
from msn_serve.client.resource import Resource, Rows, as_is
from msn_serve.client.results import IdList, IndexPage, Predictions
from msn_serve.client.wire import (
    Images,
    MaskInput,
    id_list,
    image_call,
    images_or_vectors,
    json_call,
    mask_spec,
    matrix,
    quoted,
)


class ClassifiersAPI(Resource):
    def fit(self, name: str, labels: Sequence[Any], *, images: Images | None = None, embeddings: Any = None,
            index: str | None = None, ids: Any = None, lambd: float | None = None, overwrite: bool = False,
            mask: MaskInput = None, model: str | None = None,
            timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``POST /fewshot/fit``: a classifier from labelled images, embeddings, or ``index`` + ``ids`` of stored
        items (one label each); ``{"name", "classes", "n", "dim", ...}``. Retried after a lost answer only with
        ``overwrite=True`` (a second fit of the same name is otherwise a 409)."""
        if index is None and ids is None:
            imgs = images_or_vectors(images, embeddings, "embeddings")
        elif images is not None or embeddings is not None:
            raise ValueError("send either index + ids or images/embeddings")
        else:
            imgs = []
        fields = {"name": name, "labels": list(labels), "embeddings": matrix(embeddings), "index": index,
                  "ids": id_list(ids), "lambd": lambd, "overwrite": True if overwrite else None,
                  "mask": mask_spec(mask), "model": self._model(model)}
        return self._do(image_call("POST", "/fewshot/fit", as_is, imgs, fields,
                                   text_fields=("name", "index", "model"), idempotent=overwrite, timeout=timeout))

    def predict(self, name: str, *, images: Images | None = None, embeddings: Any = None, k: int = 5,
                mask: MaskInput = None, timeout: Timeout | NotGiven = NOT_GIVEN) -> Predictions:
        """``POST /fewshot/{name}/predict``: the top-``k`` labels of each image or embedding."""
        imgs = images_or_vectors(images, embeddings, "embeddings")
        fields = {"embeddings": matrix(embeddings), "k": k, "mask": mask_spec(mask)}
        return self._do(image_call("POST", f"/fewshot/{quoted(name)}/predict", Predictions.from_json, imgs,
                                   fields, timeout=timeout))

    def list(self, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> Rows:
        """``GET /fewshot``."""
        return self._do(json_call("GET", "/fewshot", lambda body: body["classifiers"], timeout=timeout))

    def retrieve(self, name: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``GET /fewshot/{name}``: classes, sample count, lambda, model id."""
        return self._do(json_call("GET", f"/fewshot/{quoted(name)}", as_is, timeout=timeout))

    def delete(self, name: str, *, timeout: Timeout | NotGiven = NOT_GIVEN) -> dict[str, Any]:
        """``DELETE /fewshot/{name}``."""
        return self._do(json_call("DELETE", f"/fewshot/{quoted(name)}", as_is, timeout=timeout))

    def suggest(self, name: str, index: str, *, n: int = 20, strategy: str = "margin", seed: int = 0,
                exclude_ids: Any = None, timeout: Timeout | NotGiven = NOT_GIVEN) -> IdList:
        """``POST /fewshot/{name}/suggest``: what to label next in ``index`` (uncertain, diverse, never the fitted
        ids)."""
        fields = {"index": index, "n": n, "strategy": strategy, "seed": seed, "exclude_ids": id_list(exclude_ids)}
        return self._do(json_call("POST", f"/fewshot/{quoted(name)}/suggest", IdList.from_json, fields,
                                  timeout=timeout))

    def predict_index(self, name: str, index: str, *, offset: int = 0, limit: int | None = None, k: int = 3,
                      order: Literal["id", "uncertain"] = "id",
                      timeout: Timeout | NotGiven = NOT_GIVEN) -> IndexPage:
        """``POST /fewshot/{name}/predict_index``: one page of predictions over ``index``'s items (ask again with
        ``offset=page.next_offset`` until it is ``None``)."""
        fields = {"index": index, "offset": offset, "limit": limit, "k": k, "order": order}
        return self._do(json_call("POST", f"/fewshot/{quoted(name)}/predict_index", IndexPage.from_json, fields,
                                  timeout=timeout))
