"""Request models: one pydantic model per endpoint, filled from a JSON body or from multipart fields.

Types, ranges and the configurable limits (``Settings``, passed as validation context) live here and nowhere else;
the OpenAPI request bodies are generated from the same models (:meth:`RequestModel.openapi_body`). Limits that bound
what a request makes the server hold (rows, ids, metadata bytes) are checked *before* element-wise work and answer
413 naming the setting; wrong types and ranges answer 422 naming the field. A new endpoint is a new model here, a
route and a service method. Models stay here: a route turns one into plain arguments (:meth:`RequestModel.inputs`,
fields) for the services, which never see it. A ``mask`` is resolved here to one ``keep_idx`` row per image (a bad
mask is a 422 of the parsing, like any other wrong field), once the images it applies to are known.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
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
from msn_serve.embedding.service import Inputs
from msn_serve.errors import NAME_RE, ApiError, brief, unprocessable
from msn_serve.http.fields import (
    IDS_SCHEMA,
    Ids,
    Int,
    K,
    Mask,
    count,
    ids,
    int_in,
    matrix_of,
    metadata,
    settings_of,
)
from msn_serve.indexes.metadata import Texts
from msn_serve.jsontext import loads
from msn_serve.masks import request_keep_idx


class RequestModel(BaseModel):
    """Base of the request models: unknown fields are refused, images ride along outside the fields."""

    model_config = ConfigDict(extra="forbid")
    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset()  # multipart text taken as-is (not parsed as JSON)
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset()  # multipart text that must be JSON (lists, objects)
    QUERY: ClassVar[tuple[str, ...]] = ()  # query parameters accepted as fields (the body wins)
    IMAGES: ClassVar[bool] = True  # the endpoint takes images ('image' / 'images')
    VECTORS: ClassVar[str | None] = None  # the field that carries vectors instead of images
    _images: list[tuple[str, bytes]] = PrivateAttr(default_factory=list)
    _keep_idx: list[np.ndarray] | None = PrivateAttr(default=None)

    @property
    def images(self) -> list[tuple[str, bytes]]:
        return self._images

    @property
    def keep_idx(self) -> list[np.ndarray] | None:
        """One row of kept patch indices per image (from the mask), once resolved."""
        return self._keep_idx

    def inputs(self) -> Inputs:
        """The images (with their kept patches) or vectors this request sends, as the services take them."""
        vectors = getattr(self, self.VECTORS) if self.VECTORS else None
        return Inputs(images=self._images, keep_idx=self._keep_idx, vectors=vectors, mask=getattr(self, "mask", None))

    @classmethod
    def from_fields(cls, fields: dict[str, Any], settings: Settings, *, multipart: bool = False,
                    images: list[tuple[str, bytes]] | None = None):
        """Validate ``fields`` (multipart text converted first); a 422 names every wrong field. The ``mask`` is
        resolved later (:meth:`resolve_masks`), on the grid of the model that embeds the images."""
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

    def resolve_masks(self, grid: int) -> None:
        """``keep_idx`` of the images that will be embedded, on the patch ``grid`` of the model that embeds them:
        none when there are no images, or when vectors are sent too (the service answers that one is one too many).
        Without it, the embedding service of the model a store names resolves the mask (:class:`Inputs`)."""
        if not self._images or (self.VECTORS and getattr(self, self.VECTORS) is not None):
            return
        self._keep_idx = request_keep_idx(getattr(self, "mask", None), len(self._images), grid)

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
ModelName = Annotated[str | None, Field(min_length=1, max_length=64, description=(
    "the model to use, by name (GET /v1/models); default: the server's default model"))]


class EmbedRequest(RequestModel):
    """``POST /embed``."""

    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset({"model"})
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"mask"})
    mask: Mask = None
    normalize: bool = Field(False, description="L2-normalise the embeddings")
    model: ModelName = None


def _fit_ids(value: Any, info: ValidationInfo) -> np.ndarray | None:
    return None if value is None else ids(value, settings_of(info).max_fit_samples)


class FitRequest(RequestModel):
    """``POST /fewshot/fit``: images, embeddings, or ids of items stored in an index; one label each."""

    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset({"name", "index", "model"})
    VECTORS: ClassVar[str | None] = "embeddings"
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"labels", "embeddings", "mask", "ids"})
    name: str = Field(description=f"classifier name, matching {NAME_RE.pattern}")
    labels: Annotated[list[str], WithJsonSchema({"type": "array", "minItems": 1, "items": {"type": "string"}})] = \
        Field(description="one label (string or integer) per image/embedding/id")
    embeddings: matrix_of("max_fit_samples") = Field(None, description="precomputed embeddings instead of images")
    index: str | None = Field(None, description="fit on the stored vectors of these ids of this index (with ids)")
    ids: Annotated[Any, BeforeValidator(_fit_ids),
                   WithJsonSchema(IDS_SCHEMA)] = Field(None, description="ids of the index's items, one per label")
    lambd: float | None = Field(None, gt=0, allow_inf_nan=False, description="L2 strength; cyanure lambda_1 = "
                                "lambd / n (MSN protocol); default MSN_SERVE_DEFAULT_LAMBD (0.00025)")
    overwrite: bool = Field(False, description="replace an existing classifier")
    mask: Mask = None
    model: ModelName = None

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
        s = settings_of(info)
        count(v, "labels", s.max_fit_samples, "max_fit_samples")
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

    VECTORS: ClassVar[str | None] = "embeddings"
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"embeddings", "mask"})
    QUERY: ClassVar[tuple[str, ...]] = ("k",)
    embeddings: matrix_of("max_vectors_per_request") = Field(None, description="instead of images")
    k: K = Field(5, ge=1, description="top-k labels per image/embedding (also ?k=; at most max_k)")
    mask: Mask = None


class IndexCreateRequest(RequestModel):
    """``POST /index/{name}``: the options of a new index (immutable afterwards)."""

    IMAGES: ClassVar[bool] = False
    TEXT_FIELDS: ClassVar[frozenset[str]] = frozenset({"model"})
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
    backend: Literal["faiss", "milvus"] | None = Field(
        None, description="faiss (files in the data directory) or milvus (a collection in --milvus-uri); default: "
                          "the server's --index-backend")
    model: ModelName = None

    def spec(self) -> dict[str, Any]:
        """The options the client set (the index store fills in the defaults; the model is the service's)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None and k != "model"}


class IndexAddRequest(RequestModel):
    """``POST /index/{name}/add``: re-adding an id replaces its vector and metadata."""

    VECTORS: ClassVar[str | None] = "vectors"
    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"ids", "vectors", "metadata", "mask"})
    ids: Ids = Field(description="one non-negative int64 id per image/vector")
    vectors: matrix_of("max_vectors_per_request") = Field(None, description="instead of images")
    metadata: Annotated[Any, WithJsonSchema({"type": "array", "items": {}})] = Field(
        None, description="one JSON value (or null) per id; at most max_metadata_bytes each")
    mask: Mask = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any, info: ValidationInfo) -> Texts | None:
        s = settings_of(info)
        return metadata(v, s.max_vectors_per_request, s.max_metadata_bytes)


class SearchRequest(RequestModel):
    """``POST /index/{name}/search``."""

    VECTORS: ClassVar[str | None] = "vectors"
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

