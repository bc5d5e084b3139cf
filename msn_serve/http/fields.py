"""Field types of the request models: bounded integers, matrices, id lists and metadata, and the mask's schema.

Each parser checks the count a client sends against its setting (413 naming it) before any element-wise work, then
the elements (422 naming the field, via pydantic). The settings arrive as validation context (``info.context``).
"""
from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, WithJsonSchema

from msn_serve.config import Settings
from msn_serve.errors import brief, too_large
from msn_serve.indexes.metadata import Texts
from msn_serve.jsontext import MAX_DEPTH, depth, dumps

MAX_ID = 2**63 - 1
F32_MAX = float(np.finfo(np.float32).max)
MATRIX_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "array", "items": {"type": "number"}}}
IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}}
MASK_DOC = ('{"ratio": 0.7, "seed": 1} | {"focal": {"size": [4, 4]}} | {"keep_idx": [...]} | {"bitmap": [[0/1]]} '
            "(1 = kept); or one per image (list). Seeded ratio masks are "
            "sort(numpy.random.default_rng(seed).permutation(N)[:K])")


def settings_of(info: ValidationInfo) -> Settings:
    return info.context["settings"]


def no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected an integer, not true/false")  # noqa: TRY004 - pydantic reports ValueErrors
    return value


Int = Annotated[int, BeforeValidator(no_bool)]


def int_in(lo: int, hi: int) -> Any:
    """An integer in ``[lo, hi]`` (not a boolean); the bounds come first so the JSON schema states them."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(no_bool)]

Mask = Annotated[Any, WithJsonSchema({"description": MASK_DOC})]


def _at_most_max_k(v: int, info: ValidationInfo) -> int:
    if v > settings_of(info).max_k:
        raise ValueError(f"at most {settings_of(info).max_k} (max_k)")
    return v


K = Annotated[int, BeforeValidator(no_bool), AfterValidator(_at_most_max_k)]


def count(value: Any, what: str, limit: int, setting: str) -> list:
    """A non-empty JSON list no longer than ``limit`` (413 naming ``setting`` beyond), checked before its items."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of {what}")
    if len(value) > limit:
        raise too_large(f"{len(value)} {what} exceed the limit of {limit} ({setting})")
    return value


def matrix(value: Any, limit: int, setting: str) -> np.ndarray | None:
    """Equal-length rows of finite numbers within float32 range -> float32 (n, d); ``None`` passes through."""
    if value is None:
        return None
    count(value, "vectors", limit, setting)
    if not all(isinstance(row, list) for row in value):
        raise ValueError("expected a list of vectors (lists of numbers)")
    try:
        rows = [np.asarray(row) for row in value]  # row by row: a parser thread hands back the GIL in between
        if any(r.dtype.kind not in "iufO" or r.ndim != 1 or len(r) != len(rows[0]) for r in rows):
            raise TypeError
        raw = np.stack(rows)
        arr = raw.astype(np.float64)  # object arrays hold ints too large for int64; 10**400 overflows here
    except OverflowError:
        raise ValueError("a number is too large to be a float (|x| <= 3.4e38)") from None
    except (TypeError, ValueError):
        raise ValueError("vectors must be equal-length lists of numbers") from None
    if arr.shape[1] < 1:
        raise ValueError("vectors must not be empty")
    if not np.isfinite(arr).all() or np.abs(arr).max() > F32_MAX:
        raise ValueError("vectors must hold finite numbers within the float32 range (|x| <= 3.4e38)")
    return arr.astype(np.float32)


def matrix_of(setting: str) -> Any:
    """A matrix field whose row count is bounded by the setting named ``setting`` (413 beyond)."""
    def check(value: Any, info: ValidationInfo) -> np.ndarray | None:
        return matrix(value, getattr(settings_of(info), setting), setting)

    return Annotated[Any, BeforeValidator(check), WithJsonSchema(MATRIX_SCHEMA)]


def ids(value: Any, limit: int) -> np.ndarray:
    count(value, "ids", limit, "max_vectors_per_request")
    if not all(type(i) is int and 0 <= i <= MAX_ID for i in value):
        bad = next(i for i in value if not (type(i) is int and 0 <= i <= MAX_ID))
        raise ValueError(f"ids must be integers in [0, {MAX_ID}], got {brief(bad)}")
    arr = np.asarray(value, dtype=np.int64)
    if np.unique(arr).size != arr.size:
        raise ValueError("ids contain duplicates")
    return arr


def metadata(value: Any, count_limit: int, byte_limit: int) -> Texts | None:
    """One JSON value (or null) per id, stored as compact JSON text no longer than ``byte_limit`` bytes."""
    if value is None:
        return None
    count(value, "metadata entries", count_limit, "max_vectors_per_request")
    out = Texts()
    for i, item in enumerate(value):
        if item is None:
            out.append(None)
            continue
        if depth(item) > MAX_DEPTH:
            raise ValueError(f"entry {i} is nested deeper than {MAX_DEPTH} levels")
        text = dumps(item)
        size = len(text.encode())
        if size > byte_limit:
            raise too_large(f"metadata[{i}]: {size} bytes of JSON exceed the limit of {byte_limit} per id "
                            "(max_metadata_bytes)")
        out.append(text)
    return out


Ids = Annotated[Any, BeforeValidator(lambda v, info: ids(v, settings_of(info).max_vectors_per_request)),
                WithJsonSchema(IDS_SCHEMA)]
