"""End-to-end: a real ``msn-serve`` process on a loopback port, every endpoint over HTTP (httpx, tritonclient)."""
from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_helpers import Server, encode, random_image

from msn_core.bundle import load_bundle_info
from msn_core.masks import resolve_mask
from msn_serve.embedding.engine import Engine
from msn_serve.embedding.preprocess import preprocess_bytes


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(bundle_dir, tmp_path_factory.mktemp("http") / "data", "--max-body-mb", "4",
               "--max-images-per-request", "16", "--max-image-pixels", "50000000").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv: Server):
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def local(bundle_dir: Path):
    """The same model run in-process, to check what the server returns."""
    info = load_bundle_info(bundle_dir)
    eng = Engine(info, intra_op_threads=1)

    def embed(data: bytes, keep: np.ndarray | None = None) -> np.ndarray:
        px = preprocess_bytes(data, info.preprocessing, max_pixels=10**9)[None]
        k = np.arange(64, dtype=np.int64) if keep is None else np.asarray(keep, dtype=np.int64)
        return eng.run(px, k[None])[0]

    return embed


def _emb(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


IMG = encode(random_image(1))
IMG2 = encode(random_image(2, 60, 30))


# ---- health, docs, metadata ---------------------------------------------------------------------------------------
def test_health_ready_info_docs(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    info = http.get("/info").json()
    assert info["grid"] == 8 and info["dim"] == 64
    spec = http.get("/openapi.json").json()
    for path in ("/embed", "/fewshot/fit", "/fewshot/{name}/predict", "/index/{name}/add", "/index/{name}/search"):
        assert path in spec["paths"]
    assert "multipart/form-data" in spec["paths"]["/embed"]["post"]["requestBody"]["content"]
    assert http.get("/docs").status_code == 200


# ---- /embed ---------------------------------------------------------------------------------------------------------
def test_embed_multipart_json_and_normalize(http, local):
    one = _emb(http.post("/embed", files={"image": ("a.png", IMG)}))
    assert one.shape == (1, 64)
    np.testing.assert_allclose(one[0], local(IMG), atol=1e-6)
    body = http.post("/embed", files=[("images", ("a.png", IMG)), ("images", ("b.png", IMG2))]).json()
    assert body["count"] == 2 and body["dim"] == 64 and body["model_id"] and body["kept_tokens"] == [64, 64]
    assert "keep_idx" not in body  # only masked requests echo their kept patches
    b64 = [base64.b64encode(IMG).decode(), "data:image/png;base64," + base64.b64encode(IMG2).decode()]
    js = _emb(http.post("/embed", json={"images": b64, "normalize": True}))
    np.testing.assert_allclose(np.linalg.norm(js, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(js[1], local(IMG2) / np.linalg.norm(local(IMG2)), atol=1e-6)


def test_embed_masks(http, local):
    seeded = [_emb(http.post("/embed", files={"image": IMG}, data={"mask": '{"ratio": 0.75, "seed": 7}'}))
              for _ in range(2)]
    np.testing.assert_array_equal(seeded[0], seeded[1])
    r = http.post("/embed", files={"image": IMG}, data={"mask": '{"focal": {"size": 2}}'})
    assert r.json()["kept_tokens"] == [4] and r.json()["keep_idx"] == [[27, 28, 35, 36]]
    np.testing.assert_allclose(_emb(r)[0], local(IMG, [27, 28, 35, 36]), atol=1e-6)
    bitmap = [[1 if (r_ + c) % 2 == 0 else 0 for c in range(8)] for r_ in range(8)]
    r = http.post("/embed", json={"image": base64.b64encode(IMG).decode(), "mask": {"bitmap": bitmap}})
    assert r.json()["kept_tokens"] == [32]
    keep = [i for i in range(64) if (i // 8 + i % 8) % 2 == 0]
    np.testing.assert_allclose(_emb(r)[0], local(IMG, keep), atol=1e-6)
    r = http.post("/embed", files=[("images", IMG), ("images", IMG2)],
                  data={"mask": json.dumps([{"keep_idx": [1, 2, 3]}, None])})
    assert r.json()["kept_tokens"] == [3, 64]


def test_concurrent_masked_requests_match_sequential(srv: Server):
    masks = [None, '{"ratio": 0.5, "seed": 1}', '{"ratio": 0.9, "seed": 2}', '{"focal": {"size": 3}}',
             '{"keep_idx": [5]}', '{"ratio": 0.25, "seed": 4}']
    jobs = [(encode(random_image(10 + i)), masks[i % len(masks)]) for i in range(24)]

    def call(job):
        with srv.client() as c:
            data = {"mask": job[1]} if job[1] else {}
            return _emb(c.post("/embed", files={"image": job[0]}, data=data))[0]

    sequential = np.stack([call(j) for j in jobs])
    with ThreadPoolExecutor(12) as pool:
        concurrent = np.stack(list(pool.map(call, jobs)))
    np.testing.assert_array_equal(concurrent, sequential)


def _png16() -> bytes:
    arr = (np.linspace(0, 65535, 40 * 40).reshape(40, 40)).astype(np.uint16)
    return encode(Image.fromarray(arr))  # 16-bit greyscale PNG


def _cmyk() -> bytes:
    return encode(Image.fromarray(random_image(4)).convert("CMYK"), "JPEG", quality=95)


def _rgba() -> bytes:
    a = np.dstack([random_image(5), np.full((40, 48), 128, np.uint8)])
    return encode(Image.fromarray(a))


def _gif() -> bytes:
    im = Image.fromarray(random_image(6)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    im.info["transparency"] = 0
    return encode(im, "GIF", transparency=0)


def _exif_rotated() -> bytes:
    im = Image.fromarray(random_image(8, 30, 50))
    exif = im.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 CW on display
    return encode(im, "JPEG", exif=exif, quality=95)


UNUSUAL = {
    "1x1": lambda: encode(np.full((1, 1, 3), 200, np.uint8)),
    "png16": _png16, "cmyk_jpeg": _cmyk, "rgba": _rgba, "palette_gif": _gif,
    "tall_1x300": lambda: encode(random_image(9, 300, 1)), "wide_4000x3": lambda: encode(random_image(9, 3, 4000)),
    "grey_L": lambda: encode(Image.fromarray(random_image(3)).convert("L")),
    "bilevel_1": lambda: encode(Image.fromarray(random_image(3)).convert("1")),
    "exif_rotated_jpeg": _exif_rotated, "webp": lambda: encode(random_image(2), "WEBP"),
    "bmp": lambda: encode(random_image(2), "BMP"), "tiff": lambda: encode(random_image(2), "TIFF"),
}


@pytest.mark.parametrize("kind", sorted(UNUSUAL))
def test_unusual_valid_images_embed(http, local, kind):
    data = UNUSUAL[kind]()
    r = http.post("/embed", files={"image": (f"x.{kind}", data)})
    out = _emb(r)
    assert out.shape == (1, 64) and np.isfinite(out).all()
    np.testing.assert_allclose(out[0], local(data), atol=1e-6)


def test_unusual_images_are_converted_correctly(bundle_dir: Path):
    pre = load_bundle_info(bundle_dir).preprocessing
    grey8 = (np.linspace(0, 65535, 1600).reshape(40, 40) / 257).round().astype(np.uint8)
    a = preprocess_bytes(_png16(), pre, max_pixels=10**6)
    b = preprocess_bytes(encode(grey8), pre, max_pixels=10**6)
    assert np.abs(a - b).max() < 0.02  # 16-bit scaled to 8-bit, not clipped to white
    rot = preprocess_bytes(_exif_rotated(), pre, max_pixels=10**6)
    upright = Image.open(io.BytesIO(_exif_rotated())).transpose(Image.Transpose.ROTATE_270)
    np.testing.assert_allclose(rot, preprocess_bytes(encode(upright), pre, max_pixels=10**6), atol=1e-6)


# ---- bad inputs ------------------------------------------------------------------------------------------------------
def _bomb_png(w: int = 20000, h: int = 20000) -> bytes:
    """A tiny file whose header claims w x h pixels."""
    raw = bytearray(encode(np.zeros((1, 1, 3), np.uint8)))
    ihdr = struct.pack(">II", w, h) + bytes(raw[24:29])
    raw[16:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(raw)


JPEG = encode(random_image(3), "JPEG")
NAN_VECS = '{"ids": [1], "vectors": [[' + ", ".join(["NaN"] + ["0.5"] * 63) + "]]}"
BAD = {
    "truncated_jpeg": ("post", "/embed", {"files": {"image": JPEG[: len(JPEG) // 2]}}, 422),
    "zero_bytes": ("post", "/embed", {"files": {"image": b""}}, 422),
    "text_file": ("post", "/embed", {"files": {"image": ("a.txt", b"hello, I am not an image")}}, 422),
    "png_bomb": ("post", "/embed", {"files": {"image": _bomb_png()}}, 413),
    "invalid_base64": ("post", "/embed", {"json": {"image": "***not base64***"}}, 422),
    "base64_not_string": ("post", "/embed", {"json": {"images": [123]}}, 422),
    "images_not_list": ("post", "/embed", {"json": {"images": "abc"}}, 422),
    "json_not_object": ("post", "/embed", {"json": [1, 2]}, 422),
    "broken_json": ("post", "/embed", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422),
    "no_image": ("post", "/embed", {"json": {}}, 422),
    "image_as_text_field": ("post", "/embed", {"data": {"image": "abc"}, "files": {"x": b""}}, 422),
    "wrong_file_field": ("post", "/embed", {"files": {"picture": IMG}}, 422),
    "normalize_wrong_type": ("post", "/embed", {"files": {"image": IMG}, "data": {"normalize": "maybe"}}, 422),
    "mask_not_json": ("post", "/embed", {"files": {"image": IMG}, "data": {"mask": "{ratio"}}, 422),
    "mask_ratio_1": ("post", "/embed", {"files": {"image": IMG}, "data": {"mask": '{"ratio": 1.0}'}}, 422),
    "mask_ratio_negative": ("post", "/embed", {"files": {"image": IMG}, "data": {"mask": '{"ratio": -0.2}'}}, 422),
    "mask_wrong_grid": ("post", "/embed", {"json": {"image": base64.b64encode(IMG).decode(),
                                                    "mask": {"bitmap": [[1] * 14] * 14}}}, 422),
    "mask_list_wrong_length": ("post", "/embed", {"files": {"image": IMG}, "data": {"mask": "[null, null]"}}, 422),
    "unsupported_content_type": ("post", "/embed", {"content": b"x", "headers": {"content-type": "text/plain"}}, 415),
    "too_many_images": ("post", "/embed", {"files": [("images", IMG)] * 17}, 413),
    "body_too_large": ("post", "/embed", {"files": {"image": b"\0" * (5 * 2**20)}}, 413),
    "nan_vectors": ("post", "/index/bad/add", {"content": NAN_VECS.encode(),
                                               "headers": {"content-type": "application/json"}}, 422),
    "wrong_dim_vectors": ("post", "/index/bad/add", {"json": {"ids": [1], "vectors": [[0.1] * 5]}}, 422),
    "ragged_vectors": ("post", "/index/bad/add", {"json": {"ids": [1, 2], "vectors": [[0.1] * 64, [0.1]]}}, 422),
    "ids_wrong_type": ("post", "/index/bad/add", {"json": {"ids": "abc", "vectors": [[0.1] * 64]}}, 422),
    "negative_id": ("post", "/index/bad/add", {"json": {"ids": [-4], "vectors": [[0.1] * 64]}}, 422),
    "ids_count_mismatch": ("post", "/index/bad/add", {"json": {"ids": [1, 2], "vectors": [[0.1] * 64]}}, 422),
    "bad_index_option": ("post", "/index/opt", {"json": {"metric": "cosine"}}, 422),
    "single_class_fit": ("post", "/fewshot/fit", {"json": {"name": "one", "labels": ["a", "a"],
                                                           "embeddings": [[0.1] * 64, [0.2] * 64]}}, 422),
    "labels_wrong_type": ("post", "/fewshot/fit", {"json": {"name": "x", "labels": {"a": 1},
                                                            "embeddings": [[0.1] * 64]}}, 422),
    "labels_count_mismatch": ("post", "/fewshot/fit", {"json": {"name": "x", "labels": ["a", "b", "c"],
                                                                "embeddings": [[0.1] * 64, [0.3] * 64]}}, 422),
    "lambd_not_number": ("post", "/fewshot/fit", {"json": {"name": "x", "labels": ["a", "b"], "lambd": "big",
                                                           "embeddings": [[0.1] * 64, [0.3] * 64]}}, 422),
    "bad_classifier_name": ("post", "/fewshot/fit", {"json": {"name": "../etc", "labels": ["a", "b"],
                                                              "embeddings": [[0.1] * 64, [0.3] * 64]}}, 422),
    "unknown_classifier": ("post", "/fewshot/nope/predict", {"files": {"image": IMG}}, 404),
    "unknown_classifier_delete": ("delete", "/fewshot/nope", {}, 404),
    "bad_name_in_path": ("get", "/index/bad%20name!", {}, 422),
    "unknown_index": ("post", "/index/nope/search", {"files": {"image": IMG}}, 404),
    "unknown_index_stats": ("get", "/index/nope", {}, 404),
    "k_not_int": ("post", "/index/bad/search?k=abc", {"json": {"vectors": [[0.1] * 64]}}, 422),
    "k_zero": ("post", "/index/bad/search", {"json": {"vectors": [[0.1] * 64], "k": 0}}, 422),
    "image_as_text_only": ("post", "/embed", {"files": {"image": (None, "abc")}}, 422),
    "unknown_route": ("get", "/no/such/route", {}, 404),
    "wrong_method": ("get", "/embed", {}, 405),
    "oip_unknown_model": ("post", "/v2/models/nope/infer", {"json": {"inputs": []}}, 404),
    "oip_wrong_shape": ("post", "/v2/models/msn/infer", {"json": {"inputs": [
        {"name": "pixel_values", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}}, 400),
    "oip_data_mismatch": ("post", "/v2/models/msn/infer", {"json": {"inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 7}]}}, 400),
    "oip_bad_binary_size": ("post", "/v2/models/msn/infer", {
        "content": b'{"inputs":[{"name":"pixel_values","shape":[1,3,32,32],"datatype":"FP32",'
                   b'"parameters":{"binary_data_size":12288}}]}' + b"\0" * 10,
        "headers": {"Inference-Header-Content-Length": "111"}}, 400),
    "oip_keep_idx_out_of_range": ("post", "/v2/models/msn/infer", {"json": {"inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072},
        {"name": "keep_idx", "shape": [1, 2], "datatype": "INT64", "data": [0, 64]}]}}, 400),
    "oip_mask_and_keep_idx": ("post", "/v2/models/msn/infer", {"json": {"parameters": {"mask": {"ratio": 0.5}},
                                                                        "inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072},
        {"name": "keep_idx", "shape": [1, 2], "datatype": "INT64", "data": [0, 1]}]}}, 400),
    "oip_bad_mask_parameter": ("post", "/v2/models/msn/infer", {"json": {"parameters": {"mask": "{\"ratio\": 1}"},
                                                                         "inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}]}}, 400),
    "oip_all_padding_row": ("post", "/v2/models/msn/infer", {"json": {"inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072},
        {"name": "keep_idx", "shape": [1, 2], "datatype": "INT64", "data": [-1, -1]}]}}, 400),
    "oip_nan_pixels": ("post", "/v2/models/msn/infer", {
        "content": b'{"inputs":[{"name":"pixel_values","shape":[1,3,32,32],"datatype":"FP32","data":[NaN'
                   + b",0" * 3071 + b"]}]}", "headers": {"content-type": "application/json"}}, 400),
}


def test_bad_input_corpus_gets_clear_4xx_and_server_survives(srv: Server, http):
    assert http.post("/index/bad", json={}).status_code == 201
    failures = []
    for name, (method, path, kw, want) in BAD.items():
        try:
            r = getattr(http, method)(path, **kw)
        except Exception as e:  # noqa: BLE001 - report every case, not just the first
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        if r.status_code != want or not isinstance(body, dict) or not body.get("error"):
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    assert srv.alive()
    assert http.get("/healthz").status_code == 200 and http.get("/readyz").status_code == 200
    assert _emb(http.post("/embed", files={"image": IMG})).shape == (1, 64)
    metrics = http.get("/metrics").text
    assert 'msn_errors_total{kind="bad_image"}' in metrics
    server_errors = [ln for ln in metrics.splitlines() if 'status="5' in ln and 'route="/readyz"' not in ln]
    assert not server_errors, server_errors  # (/readyz may have said 503 while the fixture waited for warm-up)


def test_chunked_body_over_the_limit_is_413(http):
    def gen():
        for _ in range(6):
            yield b"\0" * 2**20

    r = http.post("/embed", content=gen(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]
    assert http.get("/healthz").status_code == 200


def test_error_messages_name_the_problem(http):
    r = http.post("/embed", files={"image": IMG}, data={"mask": '{"bitmap": [[1, 1], [1, 1]]}'})
    assert r.status_code == 422 and "8x8" in r.json()["error"]
    r = http.post("/embed", files={"image": _bomb_png()})
    assert "20000x20000" in r.json()["error"]
    r = http.post("/embed", files=[("images", IMG), ("images", b"")])
    assert r.status_code == 422 and "images[1]" in r.json()["error"]


# ---- few-shot --------------------------------------------------------------------------------------------------------
def test_fewshot_fit_predict_list_delete(http, local):
    tints = {"boot": (1.0, 0.2, 0.2), "sandal": (0.2, 1.0, 0.2), "shirt": (0.2, 0.2, 1.0)}
    labels = ["boot", "sandal", "shirt"] * 2
    imgs = [encode((random_image(100 + i) * np.array(tints[lbl])).astype(np.uint8)) for i, lbl in enumerate(labels)]
    files = [("images", (f"{i}.png", d)) for i, d in enumerate(imgs)]
    r = http.post("/fewshot/fit", files=files, data={"name": "shoes", "labels": json.dumps(labels)})
    assert r.status_code == 201, r.text
    assert r.json()["classes"] == ["boot", "sandal", "shirt"] and r.json()["n"] == 6
    assert http.post("/fewshot/fit", files=files, data={"name": "shoes", "labels": json.dumps(labels)}).status_code \
        == 409
    pred = http.post("/fewshot/shoes/predict?k=2", files=[("images", d) for d in imgs]).json()["predictions"]
    assert [p[0]["label"] for p in pred] == labels  # training points are recovered
    assert all(len(p) == 2 and p[0]["probability"] >= p[1]["probability"] for p in pred)
    emb = np.stack([local(d) for d in imgs])
    r = http.post("/fewshot/fit", json={"name": "byvec", "labels": labels, "embeddings": emb.tolist(),
                                        "lambd": 0.01})
    assert r.status_code == 201 and r.json()["lambd"] == 0.01
    pv = http.post("/fewshot/byvec/predict", json={"embeddings": emb[:2].tolist(), "k": 1}).json()
    assert [p[0]["label"] for p in pv["predictions"]] == labels[:2]
    names = [c["name"] for c in http.get("/fewshot").json()["classifiers"]]
    assert {"shoes", "byvec"} <= set(names)
    assert http.get("/fewshot/shoes").json()["classes"] == ["boot", "sandal", "shirt"]
    assert http.delete("/fewshot/byvec").status_code == 200
    assert http.get("/fewshot/byvec").status_code == 404


# ---- FAISS indexes ---------------------------------------------------------------------------------------------------
def test_index_lifecycle(http, local):
    imgs = [encode(random_image(200 + i)) for i in range(5)]
    r = http.post("/index/catalog/add", files=[("images", d) for d in imgs],
                  data={"ids": "[10, 11, 12, 13, 14]", "metadata": json.dumps([{"sku": i} for i in range(5)])})
    assert r.status_code == 200 and r.json()["ntotal"] == 5  # created on first add with defaults
    hit = http.post("/index/catalog/search?k=3", files={"image": imgs[2]}).json()["results"][0]
    assert hit[0]["id"] == 12 and hit[0]["metadata"] == {"sku": 2} and hit[0]["score"] == pytest.approx(1, abs=1e-5)
    vec = local(imgs[4])
    hit = http.post("/index/catalog/search", json={"vectors": [vec.tolist()], "k": 2}).json()["results"][0]
    assert hit[0]["id"] == 14
    r = http.post("/index/catalog/add", json={"ids": [10], "vectors": [vec.tolist()]})  # re-add = replace
    assert r.status_code == 200 and r.json()["replaced"] == 1 and r.json()["ntotal"] == 5
    hit = http.post("/index/catalog/search", json={"vectors": [vec.tolist()], "k": 2}).json()["results"][0]
    assert {h["id"] for h in hit} == {10, 14} and "metadata" not in hit[0]  # the replacement had no metadata
    d = http.post("/index/catalog/delete", json={"ids": [12, 999]}).json()
    assert d["removed"] == 1 and d["not_found"] == [999] and d["ntotal"] == 4
    assert http.get("/index/catalog").json()["ntotal"] == 4
    assert http.post("/index/l2idx", json={"metric": "l2", "type": "hnsw"}).status_code == 201
    assert http.post("/index/l2idx", json={}).status_code == 409
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((20, 64)).astype(np.float32)
    assert http.post("/index/l2idx/add", json={"ids": list(range(20)), "vectors": vecs.tolist()}).status_code == 200
    res = http.post("/index/l2idx/search", json={"vectors": vecs[3:5].tolist(), "k": 1}).json()
    assert [r[0]["id"] for r in res["results"]] == [3, 4] and res["results"][0][0]["score"] == pytest.approx(0)
    assert http.post("/index/l2idx/delete", json={"ids": [1]}).status_code == 409  # hnsw cannot delete
    same = http.post("/index/l2idx/add", json={"ids": [3, 20], "vectors": vecs[3:5].tolist()})  # a retry: no-op
    assert same.status_code == 200 and same.json() == {"name": "l2idx", "added": 1, "replaced": 0, "ntotal": 21}
    assert http.post("/index/l2idx/add", json={"ids": [3], "vectors": vecs[5:6].tolist()}).status_code == 409
    assert http.post("/index/ivfidx", json={"type": "ivf", "nlist": 4}).status_code == 201
    assert http.post("/index/ivfidx/add", json={"ids": [1], "vectors": [vecs[0].tolist()]}).status_code == 422
    assert http.post("/index/ivfidx/add", json={"ids": list(range(20)), "vectors": vecs.tolist()}).status_code == 200
    res = http.post("/index/ivfidx/search?nprobe=4", json={"vectors": vecs[7:8].tolist(), "k": 1}).json()
    assert res["results"][0][0]["id"] == 7
    names = {i["name"] for i in http.get("/index").json()["indexes"]}
    assert {"catalog", "l2idx", "ivfidx"} <= names
    assert http.delete("/index/l2idx").status_code == 200 and http.get("/index/l2idx").status_code == 404


# ---- Open Inference Protocol -----------------------------------------------------------------------------------------
def test_oip_with_tritonclient_binary_and_json(srv: Server, http, bundle_dir: Path):
    import tritonclient.http as tc

    info = load_bundle_info(bundle_dir)
    client = tc.InferenceServerClient(srv.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("msn")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.get_model_config("msn")["input"][0]["dims"] == [3, 32, 32]
    meta = client.get_model_metadata(info.model_id)
    assert meta["outputs"][0] == {"name": "embedding", "datatype": "FP32", "shape": [-1, 64]}
    imgs = [encode(random_image(300 + i)) for i in range(3)]
    px = np.stack([preprocess_bytes(d, info.preprocessing, max_pixels=10**6) for d in imgs])
    ref = _emb(http.post("/embed", files=[("images", d) for d in imgs], data={"mask": '{"ratio": 0.5, "seed": 3}'}))
    keep = np.tile(resolve_mask({"ratio": 0.5, "seed": 3}, 8), (3, 1))
    for binary_in in (True, False):
        for binary_out in (True, False):
            a = tc.InferInput("pixel_values", list(px.shape), "FP32")
            a.set_data_from_numpy(px, binary_data=binary_in)
            k = tc.InferInput("keep_idx", list(keep.shape), "INT64")
            k.set_data_from_numpy(keep, binary_data=binary_in)
            out = tc.InferRequestedOutput("embedding", binary_data=binary_out)
            res = client.infer("msn", [a, k], outputs=[out], request_id="req-7")
            assert res.get_response()["id"] == "req-7"
            np.testing.assert_allclose(res.as_numpy("embedding"), ref, atol=1e-6)
    a = tc.InferInput("pixel_values", list(px.shape), "FP32")
    a.set_data_from_numpy(px)
    full = client.infer(info.model_id, [a]).as_numpy("embedding")  # default: binary in, binary out
    assert full.shape == (3, 64)
    by_spec = client.infer("msn", [a], parameters={"mask": '{"ratio": 0.5, "seed": 3}'})  # /embed's mask, via OIP
    np.testing.assert_allclose(by_spec.as_numpy("embedding"), ref, atol=1e-6)
    padded = np.tile(np.arange(64, dtype=np.int64), (3, 1))
    padded[1] = np.r_[keep[1], [-1] * (64 - keep.shape[1])]  # mixed K in one request: -1 padding
    k = tc.InferInput("keep_idx", list(padded.shape), "INT64")
    k.set_data_from_numpy(padded)
    mixed = client.infer("msn", [a, k]).as_numpy("embedding")
    np.testing.assert_allclose(mixed[1], ref[1], atol=1e-6)
    gz = client.infer("msn", [a], request_compression_algorithm="gzip", response_compression_algorithm="gzip")
    np.testing.assert_array_equal(gz.as_numpy("embedding"), full)
    with pytest.raises(tc.InferenceServerException, match="unknown model"):
        client.infer("nope", [a])
    client.close()


# ---- metrics ---------------------------------------------------------------------------------------------------------
def test_metrics_exposes_requests_queue_batches_tokens(http):
    http.post("/embed", files={"image": IMG}, data={"mask": '{"ratio": 0.5, "seed": 1}'})
    assert http.post("/embed", files={"image": b"junk"}).status_code == 422
    text = http.get("/metrics").text
    for needle in ('msn_http_requests_total{method="POST",route="/embed",status="200"}',
                   'msn_http_request_seconds_bucket', "msn_queue_depth", "msn_batch_size_bucket",
                   'msn_kept_tokens_bucket{le="32.0"}', "msn_inference_seconds", "msn_ready 1.0",
                   'msn_errors_total{kind="http_422"}'):
        assert needle in text, needle


def _batches(http) -> tuple[float, float]:
    """(batches run, images in them) from ``/metrics``' ``msn_batch_size`` histogram."""
    found = {}
    for line in http.get("/metrics").text.splitlines():
        for name in ("msn_batch_size_count", "msn_batch_size_sum"):
            if line.startswith(name):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found["msn_batch_size_count"], found["msn_batch_size_sum"]


def test_several_images_of_one_request_make_one_batch(http, local):
    """Every image of a request enters the batcher together (one submit), not one round trip per image: with no
    other traffic, one request of n images is one batch of n, for ``/embed`` and ``/v1/embeddings`` alike."""
    imgs = [encode(random_image(s, 40 + s, 48)) for s in range(5)]
    count0, images0 = _batches(http)
    r = http.post("/embed", files=[("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(imgs)])
    np.testing.assert_allclose(_emb(r)[3], local(imgs[3]), atol=1e-4)
    count1, images1 = _batches(http)
    assert (count1 - count0, images1 - images0) == (1, 5)
    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in imgs[:3]]
    r = http.post("/v1/embeddings", json={"input": urls, "model": "msn"})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 3
    assert _batches(http) == (count1 + 1, images1 + 3)
