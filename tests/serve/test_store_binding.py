"""Indexes and classifiers are bound to the model that made them (real servers, FAISS, cyanure, ONNX Runtime).

A data directory written under bundle A and served with a retrained bundle B of the same width must refuse every
call on A's stores with a 409 naming both model ids, change no byte of them, and ``msn-index migrate`` must bring an
index built from image files back under B.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import PREPROCESSING, Server, encode, random_image

from msn_core.bundle import load_bundle_info
from msn_serve.errors import ModelMismatch, check_model, model_matches
from msn_serve.index_tools import cli as msn_index

N_IMAGES = 12


@pytest.fixture(scope="module")
def bundle_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture and width as the session bundle, other weights: a retrained model."""
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(1)
    encoder = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    out = tmp_path_factory.mktemp("bundle-b") / "tiny-b"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=PREPROCESSING, feature="cls_pre_norm",
                  parity_check=False)
    return out


def _tree_bytes(root: Path) -> dict[str, str]:
    """sha256 of every file under the data directory, except the runtime-choice cache (per model, by design) and
    the lock file (it names the process holding it)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] not in ("cache", ".lock")}


def _assert_mismatch(r, a: str, b: str) -> None:
    assert r.status_code == 409, (r.status_code, r.text)
    body = r.json()
    assert a in body["error"] and b in body["error"], body
    assert "migrate" in body["error"] or "refit" in body["error"], body
    assert body["detail"]["store_model_id"] == a and body["detail"]["server_model_id"] == b


def test_a_store_without_a_model_id_is_unknown_not_foreign():
    """Stores written before they recorded their model stay usable; any recorded id must match exactly."""
    assert model_matches("", "m-1") and model_matches(None, "m-1") and model_matches("m-1", "m-1")
    assert not model_matches("m-0", "m-1")
    with pytest.raises(ModelMismatch) as e:
        check_model("classifier", "c", "m-0", "m-1")
    assert e.value.status == 409 and "m-0" in e.value.message and "m-1" in e.value.message


@pytest.mark.slow  # three real servers, two bundles and an msn-embed run: the whole life of a data directory
def test_stores_of_another_model_are_refused_unchanged_and_migrate_restores_search(bundle_dir, bundle_b, tmp_path):
    from training.bundle.embed import main as msn_embed  # the test may use torch; the server never does

    a, b = load_bundle_info(bundle_dir).model_id, load_bundle_info(bundle_b).model_id
    assert a != b
    images = tmp_path / "images"
    images.mkdir()
    pngs = [encode(random_image(s)) for s in range(N_IMAGES)]
    for s, png in enumerate(pngs):
        (images / f"img{s:02d}.png").write_bytes(png)
    data = tmp_path / "data"
    assert msn_embed(["--bundle", str(bundle_dir), "--data", str(images), "--out", str(tmp_path / "emb"),
                      "--workers", "0", "--threads", "1"]) == 0
    assert msn_index.main(["build", "--embeddings", str(tmp_path / "emb"), "--data-dir", str(data), "--name",
                           "built", "--index-type", "flat", "--store-paths", "--queries", "4", "--k", "3"]) == 0
    paths = {int(json.loads(line)["id"]): json.loads(line)["path"]
             for line in (tmp_path / "emb" / "shard-00000.paths.jsonl").read_text().splitlines()}

    srv = Server(bundle_dir, data).start()
    try:
        with srv.client() as c:
            assert c.post("/index/built/search", files={"image": pngs[0]}, data={"k": "1"}).status_code == 200
            r = c.post("/index/live/add", files=[("images", png) for png in pngs[:6]], data={"ids": "[0,1,2,3,4,5]"})
            assert r.status_code == 200, r.text
            r = c.post("/fewshot/fit", files=[("images", png) for png in pngs[:6]],
                       data={"name": "clf", "labels": json.dumps(["x", "y"] * 3)})
            assert r.status_code == 201, r.text
            assert c.get("/fewshot").json()["classifiers"][0]["model_matches"] is True
        srv.kill9()  # the live index's WAL is left un-compacted: a start and stop under B must not touch it either
    finally:
        srv.stop()
    before = _tree_bytes(data)
    assert any(k.endswith("wal.log") for k in before)

    srv = Server(bundle_b, data).start()
    try:
        log = srv.log()
        for name in ("built", "live", "clf"):
            assert any(name in line and a in line and b in line and "WARNING" in line for line in log.splitlines()), \
                name
        vec = np.ones((1, 64), np.float32).tolist()
        with srv.client() as c:
            listed = {i["name"]: i for i in c.get("/index").json()["indexes"]}
            assert {n: (i["model_id"], i["model_matches"]) for n, i in listed.items()} == \
                {"built": (a, False), "live": (a, False)}
            clf = c.get("/fewshot").json()["classifiers"][0]
            assert (clf["model_id"], clf["model_matches"]) == (a, False)
            for name in ("built", "live"):
                _assert_mismatch(c.post(f"/index/{name}/search", files={"image": pngs[0]}), a, b)
                _assert_mismatch(c.post(f"/index/{name}/search", json={"vectors": vec, "k": 2}), a, b)
                _assert_mismatch(c.post(f"/index/{name}/add", json={"ids": [99], "vectors": vec}), a, b)
                _assert_mismatch(c.post(f"/index/{name}/add", files={"image": pngs[0]}, data={"ids": "[98]"}), a, b)
                _assert_mismatch(c.post(f"/index/{name}/delete", json={"ids": [0]}), a, b)
                _assert_mismatch(c.post(f"/index/{name}/select", json={"n": 2}), a, b)
                _assert_mismatch(c.post("/fewshot/fit", json={"name": "new", "index": name, "ids": [0, 1],
                                                              "labels": ["x", "y"]}), a, b)
            _assert_mismatch(c.post("/fewshot/clf/predict", files={"image": pngs[0]}), a, b)
            _assert_mismatch(c.post("/fewshot/clf/predict", json={"embeddings": vec}), a, b)
            _assert_mismatch(c.post("/fewshot/clf/suggest", json={"index": "live", "n": 2}), a, b)
            _assert_mismatch(c.post("/fewshot/clf/predict_index", json={"index": "live"}), a, b)
            assert c.get("/index/live").json()["ntotal"] == 6  # stats stay readable
            assert c.post("/index/fresh/add", json={"ids": [1], "vectors": vec}).status_code == 200  # B's own
    finally:
        srv.stop()
    after = _tree_bytes(data)
    assert {k: v for k, v in after.items() if not k.startswith("indexes/fresh/")} == before

    # The live index kept no image paths: migrate says so, exits non-zero, and changes nothing.
    assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "live", "--bundle", str(bundle_b)]) == 1
    assert _tree_bytes(data) == after
    # The built one kept them: re-embedded with B, old copy kept as a backup.
    assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "built", "--bundle", str(bundle_b),
                           "--threads", "1"]) == 0
    backups = [p.name for p in (data / "backups" / "indexes").iterdir()]
    assert len(backups) == 1 and backups[0].startswith(f"built.{a}.")

    srv = Server(bundle_b, data).start()
    try:
        with srv.client() as c:
            listed = {i["name"]: i for i in c.get("/index").json()["indexes"]}
            assert (listed["built"]["model_id"], listed["built"]["model_matches"]) == (b, True)
            assert listed["built"]["ntotal"] == N_IMAGES
            for i in (0, 5, 11):  # each image finds itself first, embedded by B on both sides
                r = c.post("/index/built/search", files={"image": pngs[int(Path(paths[i]).stem[3:])]},
                           data={"k": "1"})
                assert r.status_code == 200, r.text
                hit = r.json()["results"][0][0]
                assert hit["id"] == i and hit["metadata"]["path"] == paths[i]
                assert hit["score"] == pytest.approx(1.0, abs=1e-4)
            _assert_mismatch(c.post("/index/live/search", json={"vectors": vec, "k": 1}), a, b)
            # A classifier is refitted under the new model (overwrite), then predicts again.
            r = c.post("/fewshot/fit", files=[("images", png) for png in pngs[:6]],
                       data={"name": "clf", "labels": json.dumps(["x", "y"] * 3), "overwrite": "true"})
            assert r.status_code == 201 and r.json()["model_id"] == b, r.text
            assert c.post("/fewshot/clf/predict", files={"image": pngs[0]}).status_code == 200
    finally:
        srv.stop()
