"""A Python client for ``msn-serve``: every endpoint, sync (:class:`Client`) and async (:class:`AsyncClient`).

    from msn_serve.client import Client
    with Client("http://localhost:8000", api_key=None) as c:
        e = c.embed(["cat.png", "dog.png"], mask={"ratio": 0.7, "seed": 1})   # e.vectors: (2, dim) float32
        c.add("pets", [1, 2], vectors=e.vectors)
        hits = c.search("pets", images="cat.png", k=2)                       # hits.ids, hits.scores

Images are file paths, file bytes, PIL images or uint8 arrays; masks are the server's specifications (or a patch
grid / kept indices as arrays); results are dataclasses with NumPy arrays; a failure the server reports is raised as
a :class:`ClientError` subclass carrying its status and message; a 503 is retried after its ``Retry-After``
(:class:`RetryPolicy`). The package talks to the server over HTTP only and imports nothing else of ``msn_serve``
(numpy, httpx, and Pillow for PIL images and arrays).
"""
from __future__ import annotations

from msn_serve.client.aio import AsyncClient
from msn_serve.client.errors import (
    APIStatusError,
    AuthenticationError,
    BadRequest,
    ClientError,
    Conflict,
    InsufficientStorage,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ServerError,
    ServiceUnavailable,
    TransportError,
    UnprocessableEntity,
)
from msn_serve.client.results import (
    Embeddings,
    Hit,
    IdList,
    IndexItem,
    IndexPage,
    LabelProbability,
    OpenAIEmbeddings,
    Predictions,
    ReadyStatus,
    SearchResult,
)
from msn_serve.client.retry import NO_RETRY, RetryPolicy
from msn_serve.client.sync import Client
from msn_serve.client.wire import multipart_body

__all__ = [
    "NO_RETRY", "APIStatusError", "AsyncClient", "AuthenticationError", "BadRequest", "Client", "ClientError",
    "Conflict", "Embeddings", "Hit", "IdList", "IndexItem", "IndexPage", "InsufficientStorage", "LabelProbability",
    "NotFound", "OpenAIEmbeddings", "PayloadTooLarge", "PermissionDenied", "Predictions", "ReadyStatus",
    "RetryPolicy", "SearchResult", "ServerError", "ServiceUnavailable", "TransportError", "UnprocessableEntity",
    "multipart_body",
]
