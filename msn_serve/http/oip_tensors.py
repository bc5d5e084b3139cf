"""Open Inference Protocol requests: the JSON header as pydantic models, and tensors from JSON data or raw bytes.

``tritonclient.http`` sends tensors as raw bytes after a JSON header by default (``Inference-Header-Content-Length``
gives the JSON length; each binary input carries ``parameters.binary_data_size``). Everything a client controls is
checked before it is used: datatypes and shapes (the element count, computed without overflow, must fit in the body),
values within the datatype's range, parameters of the right types. Each problem is a 400 (the protocol's status for
bad requests) naming the input or field.
"""
from __future__ import annotations

import math
import zlib
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from msn_serve.errors import ApiError, bad_request, too_large
from msn_serve.http.schemas import validation_error
from msn_serve.jsontext import loads

HEADER = "Inference-Header-Content-Length"
DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
          "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
          "UINT64": np.uint64, "BOOL": np.bool_}
Datatype = Literal["FP32", "FP16", "FP64", "INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32", "UINT64",
                   "BOOL"]
Dim = Annotated[StrictInt, Field(ge=0, le=2**40)]
CHUNK = 16384  # top-level items of a JSON tensor converted per numpy call (:func:`_as_array`)


class TensorParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data_size: Annotated[StrictInt, Field(ge=0)] | None = None
    binary_data: StrictBool | None = None


class InferInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    shape: list[Dim] = Field(max_length=8)
    datatype: Datatype
    parameters: TensorParameters = Field(default_factory=TensorParameters)
    data: Any = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    parameters: TensorParameters = Field(default_factory=TensorParameters)


class RequestParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    mask: Any = Field(None, description="a mask specification as /embed takes (object or JSON text), instead of "
                                        "the keep_idx input")
    binary_data_output: StrictBool | None = None


class InferRequest(BaseModel):
    """The JSON part of ``POST /v2/models/{m}/infer``."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    parameters: RequestParameters = Field(default_factory=RequestParameters)
    inputs: list[InferInput] = Field(min_length=1, max_length=16)
    outputs: list[RequestedOutput] | None = Field(None, max_length=16)

    @property
    def binary_output(self) -> bool:
        """Triton's rule: per-output ``binary_data`` wins over the request's ``binary_data_output``."""
        out = bool(self.parameters.binary_data_output)
        for o in self.outputs or []:
            if o.parameters.binary_data is not None:
                out = o.parameters.binary_data
        return out


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ApiError(415, f"unsupported Content-Encoding {encoding!r}")
    d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise bad_request(f"cannot decompress request body: {e}") from None
    if len(out) > limit:
        raise too_large(f"decompressed request body exceeds {limit} bytes (max_body_mb)")
    return out


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """``(JSON header, binary tensor bytes)`` by the binary extension's header (ASCII digits only)."""
    if header_length is None:
        return body, b""
    if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= 12) \
            or int(header_length) > len(body):
        raise bad_request(f"{HEADER} {header_length[:20]!r} is not a valid length for a {len(body)}-byte body")
    n = int(header_length)
    return body[:n], body[n:]


def parse_request(head: bytes) -> InferRequest:
    data = loads(head, "inference request header", status=400)
    if not isinstance(data, dict):
        raise bad_request("inference request must be a JSON object")
    try:
        return InferRequest.model_validate(data)
    except ValidationError as e:
        err = validation_error(e)
        raise ApiError(400, err.message, err.detail) from None


def tensor(spec: InferInput, blob: memoryview | None, max_bytes: int) -> np.ndarray:
    """One input as a numpy array of its datatype and shape."""
    np_dtype = np.dtype(DTYPES[spec.datatype]).newbyteorder("<")
    count = math.prod(spec.shape)  # Python ints: a huge shape cannot overflow into a small count
    if count * np_dtype.itemsize > max_bytes:
        raise too_large(f"input {spec.name!r}: shape {spec.shape} holds {count} elements, more than a request "
                        f"body of at most {max_bytes} bytes can carry (max_body_mb)")
    if blob is not None:
        if len(blob) != count * np_dtype.itemsize:
            raise bad_request(f"input {spec.name!r}: {len(blob)} bytes do not match shape {spec.shape} of "
                              f"{spec.datatype}")
        arr = np.frombuffer(blob, dtype=np_dtype)
    else:
        if spec.data is None:
            raise bad_request(f"input {spec.name!r}: no 'data' and no binary_data_size")
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # values beyond a float type become inf: checked later
                arr = _as_array(spec.data, DTYPES[spec.datatype])
        except OverflowError:
            raise bad_request(f"input {spec.name!r}: a value is outside the range of {spec.datatype}") from None
        except (TypeError, ValueError):
            raise bad_request(f"input {spec.name!r}: data does not parse as {spec.datatype} (numbers in "
                              "equal-length lists)") from None
        if arr.size != count:
            raise bad_request(f"input {spec.name!r}: {arr.size} elements do not match shape {spec.shape}")
    return arr.reshape(spec.shape)


def _as_array(data: Any, dtype: Any) -> np.ndarray:
    """``data`` (a JSON list, flat or nested) as a flat array, converted :data:`CHUNK` top-level items at a time,
    emptying the list as it goes. numpy holds the GIL for a whole conversion, and freeing a list frees every number in
    it in one go, so a parser thread converting (or later dropping) a large body in one call would stall the event
    loop; between chunks the interpreter can hand the GIL over."""
    if not isinstance(data, list) or len(data) <= CHUNK:
        return np.asarray(data, dtype=dtype).reshape(-1)
    parts = []
    while data:  # from the end: deleting a list's tail moves nothing
        parts.append(np.asarray(data[-CHUNK:], dtype=dtype).reshape(-1))
        del data[-CHUNK:]
    return np.concatenate(parts[::-1])


def tensors(req: InferRequest, binary: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    """Every input of ``req``, binary ones cut from ``binary`` in order; trailing bytes are an error."""
    out: dict[str, np.ndarray] = {}
    offset, view = 0, memoryview(binary)
    for spec in req.inputs:
        size = spec.parameters.binary_data_size
        blob = None
        if size is not None:
            if offset + size > len(binary):
                raise bad_request(f"input {spec.name!r}: binary_data_size {size} exceeds the binary payload")
            blob, offset = view[offset: offset + size], offset + size
        if spec.name in out:
            raise bad_request(f"input {spec.name!r} given twice")
        out[spec.name] = tensor(spec, blob, max_bytes)
    if offset != len(binary):
        raise bad_request(f"{len(binary) - offset} trailing bytes after the binary inputs")
    return out
