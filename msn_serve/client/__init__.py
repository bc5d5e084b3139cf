"""A Python client for ``msn-serve``, shaped like the ``openai`` package: :class:`Client` and :class:`AsyncClient`
(the same calls, awaited), calls grouped by resource, ``openai``'s error names.

    from msn_serve.client import Client
    with Client() as client:                     # $MSN_BASE_URL (else http://127.0.0.1:8000), $MSN_API_KEY
        e = client.embeddings.create(["cat.png", "dog.png"], mask={"ratio": 0.7, "seed": 1})  # e.vectors (2, dim)
        client.indexes.add("pets", [1, 2], vectors=e.vectors)
        hits = client.indexes.search("pets", images="cat.png", k=2)                          # hits.ids, .scores

Images are file paths, file bytes, PIL images or uint8 arrays; masks are the server's specifications (or a patch
grid / kept indices as arrays); results are dataclasses with NumPy arrays; a failure is raised as an
:class:`APIError` (:class:`APIStatusError` with the server's ``status_code`` and ``message``, or
:class:`APIConnectionError`); busy answers are retried after ``Retry-After``, lost answers of idempotent calls with
backoff (``max_retries``). The package talks HTTP only and imports nothing else of ``msn_serve``: numpy, httpx,
and Pillow for PIL images and arrays (``pip install 'msn[client]'``).
"""
from __future__ import annotations

from msn_serve.client.aio import AsyncClient
from msn_serve.client.errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InsufficientStorageError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from msn_serve.client.options import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, NOT_GIVEN, NotGiven
from msn_serve.client.results import (
    Embeddings,
    Hit,
    IdList,
    IndexItem,
    IndexPage,
    LabelProbability,
    ModelCard,
    OpenAIEmbeddings,
    Predictions,
    ReadyStatus,
    SearchResult,
)
from msn_serve.client.sync import Client
from msn_serve.client.wire import multipart_body

__all__ = [
    "DEFAULT_MAX_RETRIES", "DEFAULT_TIMEOUT", "NOT_GIVEN", "APIConnectionError", "APIError", "APIStatusError",
    "APITimeoutError", "AsyncClient", "AuthenticationError", "BadRequestError", "Client", "ConflictError",
    "Embeddings", "Hit", "IdList", "IndexItem", "IndexPage", "InsufficientStorageError", "InternalServerError",
    "LabelProbability", "ModelCard", "NotFoundError", "NotGiven", "OpenAIEmbeddings", "PayloadTooLargeError",
    "PermissionDeniedError", "Predictions", "RateLimitError", "ReadyStatus", "SearchResult",
    "ServiceUnavailableError", "UnprocessableEntityError", "multipart_body",
]
