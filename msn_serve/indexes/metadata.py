"""Per-id metadata of an index, held as compact JSON text.

Text rather than parsed values: a JSON document costs several times its size as Python objects, its size is known
exactly (the per-index limit is a sum of lengths), and a search response embeds it as is (``BoundedJson``) instead of
serialising it again. On disk the snapshot keeps its format (``{"seq": n, "metadata": {"id": value}}``), written by
joining the texts.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from msn_serve.jsontext import dumps


class Texts(list):
    """Metadata already checked and serialised by the request model: one JSON text (or ``None``) per id."""


def to_texts(values: list | None, count: int) -> Texts | None:
    """Metadata as given (``Texts``, or JSON values from in-process callers) -> ``Texts``; ``ValueError`` if the
    count is wrong."""
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != count:
        raise ValueError("metadata must be a JSON list with one entry (or null) per id")
    return values if isinstance(values, Texts) else Texts(None if v is None else dumps(v) for v in values)


class Metadata:
    def __init__(self, texts: dict[int, str] | None = None):
        self._texts: dict[int, str] = dict(texts or {})
        self.nbytes = sum(len(t.encode()) for t in self._texts.values())

    @classmethod
    def coerce(cls, values: Metadata | dict[int, Any] | None) -> Metadata:
        """A :class:`Metadata` from itself or from ``{id: JSON value}`` (as read from a snapshot)."""
        if isinstance(values, Metadata):
            return values
        return cls({int(k): dumps(v) for k, v in (values or {}).items() if v is not None})

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, i: int) -> bool:
        return i in self._texts

    def text(self, i: int) -> str | None:
        return self._texts.get(i)

    def value(self, i: int) -> Any:
        """The parsed value (in-process callers and tests); ``None`` when the id has none."""
        t = self._texts.get(i)
        return None if t is None else json.loads(t)

    def size_after(self, ids: Iterable[int], texts: Iterable[str | None] | None) -> int:
        """Total bytes once ``ids`` get ``texts`` (``None`` = no metadata), without changing anything."""
        total = self.nbytes
        for i, t in zip(ids, texts if texts is not None else _nones(), strict=False):
            old = self._texts.get(i)
            total += (len(t.encode()) if t is not None else 0) - (len(old.encode()) if old is not None else 0)
        return total

    def put(self, i: int, text: str | None) -> None:
        self.drop(i)
        if text is not None:
            self._texts[i] = text
            self.nbytes += len(text.encode())

    def drop(self, i: int) -> None:
        old = self._texts.pop(i, None)
        if old is not None:
            self.nbytes -= len(old.encode())

    def to_json(self) -> str:
        """``{"id": value, ...}`` as JSON text (keys are strings, as JSON requires)."""
        return "{" + ",".join(f'"{i}":{t}' for i, t in self._texts.items()) + "}"


def _nones():
    while True:
        yield None
