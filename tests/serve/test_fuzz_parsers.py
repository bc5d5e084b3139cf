"""Property-based fuzzing (hypothesis) of the parsers a client reaches: JSON text, the request models' fields (as
JSON and as multipart text), mask specifications, OIP headers and tensors, the binary extension's header length,
and image bytes. The property: a value, or a 4xx ``ApiError`` (``MaskError`` for masks); never anything else.
``make test`` runs 150 derandomised examples per property; ``FUZZ_EXAMPLES=2000 FUZZ_RANDOM=1`` hunts longer.
"""
from __future__ import annotations

import json
import os
import string

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from serve_helpers import PREPROCESSING, encode, random_image

from msn_core.bundle import Preprocessing
from msn_core.masks import MaskError, resolve_masks
from msn_serve.config import Settings
from msn_serve.embedding.preprocess import PixelBudget, preprocess_bytes
from msn_serve.errors import ApiError
from msn_serve.http.oip_tensors import parse_request, split_body, tensors
from msn_serve.http.schemas import RequestModel
from msn_serve.jsontext import loads

SETTINGS = Settings(bundle="/nonexistent", max_vectors_per_request=50, max_queries_per_search=20, max_k=100,
                    max_fit_samples=50, max_metadata_bytes=2000)
MODELS = RequestModel.__subclasses__()  # every endpoint's model, including ones added later
PROPS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                 derandomize=not os.environ.get("FUZZ_RANDOM"), database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=False, allow_infinity=False), st.floats(min_value=-1e39, max_value=1e39),
                    st.text(max_size=12), st.sampled_from(["--5", "²", "١٢", "1e400", "NaN", "true", "yes", "[1,"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=40)
numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False, width=32),
                    st.floats(min_value=-1e300, max_value=1e300))
vectors = st.lists(st.lists(numbers, min_size=1, max_size=4), min_size=1, max_size=4)
field_values = st.one_of(json_values, vectors, st.lists(st.integers(min_value=-3, max_value=2**64), max_size=5))


def _ok(exc: ApiError) -> None:
    assert 400 <= exc.status < 500, (exc.status, exc.message)
    assert exc.message


@PROPS
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200),
                      st.builds(json.dumps, json_values), st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)))
def test_json_text_parses_or_is_a_4xx(text):
    try:
        loads(text, "body")
    except ApiError as e:
        _ok(e)


@PROPS
@given(model=st.sampled_from(MODELS), keys=st.data())
def test_request_models_validate_or_answer_4xx(model, keys):
    names = list(model.model_fields) + ["extra", "images"]
    fields = keys.draw(st.dictionaries(st.sampled_from(names), field_values, max_size=5))
    for multipart in (False, True):
        data = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()} if multipart else fields
        try:
            req = model.from_fields(data, SETTINGS, multipart=multipart)
        except ApiError as e:
            _ok(e)
            continue
        for name in ("vectors", "embeddings"):
            arr = getattr(req, name, None)
            if arr is not None:  # what validation lets through is safe to compute with
                assert arr.dtype == np.float32 and arr.ndim == 2 and np.isfinite(arr).all()


masks = st.one_of(json_values, st.fixed_dictionaries({"ratio": numbers}, optional={"seed": json_values}),
                  st.fixed_dictionaries({"keep_idx": st.lists(st.integers(-2, 2**64), max_size=70)}),
                  st.fixed_dictionaries({"focal": st.fixed_dictionaries({"size": json_values},
                                                                        optional={"top": numbers, "left": numbers})}),
                  st.fixed_dictionaries({"bitmap": st.lists(st.lists(st.integers(-1, 2), max_size=9), max_size=9)}))


@PROPS
@given(spec=st.one_of(masks, st.lists(masks, max_size=3)), count=st.integers(1, 3))
def test_masks_resolve_to_valid_keep_idx_or_a_mask_error(spec, count):
    try:
        keeps = resolve_masks(spec, count, 8)
    except MaskError as e:
        assert str(e)
        return
    assert len(keeps) == count
    for k in keeps:
        assert k.dtype == np.int64 and k.size >= 1 and (np.diff(k) > 0).all() and 0 <= k.min() and k.max() < 64


DATATYPES = ["FP32", "FP16", "FP64", "INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32", "UINT64", "BOOL",
             "BYTES", "fp32"]
tensor_specs = st.fixed_dictionaries(
    {"name": st.sampled_from(["pixel_values", "keep_idx", "keep_mask", "other", 7]),
     "shape": st.one_of(st.lists(st.integers(-1, 2**64), max_size=5), json_values),
     "datatype": st.sampled_from(DATATYPES)},
    optional={"data": st.one_of(st.lists(numbers, max_size=8), json_values),
              "parameters": st.one_of(st.fixed_dictionaries({"binary_data_size": st.one_of(st.integers(-1, 64),
                                                                                           json_values)}),
                                      json_values)})
oip_headers = st.fixed_dictionaries({"inputs": st.one_of(st.lists(tensor_specs, max_size=3), json_values)},
                                    optional={"parameters": json_values, "outputs": json_values, "id": json_values})


@PROPS
@given(head=oip_headers, binary=st.binary(max_size=64))
def test_oip_requests_parse_or_answer_4xx(head, binary):
    try:
        req = parse_request(json.dumps(head).encode())
        arrays = tensors(req, binary, 1 << 20)
    except ApiError as e:
        _ok(e)
        return
    assert set(arrays) <= {t.name for t in req.inputs}


@PROPS
@given(length=st.one_of(st.text(alphabet=string.digits + "²١٢٣ -+x", max_size=14), st.text(max_size=5)),
       body=st.binary(max_size=32))
def test_binary_header_length_is_digits_within_the_body(length, body):
    try:
        head, rest = split_body(body, length)
    except ApiError as e:
        _ok(e)
        return
    assert head + rest == body and len(head) == int(length)


PRE = Preprocessing.from_dict(PREPROCESSING)
VALID = encode(random_image(0))


@PROPS
@given(data=st.one_of(st.binary(max_size=300), st.integers(0, len(VALID)).map(lambda n: VALID[:n]),
                      st.binary(min_size=1, max_size=8).map(lambda b: VALID[:40] + b + VALID[48:])))
def test_image_bytes_decode_or_answer_4xx(data):
    assume(data != VALID)
    try:
        out = preprocess_bytes(data, PRE, max_pixels=10**6, budget=PixelBudget(10**7))
    except ApiError as e:
        _ok(e)
        return
    assert out.shape == (3, 32, 32) and np.isfinite(out).all()
