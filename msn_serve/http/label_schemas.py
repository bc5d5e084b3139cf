"""Request models of the label loop (``select``, ``suggest``, ``predict_index``), in the style of
:mod:`msn_serve.http.schemas`: counts bounded by settings answer 413 naming the setting, wrong types 422."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, WithJsonSchema, field_validator

from msn_serve.errors import NAME_RE, too_large
from msn_serve.http.fields import MAX_ID, K, ids, no_bool, settings_of
from msn_serve.http.schemas import RequestModel


# ---- the label loop ---------------------------------------------------------------------------------------------
def _at_most(setting: str) -> Any:
    """A count no larger than the setting named ``setting`` (413 naming it beyond)."""
    def check(v: int, info: ValidationInfo) -> int:
        limit = getattr(settings_of(info), setting)
        if v > limit:
            raise too_large(f"{v} exceeds the limit of {limit} ({setting})")
        return v

    return AfterValidator(check)


def optional_ids(value: Any, limit: int) -> np.ndarray:
    """Like :func:`ids`, but an empty list (nothing to exclude) is fine."""
    if isinstance(value, list) and not value:
        return np.zeros(0, dtype=np.int64)
    return ids(value, limit)


Seed = Annotated[int, Field(ge=0, le=2**32 - 1), BeforeValidator(no_bool)]
IndexName = Annotated[str, Field(description=f"index name, matching {NAME_RE.pattern}")]
ExcludeIds = Annotated[Any, BeforeValidator(lambda v, info: optional_ids(v, settings_of(info).max_vectors_per_request)),
                       WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": 0}})]


def _index_name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(f"must match {NAME_RE.pattern} (the whole name)")
    return v


class SelectRequest(RequestModel):
    """``POST /index/{name}/select``: what to label first."""

    IMAGES: ClassVar[bool] = False
    n: Annotated[int, Field(ge=1), BeforeValidator(no_bool), _at_most("max_select")] = Field(
        20, description="items to select (at most max_select; capped at the items available)")
    strategy: Literal["typical", "kmeans", "kcenter", "random"] = Field(
        "typical", description="typical = most typical item of each of the n largest k-means clusters (default); "
                               "kmeans = nearest to each centroid; kcenter = farthest-first; random = uniform")
    seed: Seed = Field(0, description="same seed + same index = same ids")
    exclude_ids: ExcludeIds = Field(None, description="ids already labelled: never selected, and their clusters "
                                                      "count as covered")


class SuggestRequest(RequestModel):
    """``POST /fewshot/{name}/suggest``: the next items to label for a fitted classifier."""

    IMAGES: ClassVar[bool] = False
    index: IndexName
    n: Annotated[int, Field(ge=1), BeforeValidator(no_bool), _at_most("max_select")] = Field(
        20, description="suggestions (at most max_select; capped at the unlabelled items available)")
    strategy: Literal["margin", "entropy", "typical", "random"] = Field(
        "margin", description="margin/entropy = most uncertain, one per k-means group of the uncertain items "
                              "(default margin); typical = the cold-start selector; random = uniform")
    seed: Seed = 0
    exclude_ids: ExcludeIds = Field(None, description="further ids to skip (the fit's ids are always skipped)")

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        return _index_name(v)


class PredictIndexRequest(RequestModel):
    """``POST /fewshot/{name}/predict_index``: predictions for the stored items of an index, one page at a time."""

    IMAGES: ClassVar[bool] = False
    index: IndexName
    offset: Annotated[int, Field(ge=0, le=MAX_ID), BeforeValidator(no_bool)] = 0
    limit: Annotated[int, Field(ge=1), BeforeValidator(no_bool), _at_most("max_page")] | None = Field(
        None, description="items in this page (default 1000; at most max_page)")
    k: K = Field(3, ge=1, description="top-k labels per item (capped at the class count; limit x k at most "
                                      "max_results_per_request)")
    order: Literal["id", "uncertain"] = Field("id", description="id = ascending ids; uncertain = least certain "
                                                                "(smallest top-2 margin) first")

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        return _index_name(v)
