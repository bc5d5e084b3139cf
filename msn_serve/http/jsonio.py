"""Strict JSON in and out: parsing client text into 4xx errors, and responses that are always valid JSON.

Python's ``json`` module accepts ``NaN``/``Infinity``, raises ``RecursionError`` on deep nesting and ``ValueError`` on
integers longer than 4300 digits, and writes bare ``NaN`` that strict parsers reject. Every request body, multipart
field, OIP header and ``mask`` parameter is parsed by :func:`loads`, so all of these become a 4xx naming the field;
every response is written with ``allow_nan=False`` (compact text: :func:`msn_serve.jsontext.dumps`).
:class:`BoundedJson` writes large responses (search results) piece by piece and stops at a byte limit, so the size of
a response is checked before it is held in memory.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from msn_serve.errors import ApiError, too_large


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def loads(data: bytes | str, what: str, status: int = 422) -> Any:
    """Parse client JSON; any failure is an :class:`ApiError` with ``status`` naming ``what`` and the reason."""
    try:
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


class StrictJSONResponse(JSONResponse):
    """FastAPI's JSON response, but never ``NaN``/``Infinity`` (a non-finite number is a bug, not output)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


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
