"""Hostile requests, each reproduced exactly against a real server: every one is a 4xx naming the
problem, memory stays bounded, and the server stays up (defects 1, 4, 6, 7 and 8)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image

MB = 2**20
DIM = 64


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(bundle_dir, tmp_path_factory.mktemp("hostile") / "data", "--max-body-mb", "8",
               "--max-index-metadata-mb", "4").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv: Server):
    with srv.client(timeout=120) as c:
        yield c


def _vectors(n: int, seed: int = 0) -> list[list[float]]:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32).round(3).tolist()


def _strict(text: str):
    """json.loads that refuses NaN/Infinity, as strict parsers do."""
    def reject(name: str):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=reject)


# ---- defect 1: one search can exhaust the host's memory --------------------------------------------------------------
def test_hostile_searches_are_refused_and_memory_stays_bounded(srv: Server, http):
    for start in range(0, 10_000, 5_000):  # a 10k index ...
        r = http.post("/index/big/add",
                      json={"ids": list(range(start, start + 5_000)), "vectors": _vectors(5_000, start)})
        assert r.status_code == 200, r.text
    blob = "x" * (60 * 1024)  # ... and one whose 50 ids carry 60 KB of metadata each (within max_metadata_bytes)
    r = http.post("/index/meta/add", json={"ids": list(range(50)), "vectors": _vectors(50, 7),
                                           "metadata": [{"blob": blob}] * 50})
    assert r.status_code == 200, r.text
    before = srv.memory_kb("VmHWM")

    r = http.post("/index/meta/add", json={"ids": [99], "vectors": _vectors(1), "metadata": [{"blob": "y" * MB}]})
    assert r.status_code == 413 and "max_metadata_bytes" in r.json()["error"]  # the 1 MiB value
    r = http.post("/index/meta/search", json={"vectors": [[0.5] * DIM] * 10_000, "k": 10})
    assert r.status_code == 413 and "max_queries_per_search" in r.json()["error"]  # the 10,000-query request
    r = http.post("/index/big/search", json={"vectors": _vectors(200, 1), "k": 10_000})
    assert r.status_code == 413 and "max_results_per_request" in r.json()["error"]  # 200 x k=10000 on 10k
    r = http.post("/index/meta/search", json={"vectors": _vectors(1000, 2), "k": 10})
    assert r.status_code == 413 and "max_response_mb" in r.json()["error"]  # 10,000 hits x 60 KB = 600 MB
    r = http.post("/index/big/search", json={"vectors": _vectors(1000, 3), "k": 100})
    assert r.status_code == 200 and len(r.json()["results"]) == 1000  # 100,000 results is within the limits
    r = http.post("/index/small/add", json={"ids": [1], "vectors": _vectors(1)})
    r = http.post("/index/small/search?k=10000", json={"vectors": _vectors(500, 4)})
    assert r.status_code == 200 and all(len(row) == 1 for row in r.json()["results"])  # k capped at ntotal

    growth_mb = (srv.memory_kb("VmHWM") - before) / 1024
    assert growth_mb < 300, f"peak memory grew by {growth_mb:.0f} MB"
    assert srv.alive() and http.get("/healthz").status_code == 200


@pytest.mark.parametrize("backend", ["faiss", "milvus"])
def test_metadata_per_index_is_bounded(http, backend: str):
    if backend == "milvus":
        pytest.importorskip("pymilvus")
    name = f"capped-{backend}"
    assert http.post(f"/index/{name}", json={"backend": backend}).status_code == 201
    entry = {"blob": "z" * (60 * 1024)}
    for start in range(0, 60, 30):  # 60 x 60 KB = 3.5 MB: within --max-index-metadata-mb 4
        r = http.post(f"/index/{name}/add", json={"ids": list(range(start, start + 30)),
                                                  "vectors": _vectors(30, start), "metadata": [entry] * 30})
        assert r.status_code == 200, r.text
    r = http.post(f"/index/{name}/add", json={"ids": list(range(60, 90)), "vectors": _vectors(30),
                                              "metadata": [entry] * 30})
    assert r.status_code == 413 and "max_index_metadata_mb" in r.json()["error"]
    r = http.post(f"/index/{name}/add", json={"ids": [0], "vectors": _vectors(1)})  # replacing frees its bytes
    assert r.status_code == 200 and http.get(f"/index/{name}").json()["with_metadata"] == 59


# ---- defect 4: 32 requests that returned 500, from 8 causes --------------------------------------------------------
IMG = encode(random_image(1))
DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "1" + "0" * 400  # 10**400 as a JSON literal
PIXELS = {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
JSON = {"content-type": "application/json"}


def _oip(*inputs: dict, **extra) -> dict:
    return {"json": {"inputs": list(inputs), **extra}}


FIVE_HUNDREDS = {
    # deeply nested JSON (RecursionError)
    "nested_json_body": ("/embed", {"content": f'{{"mask": {DEEP}}}', "headers": JSON}, 422, "nested too deeply"),
    "nested_multipart_field": ("/embed", {"files": {"image": IMG}, "data": {"mask": DEEP}}, 422, "nested too deeply"),
    "nested_oip_header": ("/v2/models/msn/infer", {"content": f'{{"inputs": {DEEP}}}', "headers": JSON}, 400,
                          "nested too deeply"),
    "nested_metadata": ("/index/n/add", {"json": {"ids": [1], "vectors": _vectors(1), "metadata": [
        json.loads("[" * 500 + "]" * 500)]}}, 422, "nested deeper"),
    # a 5000-digit integer
    "5000_digit_k": ("/index/big/search", {"content": '{"vectors": [[' + ", ".join(["0.5"] * DIM) + ']], "k": '
                                           + "1" * 5000 + "}", "headers": JSON}, 422, "4300 digits"),
    "5000_digit_id": ("/index/n/add", {"content": '{"ids": [' + "7" * 5000 + '], "vectors": [[' + ", ".join(
        ["0.5"] * DIM) + "]]}", "headers": JSON}, 422, "4300 digits"),
    "5000_digit_multipart_k": ("/index/big/search", {"files": {"image": IMG}, "data": {"k": "1" * 5000}}, 422, "k"),
    # k=--5 and k=² passing isdigit()
    "k_double_minus": ("/index/big/search?k=--5", {"json": {"vectors": _vectors(1)}}, 422, "k:"),
    "k_superscript": ("/index/big/search?k=²", {"json": {"vectors": _vectors(1)}}, 422, "k:"),
    "k_superscript_predict": ("/fewshot/clf/predict?k=²", {"json": {"embeddings": _vectors(1)}}, 422, "k:"),
    # 10**400 overflowing float conversion
    "lambd_10e400": ("/fewshot/fit", {"content": '{"name": "x", "labels": ["a", "b"], "embeddings": '
                                      + json.dumps(_vectors(2)) + ', "lambd": ' + HUGE + "}", "headers": JSON}, 422,
                     "lambd"),
    "vector_10e400": ("/index/n/add", {"content": '{"ids": [1], "vectors": [[' + HUGE + ", 0.5]]}", "headers": JSON},
                      422, "vectors"),
    "embedding_10e400": ("/fewshot/clf/predict", {"content": '{"embeddings": [[' + HUGE + "]]}", "headers": JSON},
                         422, "embeddings"),
    "query_10e400": ("/index/big/search", {"content": '{"vectors": [[' + HUGE + "]]}", "headers": JSON},
                     422, "vectors"),
    # keep_idx >= 2^63
    "keep_idx_2_63": ("/embed", {"files": {"image": IMG}, "data": {"mask": '{"keep_idx": [9223372036854775808]}'}},
                      422, "mask.keep_idx"),
    "keep_idx_2_64_json": ("/embed", {"json": {"image": __import__("base64").b64encode(IMG).decode(),
                                               "mask": {"keep_idx": [2**64, 1]}}}, 422, "mask.keep_idx"),
    "oip_keep_idx_2_63": ("/v2/models/msn/infer", _oip(PIXELS, {"name": "keep_idx", "shape": [1, 1],
                                                                "datatype": "INT64", "data": [2**63]}),
                          400, "keep_idx"),
    # OIP shapes whose product overflows
    "oip_shape_overflow": ("/v2/models/msn/infer", _oip({**PIXELS, "shape": [2**40, 2**40, 2**40, 2**40]}), 413,
                           "pixel_values"),
    "oip_shape_int64_wrap": ("/v2/models/msn/infer", _oip({**PIXELS, "shape": [2**32, 2**32, 1, 1]}), 413,
                             "pixel_values"),
    "oip_shape_too_big_dim": ("/v2/models/msn/infer", _oip({**PIXELS, "shape": [2**63, 1]}), 400, "shape"),
    "oip_shape_negative": ("/v2/models/msn/infer", _oip({**PIXELS, "shape": [-1, 3, 32, 32]}), 400, "shape"),
    # OIP data outside the datatype's range
    "oip_uint8_300": ("/v2/models/msn/infer", _oip(PIXELS, {"name": "keep_idx", "shape": [1, 1], "datatype": "UINT8",
                                                            "data": [300]}), 400, "keep_idx"),
    "oip_int64_2_70": ("/v2/models/msn/infer", _oip(PIXELS, {"name": "keep_idx", "shape": [1, 1], "datatype": "INT64",
                                                             "data": [2**70]}), 400, "INT64"),
    "oip_uint64_minus_1": ("/v2/models/msn/infer", _oip(PIXELS, {"name": "keep_idx", "shape": [1, 1],
                                                                 "datatype": "UINT64", "data": [-1]}), 400, "UINT64"),
    "oip_fp32_string": ("/v2/models/msn/infer", _oip({**PIXELS, "data": ["a"] * 3072}), 400, "FP32"),
    # OIP parameters that are not objects
    "oip_parameters_list": ("/v2/models/msn/infer", _oip(PIXELS, parameters=[1]), 400, "parameters"),
    "oip_input_parameters_list": ("/v2/models/msn/infer", _oip({**PIXELS, "parameters": [1]}), 400, "parameters"),
    "oip_output_parameters_list": ("/v2/models/msn/infer", _oip(PIXELS, outputs=[{"name": "embedding",
                                                                                   "parameters": [1]}]), 400,
                                   "parameters"),
    "oip_binary_size_string": ("/v2/models/msn/infer", _oip({**PIXELS, "parameters": {"binary_data_size": "12"}}),
                               400, "binary_data_size"),
    # a binary Inference-Header-Content-Length with a non-ASCII digit
    "oip_header_length_superscript": ("/v2/models/msn/infer", {"content": b'{"inputs": []}', "headers": {
        "Inference-Header-Content-Length": b"\xb2"}}, 400, "Inference-Header-Content-Length"),
    "oip_header_length_arabic_digits": ("/v2/models/msn/infer", {"content": b'{"inputs": []}', "headers": {
        "Inference-Header-Content-Length": "١٢".encode()}}, 400, "Inference-Header-Content-Length"),
    "oip_header_length_huge": ("/v2/models/msn/infer", {"content": b'{"inputs": []}', "headers": {
        "Inference-Header-Content-Length": "9" * 5000}}, 400, "Inference-Header-Content-Length"),
}


@pytest.fixture(scope="module")
def classifier(http) -> str:
    r = http.post("/fewshot/fit", json={"name": "clf", "labels": ["a", "b", "c"] * 2, "embeddings": _vectors(6, 5)})
    assert r.status_code == 201, r.text
    return "clf"


@pytest.mark.parametrize("case", sorted(FIVE_HUNDREDS))
def test_former_500s_are_4xx_naming_the_problem(srv: Server, http, classifier, case: str):
    path, kwargs, status, needle = FIVE_HUNDREDS[case]
    r = http.post(path, **kwargs)
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert needle in r.json()["error"], r.json()["error"]
    assert srv.alive()


def test_no_5xx_was_counted(http):
    metrics = http.get("/metrics").text
    assert not [ln for ln in metrics.splitlines() if 'status="5' in ln and 'route="/readyz"' not in ln]


# ---- defect 6: non-finite values escape -----------------------------------------------------------------------------
def test_non_finite_results_are_refused_and_json_is_strict(http, classifier):
    r = http.post("/fewshot/clf/predict", content='{"embeddings": [[' + ", ".join(["3.5e38"] * DIM) + "]]}",
                  headers=JSON)  # finite in float64, infinite after the float32 cast: was "probability": null
    assert r.status_code == 422 and "float32" in r.json()["error"]
    pixels = {**PIXELS, "data": [3.0e38] * 3072}  # finite FP32 that drive the model to NaN: was a bare NaN
    r = http.post("/v2/models/msn/infer", json={"inputs": [pixels]})
    assert r.status_code == 400 and "non-finite" in _strict(r.text)["error"]
    ok = http.post("/fewshot/clf/predict?k=3", json={"embeddings": _vectors(2, 9)})
    probs = [p["probability"] for row in _strict(ok.text)["predictions"] for p in row]
    assert len(probs) == 6 and all(0 <= p <= 1 for p in probs)


# ---- defect 7: names ending in a newline -----------------------------------------------------------------------------
def test_names_are_full_matches(srv: Server, http):
    r = http.post("/index/abc%0A", json={})
    assert r.status_code == 422 and r.json()["error"].startswith("name:")
    assert http.post("/index/abc%0A/add", json={"ids": [1], "vectors": _vectors(1)}).status_code == 422
    r = http.post("/fewshot/fit", json={"name": "abc\n", "labels": ["a", "b"], "embeddings": _vectors(2)})
    assert r.status_code == 422 and r.json()["error"].startswith("name:")
    assert not [p.name for p in (srv.data_dir / "indexes").iterdir() if "\n" in p.name]


# ---- defect 8: an oversized chunked multipart body ------------------------------------------------------------------
def test_oversized_chunked_multipart_is_413_with_a_message(http):
    boundary = "xyzzy"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()

    def body():
        yield head
        for _ in range(10):  # 10 MiB through an 8 MiB limit, without a Content-Length
            yield b"\0" * MB
        yield f"\r\n--{boundary}--\r\n".encode()

    r = http.post("/embed", content=body(), headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and "max_body_mb" in r.json()["error"], r.text
    assert http.get("/healthz").status_code == 200
