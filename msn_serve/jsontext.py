"""Compact, strict JSON text: what stored metadata, index files and response bodies are written as.

Kept outside :mod:`msn_serve.http` because the index store writes metadata with it too; parsing *client* JSON into
4xx errors stays in :mod:`msn_serve.http.jsonio`.
"""
from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # nesting accepted in stored values (metadata); far below the parser's recursion limit


def dumps(value: Any) -> str:
    """Compact, strict, ASCII-only JSON text (non-ASCII characters as ``\\u`` escapes, so its length is its size
    in bytes, which the metadata and response limits count); raises ``ValueError`` on NaN/infinity."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for x in v if isinstance(x, (list, dict)))
    return deepest
