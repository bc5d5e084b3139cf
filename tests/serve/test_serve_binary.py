"""Binary ``/embed`` responses over a real uvicorn server on loopback and real ONNX Runtime: the raw float32 and
``.npy`` bodies hold exactly the JSON embeddings, and content negotiation answers 406 as JSON."""
from __future__ import annotations

import io

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image


def png_bytes(seed: int) -> bytes:
    return encode(random_image(seed))


def _json_embeddings(c, files, data=None) -> tuple[np.ndarray, dict]:
    r = c.post("/embed", files=files, data=data)
    assert r.status_code == 200, r.text
    body = r.json()
    return np.asarray(body["embeddings"], dtype=np.float32), body


def test_octet_stream_is_the_json_matrix_as_little_endian_float32(server: Server):
    files = [("images", png_bytes(seed=s)) for s in range(3)]
    with server.client() as c:
        ref, body = _json_embeddings(c, files, {"normalize": "true"})
        r = c.post("/embed", files=files, data={"normalize": "true"}, headers={"Accept": "application/octet-stream"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/octet-stream"
        n, dim = (int(x) for x in r.headers["x-embedding-shape"].split(","))
        assert (n, dim) == (3, body["dim"]) and len(r.content) == n * dim * 4
        assert r.headers["x-embedding-dtype"] == "<f4" and r.headers["x-model-id"] == body["model_id"]
        assert r.headers["x-normalized"] == "true"
        assert r.headers["x-kept-tokens"] == ",".join(str(k) for k in body["kept_tokens"])
        got = np.frombuffer(r.content, dtype="<f4").reshape(n, dim)
        # JSON carries float32 values exactly (shortest repr round-trips), so the bytes must match bit for bit
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_npy_response_loads_with_numpy_and_follows_mask_and_normalize(server: Server):
    files = [("images", png_bytes(seed=7)), ("images", png_bytes(seed=8))]
    data = {"mask": '{"ratio": 0.5, "seed": 3}'}
    with server.client() as c:
        ref, body = _json_embeddings(c, files, data)
        r = c.post("/embed", files=files, data=data, headers={"Accept": "application/x-npy"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-npy" and r.headers["x-normalized"] == "false"
        arr = np.load(io.BytesIO(r.content), allow_pickle=False)
        assert arr.dtype == np.dtype("<f4") and arr.shape == ref.shape
        np.testing.assert_array_equal(arr, ref)
        assert r.headers["x-kept-tokens"] == ",".join(str(k) for k in body["kept_tokens"])
        assert "keep_idx" in body and body["kept_tokens"] == [len(k) for k in body["keep_idx"]]


@pytest.mark.parametrize("accept, expected", [
    ("application/json", "application/json"),
    ("*/*", "application/json"),
    ("text/html, application/octet-stream;q=0.9", "application/octet-stream"),
    ("application/json;q=0.5, application/x-npy", "application/x-npy"),
])
def test_accept_header_picks_the_format(server: Server, accept: str, expected: str):
    with server.client() as c:
        r = c.post("/embed", files={"image": png_bytes(seed=1)}, headers={"Accept": accept})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].split(";")[0] == expected


def test_unacceptable_accept_is_406_json_and_errors_stay_json(server: Server):
    with server.client() as c:
        r = c.post("/embed", files={"image": png_bytes(seed=1)}, headers={"Accept": "text/csv"})
        assert r.status_code == 406
        assert "application/octet-stream" in r.json()["error"]
        r = c.post("/embed", files={"image": b"not an image"}, headers={"Accept": "application/octet-stream"})
        assert r.status_code == 422 and r.headers["content-type"] == "application/json"
        assert "image" in r.json()["error"]
