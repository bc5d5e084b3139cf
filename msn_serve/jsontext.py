"""Strict JSON text, in and out: the one home of the service's JSON handling below the web framework.

Python's ``json`` module accepts ``NaN``/``Infinity``, raises ``RecursionError`` on deep nesting and ``ValueError`` on
integers longer than 4300 digits, and writes bare ``NaN`` that strict parsers reject. So:

* :func:`loads` parses every *client* text (request body, multipart field, OIP header, ``mask`` parameter); any
  failure becomes a 4xx naming the field and the reason. A text over :data:`YIELDING_ABOVE` bytes is parsed with
  Python-level number hooks: the C scanner never releases the GIL, but a Python call lets the interpreter hand the
  GIL to another thread every switch interval, so a large body parsed in a worker thread does not stall the event
  loop (about a third slower; docs/serving.md, "Where request parsing runs");
* :func:`dumps` writes compact, strict, ASCII-only text: stored metadata, index files and response bodies;
* :class:`BoundedJson` writes large responses (search results) piece by piece and stops at a byte limit, so the size
  of a response is checked before it is held in memory;
* :func:`depth` / :data:`MAX_DEPTH` bound the nesting of stored values.

It lives outside :mod:`msn_serve.http` because the index store writes metadata with it too; the HTTP response class
that renders with ``allow_nan=False`` is :class:`msn_serve.http.responses.StrictJSONResponse`.
"""
from __future__ import annotations

import json
from typing import Any

from msn_serve.errors import ApiError, too_large

MAX_DEPTH = 64  # nesting accepted in stored values (metadata); far below the parser's recursion limit
YIELDING_ABOVE = 1 << 20  # texts longer than this are parsed with the GIL-yielding number hooks


def _float(text: str) -> float:
    return float(text)  # a Python frame: the interpreter may switch threads here


def _int(text: str) -> int:
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def loads(data: bytes | str, what: str, status: int = 422) -> Any:
    """Parse client JSON; any failure is an :class:`ApiError` with ``status`` naming ``what`` and the reason."""
    try:
        if len(data) > YIELDING_ABOVE:
            return json.loads(data, parse_constant=_reject_constant, parse_float=_float, parse_int=_int)
        return json.loads(data, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        reason = f"{e.msg} at position {e.pos}"
    except UnicodeDecodeError:
        reason = "not UTF-8 text"
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as e:  # 4300+ digit integers, NaN/Infinity
        reason = str(e).split(";")[0]
    raise ApiError(status, f"{what}: not valid JSON ({reason})") from None


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


class BoundedJson:
    """Accumulates a JSON document as text pieces and refuses (413) once it would pass ``limit`` bytes.

    ``setting`` names the limit in the error, so a client knows which knob the operator can turn.
    """

    def __init__(self, limit: int, setting: str = "max_response_mb"):
        self.limit, self.setting = limit, setting
        self.parts: list[str] = []
        self.size = 0

    def write(self, text: str) -> None:
        self.size += len(text)  # characters; exact bytes for the ASCII text dumps() writes
        if self.size > self.limit:
            raise too_large(f"the response would exceed {self.limit} bytes ({self.setting}); ask for fewer "
                            "queries, a smaller k, or store less metadata per id")
        self.parts.append(text)

    def body(self) -> bytes:
        data = "".join(self.parts).encode()
        self.parts = []
        if len(data) > self.limit:
            raise too_large(f"the response would exceed {self.limit} bytes ({self.setting})")
        return data
