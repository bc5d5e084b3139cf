"""Bodies of the responses whose size a client controls (search hits, top-k predictions, pages of predictions over
an index), written with a size cap from the plain results the services give back, and the strict JSON response class.

The number of results is checked by the services before any work (:func:`msn_serve.config.check_results`), and the
body is then written hit by hit into a :class:`~msn_serve.jsontext.BoundedJson`, which stops at ``max_response_mb``:
with metadata of up to ``max_metadata_bytes`` per hit, the count alone cannot bound the bytes. Every other response
is a :class:`StrictJSONResponse`.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.responses import JSONResponse

from msn_serve.jsontext import BoundedJson, dumps

if TYPE_CHECKING:  # the HTTP worker processes import this module: not the services
    from msn_serve.classifiers.label_loop import IndexPage


class StrictJSONResponse(JSONResponse):
    """FastAPI's JSON response, but never ``NaN``/``Infinity`` (a non-finite number is a bug, not output)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def number(x: float) -> str:
    """A JSON number; ``null`` for a non-finite one (strict JSON has no NaN)."""
    return repr(float(x)) if math.isfinite(x) else "null"


def search_body(head: dict, scores: np.ndarray, ids: np.ndarray, texts: dict[int, str], limit: int) -> bytes:
    """``{**head, "results": [[{"id", "score", "metadata"?}, ...], ...]}`` (``-1`` ids, FAISS' padding, skipped)."""
    out = BoundedJson(limit)
    out.write(dumps(head)[:-1] + (',"results":[' if head else '"results":['))
    for r, (srow, irow) in enumerate(zip(scores.tolist(), ids.tolist(), strict=True)):
        out.write("[" if r == 0 else ",[")
        first = True
        for score, i in zip(srow, irow, strict=True):
            if i < 0:
                continue
            text = texts.get(i)
            out.write(("" if first else ",") + f'{{"id":{i},"score":{number(score)}'
                      + (f',"metadata":{text}}}' if text is not None else "}"))
            first = False
        out.write("]")
    out.write("]}")
    return out.body()


def predictions_body(head: dict, classes: list[str], top: np.ndarray, prob: np.ndarray, limit: int) -> bytes:
    """``{**head, "predictions": [[{"label", "probability"}, ...], ...]}``."""
    labels = [dumps(c) for c in classes]
    out = BoundedJson(limit)
    out.write(dumps(head)[:-1] + (',"predictions":[' if head else '"predictions":['))
    for r, (trow, prow) in enumerate(zip(top.tolist(), prob.tolist(), strict=True)):
        out.write(("[" if r == 0 else ",[") + ",".join(
            f'{{"label":{labels[j]},"probability":{number(p)}}}' for j, p in zip(trow, prow, strict=True)) + "]")
    out.write("]}")
    return out.body()


def index_page_body(page: IndexPage, limit: int) -> bytes:
    """``{"name", "index", "total", ..., "class_counts", "items": [{"id", "label", "probability", "margin", "top",
    "metadata"?}, ...]}`` for one page of ``predict_index``."""
    head = {"name": page.name, "index": page.index, "total": page.total, "offset": page.offset, "limit": page.limit,
            "order": page.order, "next_offset": page.next_offset, "classes": page.classes,
            "class_counts": page.class_counts}
    labels = [dumps(c) for c in page.classes]
    out = BoundedJson(limit)
    out.write(dumps(head)[:-1] + ',"items":[')
    rows = zip(page.ids.tolist(), page.label.tolist(), page.probability, page.margin, page.top.tolist(),
               page.top_probability, strict=True)
    for r, (i, label, prob, margin, top, top_prob) in enumerate(rows):
        tops = ",".join(f'{{"label":{labels[j]},"probability":{number(p)}}}' for j, p in zip(top, top_prob,
                                                                                           strict=True))
        meta = page.metadata.get(i)
        out.write(("," if r else "") + f'{{"id":{i},"label":{labels[label]},"probability":{number(prob)},'
                  f'"margin":{number(margin)},"top":[{tops}]' + (f',"metadata":{meta}}}' if meta is not None else "}"))
    out.write("]}")
    return out.body()
