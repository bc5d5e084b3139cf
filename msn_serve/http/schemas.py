"""Request models: one pydantic model per endpoint, filled from a JSON body or from multipart fields.

Types, ranges and the configurable limits (``Settings``, passed as validation context) live here and nowhere else;
the OpenAPI request bodies are generated from the same models (:meth:`RequestModel.openapi_body`). Limits that bound
what a request makes the server hold (rows, ids, metadata bytes) are checked *before* element-wise work and answer
413 naming the setting; wrong types and ranges answer 422 naming the field. A new endpoint is a new model here, a
route and a :class:`~msn_serve.service.Service` method.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from msn_serve.config import Settings
from msn_serve.errors import NAME_RE, ApiError, brief, too_large, unprocessable
from msn_serve.http.jsonio import MAX_DEPTH, depth, dumps, loads
from msn_serve.indexes.metadata import Texts

MAX_ID = 2**63 - 1
F32_MAX = float(np.finfo(np.float32).max)
MATRIX_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "array", "items": {"type": "number"}}}
IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}}
MASK_DOC = ('{"ratio": 0.7, "seed": 1} | {"focal": {"size": [4, 4]}} | {"keep_idx": [...]} | {"bitmap": [[0/1]]} '
            "(1 = kept); or one per image (list). Seeded ratio masks are "
            "sort(numpy.random.default_rng(seed).permutation(N)[:K])")


def _settings(info: ValidationInfo) -> Settings:
    return info.context["settings"]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected an integer, not true/false")  # noqa: TRY004 - pydantic reports ValueErrors
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]


def int_in(lo: int, hi: int) -> Any:
    """An integer in ``[lo, hi]`` (not a boolean); the bounds come first so the JSON schema states them."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_no_bool)]

Mask = Annotated[Any, WithJsonSchema({"description": MASK_DOC})]


def _at_most_max_k(v: int, info: ValidationInfo) -> int:
    if v > _settings(info).max_k:
        raise ValueError(f"at most {_settings(info).max_k} (max_k)")
    return v


K = Annotated[int, BeforeValidator(_no_bool), AfterValidator(_at_most_max_k)]


def _count(value: Any, what: str, limit: int, setting: str) -> list:
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
    _count(value, "vectors", limit, setting)
    if not all(isinstance(row, list) for row in value):
        raise ValueError("expected a list of vectors (lists of numbers)")
    try:
        raw = np.asarray(value)
        if raw.dtype.kind not in "iufO" or raw.ndim != 2:
            raise TypeError
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
        return matrix(value, getattr(_settings(info), setting), setting)

    return Annotated[Any, BeforeValidator(check), WithJsonSchema(MATRIX_SCHEMA)]


def ids(value: Any, limit: int) -> np.ndarray:
    _count(value, "ids", limit, "max_vectors_per_request")
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
    _count(value, "metadata entries", count_limit, "max_vectors_per_request")
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


Ids = Annotated[Any, BeforeValidator(lambda v, info: ids(v, _settings(info).max_vectors_per_request)),
                WithJsonSchema(IDS_SCHEMA)]


