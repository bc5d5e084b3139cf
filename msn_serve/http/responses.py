"""Bodies of the responses whose size a client controls (search hits, top-k predictions), written with a size cap.

The number of results is checked before any work (``queries x k`` against ``max_results_per_request``), and the body
is then written hit by hit into a :class:`~msn_serve.http.jsonio.BoundedJson`, which stops at ``max_response_mb``: with
metadata of up to ``max_metadata_bytes`` per hit, the count alone cannot bound the bytes.
"""
from __future__ import annotations

import math

import numpy as np

from msn_serve.errors import too_large
from msn_serve.http.jsonio import BoundedJson, dumps


def check_results(queries: int, k: int, limit: int) -> None:
    """413 when ``queries`` x ``k`` results (k already capped at what exists) exceed ``limit``."""
    if queries * k > limit:
        raise too_large(f"{queries} queries x k={k} = {queries * k} results exceed the limit of {limit} "
                        "(max_results_per_request); send fewer queries or a smaller k")


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
