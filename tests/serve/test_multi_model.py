"""Several models in one ``msn-serve`` (real servers, ONNX Runtime, FAISS, cyanure).

Two tiny bundles of different model ids, widths and patch grids in one process: every API routes by model name,
stores embed with the model that made them, ``/readyz`` and ``/metrics`` report each model, and a model replaced
while requests are in flight loses none of them.
"""
from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from serve_helpers import PREPROCESSING, Server, encode, random_image

from msn_core.bundle import load_bundle_info

IMAGES = [encode(random_image(s)) for s in range(4)]


@pytest.fixture(scope="module")
def bundle_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model: other weights, width 48 and a 4 x 4 patch grid (the session bundle: 64 wide, 8 x 8)."""
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(2)
    encoder = VisionTransformer(image_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)
    out = tmp_path_factory.mktemp("bundle-b") / "tiny-b"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=PREPROCESSING, feature="cls_pre_norm",
                  parity_check=False)
    return out


@pytest.fixture(scope="module")
def two(bundle_dir: Path, bundle_b: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(f"a={bundle_dir}", tmp_path_factory.mktemp("two") / "data", "--bundle", f"b={bundle_b}").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def only_b(bundle_b: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(bundle_b, tmp_path_factory.mktemp("only-b") / "data").start()
    yield srv
    srv.stop()


def _embed(srv: Server, model: str | None = None, mask: str | None = None) -> dict:
    data = {k: v for k, v in (("model", model), ("mask", mask)) if v is not None}
    with srv.client() as c:
        r = c.post("/embed", files=[("images", b) for b in IMAGES], data=data)
    assert r.status_code == 200, r.text
    return r.json()


def test_embed_routes_by_model(two: Server, server: Server, only_b: Server, bundle_dir: Path, bundle_b: Path):
    """Each model's vectors are the one-model server's; no model = the first (default) one."""
    a, b = load_bundle_info(bundle_dir).model_id, load_bundle_info(bundle_b).model_id
    assert a != b
    one_a, one_b = np.asarray(_embed(server)["embeddings"]), np.asarray(_embed(only_b)["embeddings"])
    assert one_a.shape == (4, 64) and one_b.shape == (4, 48)
    for model, want, model_id in ((None, one_a, a), ("a", one_a, a), ("b", one_b, b)):
        body = _embed(two, model)
        assert body["model_id"] == model_id
        assert np.abs(np.asarray(body["embeddings"]) - want).max() <= 1e-5, model
    mask = '{"ratio": 0.5, "seed": 3}'  # resolved on each model's own patch grid (16 patches for b, 64 for a)
    masked, alone = _embed(two, "b", mask), _embed(only_b, None, mask)
    assert np.asarray(masked["keep_idx"]).max() < 16 and masked["keep_idx"] == alone["keep_idx"]
    assert np.abs(np.asarray(masked["embeddings"]) - np.asarray(alone["embeddings"])).max() <= 1e-5
    with two.client() as c:
        r = c.post("/embed", files={"image": IMAGES[0]}, data={"model": "nope"})
        assert r.status_code == 404 and "'a'" in r.json()["error"] and "'b'" in r.json()["error"]
        png = base64.b64encode(IMAGES[0]).decode()
        r = c.post("/v1/embeddings", json={"model": "b", "input": [f"data:image/png;base64,{png}"]})
        assert r.status_code == 200 and r.json()["model"] == b
        assert np.abs(np.asarray(r.json()["data"][0]["embedding"]) - one_b[0]).max() <= 1e-5
        listed = openai.OpenAI(base_url=f"{two.url}/v1", api_key="unused", max_retries=0).models.list().data
        assert [(m.id, m.model_id) for m in listed] == [("a", a), ("b", b)]  # id: the served name
        assert c.get(f"/v1/models/{b}").json()["id"] == "b" and c.get("/v1/models/b").json()["model_id"] == b
        meta = c.get("/v2/models/b").json()
        assert meta["name"] == b and meta["outputs"][0]["shape"] == [-1, 48]
        assert c.get(f"/v2/models/{a}").json()["parameters"]["model"] == "a"  # the default's id, as before
        pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
        infer = {"inputs": [{"name": "pixel_values", "shape": [2, 3, 32, 32], "datatype": "FP32",
                             "data": pixels.reshape(-1).tolist()}]}
        r = c.post("/v2/models/b/infer", json=infer)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 48], r.text
        assert c.get("/info", params={"model": "b"}).json()["grid"] == 4
        assert [m["name"] for m in c.get("/info").json()["models"]] == ["a", "b"]


def test_stores_embed_with_their_model(two: Server, bundle_b: Path):
    """An index and a classifier made with model b embed query images with b, whatever the default is; the label
    loop refuses to mix a classifier of b with an index of a."""
    b = load_bundle_info(bundle_b).model_id
    files = [("images", x) for x in IMAGES]
    with two.client() as c:
        r = c.post("/index/ib", json={"model": "b"})
        assert r.status_code == 201 and r.json()["dim"] == 48 and r.json()["model_id"] == b, r.text
        assert c.post("/index/ib/add", files=files, data={"ids": "[0, 1, 2, 3]"}).status_code == 200
        r = c.post("/index/ib/search", files=[("images", IMAGES[2])], data={"k": "2", "mask": '{"ratio": 0.25}'})
        assert r.status_code == 200 and len(r.json()["results"][0]) == 2, r.text  # a mask on b's 4 x 4 grid
        r = c.post("/index/ib/search", files=[("images", IMAGES[2])])
        assert r.json()["results"][0][0]["id"] == 2 and r.json()["results"][0][0]["score"] > 0.999
        assert c.post("/index/ib/search", json={"vectors": [[0.0] * 64]}).status_code == 422  # width only
        fit = c.post("/fewshot/fit", files=files, data={"name": "cb", "labels": '["x", "x", "y", "y"]',
                                                        "model": "b"})
        assert fit.status_code == 201, fit.text
        assert fit.json()["dim"] == 48 and fit.json()["model_id"] == b
        r = c.post("/fewshot/cb/predict", files=[("images", IMAGES[0])])
        assert r.status_code == 200 and r.json()["model_id"] == b, r.text
        assert c.post("/index/ia/add", files=files, data={"ids": "[0, 1, 2, 3]"}).status_code == 200  # default: a
        r = c.post("/fewshot/cb/suggest", json={"index": "ia", "n": 2})
        assert r.status_code == 409 and "same model" in r.json()["error"]
        r = c.post("/fewshot/fit", json={"name": "ci", "labels": ["x", "y"], "index": "ib", "ids": [0, 3]})
        assert r.status_code == 201 and r.json()["model_id"] == b, r.text


def test_readiness_and_metrics_per_model(two: Server):
    with two.client() as c:
        ready = c.get("/readyz").json()
        assert ready["ready"] and set(ready["models"]) == {"a", "b"} and ready["model"] == "a"
        assert all(m["ready"] and m["warmed_up"] for m in ready["models"].values())
        one = c.get("/readyz", params={"model": "b"})
        assert one.status_code == 200 and one.json()["model"] == "b"
        assert c.get("/readyz", params={"model": "zzz"}).status_code == 404
        assert c.get("/v2/models/b/ready").status_code == 200
        _embed(two, "b")
        text = c.get("/metrics").text
    for needle in ('msn_ready{model="a"} 1.0', 'msn_ready{model="b"} 1.0', 'msn_batch_size_count{model="b"}',
                   'msn_model_info{device="cpu",model="b"'):
        assert needle in text, needle


def test_replace_under_load_loses_nothing_then_delete(two: Server, bundle_dir: Path, bundle_b: Path,
                                                      tmp_path: Path):
    """PUT swaps model b for bundle a's weights while four clients embed with b: every request answers 200, each
    with one model's vectors whole; a bad bundle is a 4xx and b keeps serving; DELETE removes b, not the last."""
    statuses: list[int] = []
    widths: set[int] = set()
    stop = threading.Event()

    def hammer() -> None:
        with two.client() as c:
            while not stop.is_set():
                r = c.post("/embed", files={"image": IMAGES[1]}, data={"model": "b"})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    widths.add(len(r.json()["embeddings"][0]))

    with two.client(timeout=120) as c:
        bad = c.put("/admin/models/b", json={"bundle": str(tmp_path / "missing")})
        assert 400 <= bad.status_code < 500 and "missing" in bad.json()["error"]
        assert c.put("/admin/models/b", json={"bundel": str(bundle_dir)}).status_code == 422
        assert c.put("/admin/models/bad*name", json={"bundle": str(bundle_dir)}).status_code == 422
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            r = c.put("/admin/models/b", json={"bundle": str(bundle_dir)})
            assert r.status_code == 200 and r.json()["replaced"] and r.json()["dim"] == 64, r.text
            after, deadline = len(statuses), time.monotonic() + 30
            while len(statuses) < after + 20:  # requests keep flowing on the new model
                assert time.monotonic() < deadline, "no requests answered after the replacement"
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        assert widths == {48, 64}
        a_id = load_bundle_info(bundle_dir).model_id  # now served as both a and b: two ids, one model_id
        listed = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["model_id"]) for m in listed] == [("a", a_id), ("b", a_id)]
        url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
        ambiguous = c.post("/v1/embeddings", json={"model": a_id, "input": [url]})
        assert ambiguous.status_code == 400 and "'a', 'b'" in ambiguous.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"model": "b", "input": [url]}).json()["model"] == a_id
        assert c.get("/readyz", params={"model": "b"}).status_code == 200
        r = c.post("/index/ib/search", files=[("images", IMAGES[0])])  # b's old model id is served no more
        assert r.status_code == 409, r.text
        added = c.put("/admin/models/c", json={"bundle": str(bundle_b)})
        assert added.status_code == 200 and not added.json()["replaced"]
        assert c.post("/index/ib/search", files=[("images", IMAGES[0])]).status_code == 200  # c serves b's id
        assert c.delete("/admin/models/b").status_code == 200
        assert c.post("/embed", files={"image": IMAGES[0]}, data={"model": "b"}).status_code == 404
        assert c.delete("/admin/models/c").status_code == 200
        last = c.delete("/admin/models/a")
        assert last.status_code == 409 and "only model" in last.json()["error"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a"]


def test_one_unnamed_bundle_is_the_default_model(server: Server):
    """The one-bundle command line is unchanged; its model is called ``default``, and only it is listed."""
    with server.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["default"]
        assert c.post("/embed", files={"image": IMAGES[0]}, data={"model": "default"}).status_code == 200
        text = c.get("/metrics").text
        assert "msn_ready 1.0" in text and 'model="default"' not in text  # no label with one model


def test_models_dir_and_sighup(bundle_dir: Path, bundle_b: Path, tmp_path: Path):
    """``--models-dir``: each subfolder with msn.json is a model; SIGHUP adds new ones and drops removed ones."""
    import signal

    models = tmp_path / "models"
    models.mkdir()
    (models / "m1").symlink_to(bundle_dir)
    (models / "notes").mkdir()  # no msn.json: not a model
    srv = Server(bundle_b, tmp_path / "data", "--models-dir", str(models)).start()
    try:
        with srv.client() as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["default", "m1"]
            (models / "m2").symlink_to(bundle_b)
            (models / "m1").unlink()
            srv.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while [m["id"] for m in c.get("/v1/models").json()["data"]] != ["default", "m2"]:
                assert time.monotonic() < deadline, c.get("/v1/models").text
                time.sleep(0.1)
            assert c.post("/embed", files={"image": IMAGES[0]}, data={"model": "m2"}).status_code == 200
    finally:
        srv.stop()


def test_reader_refuses_several_models(bundle_dir: Path, bundle_b: Path, tmp_path: Path):
    import subprocess
    import sys

    (tmp_path / "data").mkdir()
    r = subprocess.run([sys.executable, "-m", "msn_serve", "--bundle", f"a={bundle_dir}", "--bundle",
                        f"b={bundle_b}", "--data-dir", str(tmp_path / "data"), "--read-only", "--port", "0"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "read-only replica serves one model" in r.stderr, r.stderr