class RequestModel(BaseModel):
    """Base of the request models: unknown fields are refused, images ride along outside the fields."""

    model_config = ConfigDict(extra="forbid")
    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset()  # multipart text taken as-is (not parsed as JSON)
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset()  # multipart text that must be JSON (lists, objects)
    QUERY: ClassVar[tuple[str, ...]] = ()  # query parameters accepted as fields (the body wins)
    IMAGES: ClassVar[bool] = True  # the endpoint takes images ('image' / 'images')
    _images: list[tuple[str, bytes]] = PrivateAttr(default_factory=list)

    @property
    def images(self) -> list[tuple[str, bytes]]:
        return self._images

    @classmethod
    def from_fields(cls, fields: dict[str, Any], settings: Settings, *, multipart: bool = False,
                    images: list[tuple[str, bytes]] | None = None):
        """Validate ``fields`` (multipart text converted first); a 422 names every wrong field."""
        if images and not cls.IMAGES:
            raise unprocessable("this endpoint takes no images")
        if multipart:
            fields = {k: cls._from_text(k, v) for k, v in fields.items()}
        try:
            req = cls.model_validate(fields, context={"settings": settings})
        except ValidationError as e:
            raise validation_error(e) from None
        req._images = list(images or [])
        return req

    @classmethod
    def _from_text(cls, key: str, text: str) -> Any:
        if key in cls.TEXT_FIELDS:
            return text
        try:
            return loads(text, key)
        except ApiError:
            if key in cls.JSON_FIELDS:
                raise
            return text  # "yes" for a boolean, a bare word for a literal: pydantic judges it

    @classmethod
    def openapi_body(cls) -> dict[str, Any]:
        """The request body for OpenAPI: JSON (images base64) and multipart (fields as text holding JSON)."""
        schema = cls.model_json_schema()
        props = {k: {kk: vv for kk, vv in v.items() if kk != "title"} for k, v in schema["properties"].items()}
        required = schema.get("required", [])
        multipart = {k: {"type": "string", "description": v.get("description", "") + (
            "" if k in cls.TEXT_FIELDS else " (JSON text)")} for k, v in props.items()}
        if cls.IMAGES:
            props["image"] = {"type": "string", "format": "byte", "description": "one base64 image file"}
            props["images"] = {"type": "array", "items": {"type": "string", "format": "byte"},
                               "description": "base64-encoded image files"}
            multipart["images"] = {"type": "array", "items": {"type": "string", "format": "binary"},
                                   "description": "image files (also accepted as a single 'image')"}
        return {"requestBody": {"content": {
            "application/json": {"schema": {"type": "object", "properties": props, "required": required,
                                            "additionalProperties": False}},
            "multipart/form-data": {"schema": {"type": "object", "properties": multipart, "required": required}}}}}


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` substituted in place (OpenAPI has no ``$defs``; the request models
    are not recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items() if k != "title"}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def validation_error(e: ValidationError) -> ApiError:
    """422 whose message names the fields (first three) and whose ``detail`` lists the errors."""
    errors = e.errors(include_url=False, include_input=False, include_context=False)
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    message = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
    detail = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in errors[:20]]
    return unprocessable(message, detail)


# ---- the endpoints --------------------------------------------------------------------------------------------------
class EmbedRequest(RequestModel):
    """``POST /embed``."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"mask"})
    mask: Mask = None
    normalize: bool = Field(False, description="L2-normalise the embeddings")


class FitRequest(RequestModel):
    """``POST /fewshot/fit``: images, embeddings, or ids of items stored in an index; one label each."""

    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset({"name", "index"})
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"labels", "embeddings", "mask", "ids"})
    name: str = Field(description=f"classifier name, matching {NAME_RE.pattern}")
    labels: Annotated[list[str], WithJsonSchema({"type": "array", "minItems": 1, "items": {"type": "string"}})] = \
        Field(description="one label (string or integer) per image/embedding/id")
    embeddings: matrix_of("max_fit_samples") = Field(None, description="precomputed embeddings instead of images")
    index: str | None = Field(None, description="fit on the stored vectors of these ids of this index (with ids)")
    ids: Annotated[Any, BeforeValidator(lambda v, info: None if v is None else ids(v, _settings(info).max_fit_samples)),
                   WithJsonSchema(IDS_SCHEMA)] = Field(None, description="ids of the index's items, one per label")
    lambd: float | None = Field(None, gt=0, allow_inf_nan=False, description="L2 strength; cyanure lambda_1 = "
                                "lambd / n (MSN protocol); default MSN_SERVE_DEFAULT_LAMBD (0.00025)")
    overwrite: bool = Field(False, description="replace an existing classifier")
    mask: Mask = None

    @field_validator("name", "index")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.fullmatch(v):
            raise ValueError(f"must match {NAME_RE.pattern} (the whole name)")
        return v

    @model_validator(mode="after")
    def _source(self) -> FitRequest:
        if (self.index is None) != (self.ids is None):
            raise ValueError("index and ids go together: the ids of the items of that index to fit on")
        if self.index is not None and (self.embeddings is not None or self.mask is not None):
            raise ValueError("send either index + ids or embeddings (or images), not both")
        return self

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, v: Any, info: ValidationInfo) -> list[str]:
        s = _settings(info)
        _count(v, "labels", s.max_fit_samples, "max_fit_samples")
        out = []
        for i, label in enumerate(v):
            if isinstance(label, bool) or not isinstance(label, (str, int)):
                raise ValueError(f"item {i}: expected a string (or integer), got {brief(label)}")  # noqa: TRY004
            text = label if isinstance(label, str) else str(label)  # 4300+ digit ints never parse
            if not text or len(text) > s.max_label_chars:
                raise ValueError(f"item {i}: 1 to {s.max_label_chars} characters (max_label_chars)")
            out.append(text)
        return out


class PredictRequest(RequestModel):
    """``POST /fewshot/{name}/predict``."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"embeddings", "mask"})
    QUERY: ClassVar[tuple[str, ...]] = ("k",)
    embeddings: matrix_of("max_vectors_per_request") = Field(None, description="instead of images")
    k: K = Field(5, ge=1, description="top-k labels per image/embedding (also ?k=; at most max_k)")
    mask: Mask = None


class IndexCreateRequest(RequestModel):
    """``POST /index/{name}``: the options of a new index (immutable afterwards)."""

    IMAGES: ClassVar[bool] = False
    metric: Literal["ip", "l2"] = Field("ip", description="ip (cosine when normalised) or l2")
    type: Literal["flat", "ivf", "hnsw", "auto"] = Field(
        "flat", description="flat = exact IndexIDMap2(IndexFlat*); auto = exact, then re-tuned as it grows")
    dim: int_in(1, 65536) | None = Field(None, description="vector size (default: the model's)")
    normalize: bool | None = Field(None, description="L2-normalise added and query vectors (default: true for ip)")
    nlist: Int = Field(256, ge=1, le=1 << 20, description="ivf: inverted lists")
    nprobe: Int = Field(16, ge=1, le=1 << 20, description="ivf: default lists probed per query")
    m: Int = Field(32, ge=2, le=256, description="hnsw: M")
    ef_construction: Int = Field(80, ge=1, le=4096, description="hnsw: efConstruction")
    ef_search: Int = Field(64, ge=1, le=4096, description="hnsw: default efSearch")
    target_recall: float | None = Field(None, gt=0.0, le=1.0, description="auto: recall@10 the tuner must reach "
                                                                          "(default 0.95)")
    exact_below: int_in(1, 1 << 40) | None = Field(None, description="auto: exact search below this many vectors "
                                                                    "(default 100000)")
    retune_growth: float | None = Field(None, gt=1.1, le=100.0, description="auto: re-tune after growing this many "
                                                                           "times (default 2)")
    deletes: bool | None = Field(None, description="auto: only kinds that can delete/replace (default true)")

    def spec(self) -> dict[str, Any]:
        """The options the client set (the index store fills in the defaults)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}


class IndexAddRequest(RequestModel):
    """``POST /index/{name}/add``: re-adding an id replaces its vector and metadata."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"ids", "vectors", "metadata", "mask"})
    ids: Ids = Field(description="one non-negative int64 id per image/vector")
    vectors: matrix_of("max_vectors_per_request") = Field(None, description="instead of images")
    metadata: Annotated[Any, WithJsonSchema({"type": "array", "items": {}})] = Field(
        None, description="one JSON value (or null) per id; at most max_metadata_bytes each")
    mask: Mask = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any, info: ValidationInfo) -> Texts | None:
        s = _settings(info)
        return metadata(v, s.max_vectors_per_request, s.max_metadata_bytes)


class SearchRequest(RequestModel):
    """``POST /index/{name}/search``."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"vectors", "mask"})
    QUERY: ClassVar[tuple[str, ...]] = ("k", "nprobe", "ef_search")
    vectors: matrix_of("max_queries_per_search") = Field(None, description="query vectors (at most "
                                                                           "max_queries_per_search)")
    k: K = Field(10, ge=1, description="neighbours per query (also ?k=; at most max_k)")
    nprobe: int_in(1, 1 << 20) | None = Field(None, description="ivf only (also ?nprobe=)")
    ef_search: int_in(1, 1 << 16) | None = Field(None, description="hnsw only (also ?ef_search=)")
    mask: Mask = None


class IndexDeleteRequest(RequestModel):
    """``POST /index/{name}/delete``."""

    IMAGES: ClassVar[bool] = False
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"ids"})
    ids: Ids = Field(description="ids to remove")

