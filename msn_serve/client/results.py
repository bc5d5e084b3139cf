"""Typed results: what each endpoint answers, with vectors and ids as NumPy arrays.

Each result keeps the server's whole answer in ``raw`` (a dict), so fields added to the API later are reachable
before the client names them.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msn_serve.client.wire import Answer


def _keep(rows: list[list[int]] | None) -> list[np.ndarray] | None:
    return None if rows is None else [np.asarray(r, dtype=np.int64) for r in rows]


@dataclass
class Embeddings:
    """``/embed``: ``vectors`` (n, dim) float32; ``keep_idx`` (kept patch indices per image) for a masked request."""

    vectors: np.ndarray
    model_id: str
    normalized: bool
    kept_tokens: list[int]
    keep_idx: list[np.ndarray] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Embeddings:
        vectors = np.asarray(body["embeddings"], dtype=np.float32).reshape(len(body["embeddings"]), body["dim"])
        return cls(vectors, body["model_id"], bool(body["normalized"]), list(body["kept_tokens"]),
                   _keep(body.get("keep_idx")), {k: v for k, v in body.items() if k != "embeddings"})

    @classmethod
    def from_binary(cls, answer: Answer) -> Embeddings:
        """The ``Accept: application/octet-stream`` answer: row-major little-endian float32, shape in a header."""
        if answer.headers.get("content-type", "").startswith("application/json"):
            return cls.from_json(json.loads(answer.content))
        n, dim = (int(x) for x in answer.headers["x-embedding-shape"].split(","))
        kept = answer.headers.get("x-kept-tokens", "")
        vectors = np.frombuffer(answer.content, dtype="<f4").reshape(n, dim).astype(np.float32)
        return cls(vectors, answer.headers.get("x-model-id", ""), answer.headers.get("x-normalized") == "true",
                   [int(k) for k in kept.split(",")] if kept else [], None, dict(answer.headers))


@dataclass
class OpenAIEmbeddings:
    """``/v1/embeddings``: ``vectors`` (n, dim) float32 in input order, ``model`` and ``prompt_tokens``
    (kept patches summed over the inputs)."""

    vectors: np.ndarray
    model: str
    prompt_tokens: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> OpenAIEmbeddings:
        rows = sorted(body["data"], key=lambda d: d["index"])
        vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if isinstance(d["embedding"], str)
                else np.asarray(d["embedding"], dtype=np.float32) for d in rows]
        return cls(np.stack(vecs).astype(np.float32), body["model"], int(body["usage"]["prompt_tokens"]),
                   {k: v for k, v in body.items() if k != "data"})


@dataclass
class Hit:
    id: int
    score: float
    metadata: Any = None


@dataclass
class SearchResult:
    """``/index/{name}/search``: ``hits[i]`` are query i's neighbours, best first (fewer than k when the index
    holds fewer items). ``ids`` / ``scores``: the same as (n, k) arrays padded with -1 / NaN."""

    hits: list[list[Hit]]
    metric: str
    k: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> SearchResult:
        hits = [[Hit(int(h["id"]), float("nan") if h["score"] is None else float(h["score"]), h.get("metadata"))
                 for h in row] for row in body["results"]]
        return cls(hits, body["metric"], int(body["k"]), {k: v for k, v in body.items() if k != "results"})

    @property
    def ids(self) -> np.ndarray:
        width = max((len(r) for r in self.hits), default=0)
        out = np.full((len(self.hits), width), -1, dtype=np.int64)
        for i, row in enumerate(self.hits):
            out[i, : len(row)] = [h.id for h in row]
        return out

    @property
    def scores(self) -> np.ndarray:
        width = max((len(r) for r in self.hits), default=0)
        out = np.full((len(self.hits), width), np.nan, dtype=np.float32)
        for i, row in enumerate(self.hits):
            out[i, : len(row)] = [h.score for h in row]
        return out


@dataclass
class LabelProbability:
    label: str
    probability: float


@dataclass
class Predictions:
    """``/fewshot/{name}/predict``: ``top[i]`` are image i's top-k labels, most probable first."""

    top: list[list[LabelProbability]]
    name: str
    model_id: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Predictions:
        top = [[LabelProbability(p["label"], float(p["probability"])) for p in row] for row in body["predictions"]]
        return cls(top, body.get("name", ""), body.get("model_id", ""),
                   {k: v for k, v in body.items() if k != "predictions"})

    @property
    def labels(self) -> list[str]:
        """The most probable label of each image."""
        return [row[0].label for row in self.top]

    @property
    def probabilities(self) -> np.ndarray:
        """The top label's probability for each image."""
        return np.asarray([row[0].probability for row in self.top], dtype=np.float32)


@dataclass
class IndexItem:
    """One stored item's prediction in a ``predict_index`` page (``margin``: top-1 minus top-2 probability)."""

    id: int
    label: str
    probability: float
    margin: float
    top: list[LabelProbability]
    metadata: Any = None


@dataclass
class IndexPage:
    """``/fewshot/{name}/predict_index``: one page of items, the class counts over the whole index, and the
    ``next_offset`` to ask for (``None`` after the last page)."""

    items: list[IndexItem]
    total: int
    next_offset: int | None
    class_counts: dict[str, int]
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> IndexPage:
        items = [IndexItem(int(it["id"]), it["label"], float(it["probability"]), float(it["margin"]),
                           [LabelProbability(p["label"], float(p["probability"])) for p in it["top"]],
                           it.get("metadata")) for it in body["items"]]
        return cls(items, int(body["total"]), body.get("next_offset"), dict(body.get("class_counts") or {}),
                   {k: v for k, v in body.items() if k != "items"})

    @property
    def ids(self) -> np.ndarray:
        return np.asarray([it.id for it in self.items], dtype=np.int64)


@dataclass
class IdList:
    """``select`` / ``suggest``: the ids to label, in order (``uncertainty`` for ``suggest``)."""

    ids: np.ndarray
    available: int
    uncertainty: np.ndarray | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> IdList:
        unc = body.get("uncertainty")
        return cls(np.asarray(body["ids"], dtype=np.int64), int(body.get("available", 0)),
                   None if unc is None else np.asarray(unc, dtype=np.float64), body)


@dataclass
class ReadyStatus:
    """``/readyz``: ``ready`` and the rest of the answer (precision, device, runtime, ...)."""

    ready: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ReadyStatus:
        return cls(bool(body.get("ready")), body)


@dataclass
class ModelCard:
    """``/v1/models``: ``id`` is the served name (what ``model=`` takes), ``model_id`` the bundle's model id (what a
    store records), ``created`` when the bundle's ``msn.json`` was written (Unix seconds)."""

    id: str
    model_id: str
    created: int
    owned_by: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ModelCard:
        return cls(body["id"], body.get("model_id", body["id"]), int(body.get("created", 0)),
                   body.get("owned_by", ""), body)
