"""The /index API on both backends, FAISS and Milvus (Milvus Lite, embedded), on real servers.

One server holds indexes of both kinds (``"backend"`` at create): every test of the API runs once per backend with the
same requests and the same expected answers, bad input included. Then what only Milvus refuses, the binding of a
Milvus index to its model (409, then ``msn-index migrate``), ``msn-index migrate --to milvus`` and
``msn-embed --index-backend milvus``.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, encode, random_image

from msn_core.bundle import load_bundle_info
from msn_serve.index_tools import cli as msn_index

pytest.importorskip("pymilvus")
DIM = 64
BACKENDS = ["faiss", "milvus"]


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Server(bundle_dir, tmp_path_factory.mktemp("backends") / "data", "--max-index-metadata-mb", "0.25",
               "--max-metadata-bytes", "70000", "--max-queries-per-search", "20").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv: Server):
    with srv.client() as c:
        yield c


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_api_answers_the_same_on_both_backends(http, backend: str):
    name = f"api-{backend}"
    r = http.post(f"/index/{name}", json={"backend": backend})
    assert r.status_code == 201 and r.json()["backend"] == backend and r.json()["dim"] == DIM, r.text
    assert http.post(f"/index/{name}", json={"backend": backend}).status_code == 409
    vecs = _vectors(20)
    r = http.post(f"/index/{name}/add", json={"ids": list(range(20)), "vectors": vecs.tolist(),
                                              "metadata": [{"n": i} if i % 2 else None for i in range(20)]})
    assert r.json() == {"name": name, "added": 20, "replaced": 0, "ntotal": 20}
    imgs = [encode(random_image(s)) for s in range(3)]
    r = http.post(f"/index/{name}/add", files=[("images", d) for d in imgs], data={"ids": "[100, 101, 102]",
                                                                                   "metadata": '[{"img": 1}, null, 7]'})
    assert r.status_code == 200 and r.json()["ntotal"] == 23, r.text
    hit = http.post(f"/index/{name}/search?k=2", files={"image": imgs[0]}).json()["results"][0][0]
    assert hit["id"] == 100 and hit["metadata"] == {"img": 1} and hit["score"] == pytest.approx(1.0, abs=1e-4)
    res = http.post(f"/index/{name}/search", json={"vectors": vecs[3:5].tolist(), "k": 3}).json()
    assert [row[0]["id"] for row in res["results"]] == [3, 4] and res["metric"] == "ip"
    assert res["results"][0][0]["metadata"] == {"n": 3} and "metadata" not in res["results"][1][0]
    r = http.post(f"/index/{name}/add", json={"ids": [3, 50], "vectors": vecs[5:7].tolist()})  # re-add = replace
    assert r.json()["added"] == 1 and r.json()["replaced"] == 1
    top = http.post(f"/index/{name}/search", json={"vectors": [vecs[5].tolist()], "k": 2}).json()["results"][0]
    assert {h["id"] for h in top} == {3, 5} and all("metadata" not in h or h["metadata"] == {"n": 5} for h in top)
    assert http.post(f"/index/{name}/delete", json={"ids": [4, 999]}).json() == \
        {"name": name, "removed": 1, "not_found": [999], "ntotal": 23}
    small = http.post(f"/index/{name}/search?k=500", json={"vectors": vecs[:2].tolist()}).json()["results"]
    assert [len(row) for row in small] == [23, 23]  # k capped at the index size
    stats = http.get(f"/index/{name}").json()
    assert (stats["ntotal"], stats["with_metadata"], stats["backend"]) == (23, 11, backend)
    assert {i["name"]: i["backend"] for i in http.get("/index").json()["indexes"]}[name] == backend

    # the same bad input gets the same 4xx, naming the problem
    wrong: list = []
    for body, status, needle in (
        ({"ids": [1], "vectors": [[0.1] * 5]}, 422, "dimension"),
        ({"ids": [1, 2], "vectors": [[0.1] * DIM]}, 422, "ids"),
        ({"ids": [-4], "vectors": [[0.1] * DIM]}, 422, "ids"),
        ({"ids": [7, 7], "vectors": [[0.1] * DIM] * 2}, 422, "duplicate"),
        ({"ids": [1], "vectors": [[0.0] * DIM]}, 422, "all-zero"),
        ({"ids": [1], "vectors": [[0.1] * DIM], "metadata": [{"x": "y" * 80_000}]}, 413, "max_metadata_bytes"),
        ({"ids": list(range(200, 206)), "vectors": _vectors(6).tolist(), "metadata": [{"b": "z" * 60_000}] * 6},
         413, "max_index_metadata_mb"),
    ):
        r = http.post(f"/index/{name}/add", json=body)
        wrong.extend([] if r.status_code == status and needle in r.json()["error"] else [(needle, r.text[:200])])
    assert not wrong
    r = http.post(f"/index/{name}/search", json={"vectors": _vectors(21).tolist()})
    assert r.status_code == 413 and "max_queries_per_search" in r.json()["error"]
    assert http.post(f"/index/{name}/search", json={"vectors": [[0.1] * DIM], "k": 0}).status_code == 422
    assert http.post(f"/index/{name}", json={"backend": "elastic"}).status_code == 422
    assert http.get(f"/index/{name}").json()["ntotal"] == 23  # nothing above changed it
    assert http.delete(f"/index/{name}").status_code == 200
    assert http.get(f"/index/{name}").status_code == 404
    assert http.post(f"/index/{name}/search", json={"vectors": [[0.1] * DIM]}).status_code == 404


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_kinds_on_both_backends(http, backend: str):
    vecs = _vectors(40, 1)
    for kind, extra in (("ivf", {"nlist": 4, "nprobe": 4}), ("hnsw", {"metric": "l2"})):
        name = f"{kind}-{backend}"
        assert http.post(f"/index/{name}", json={"type": kind, "backend": backend, **extra}).status_code == 201
        assert http.post(f"/index/{name}/add", json={"ids": list(range(40)), "vectors": vecs.tolist()}
                         ).status_code == 200
        r = http.post(f"/index/{name}/search?nprobe=4&ef_search=32", json={"vectors": vecs[7:9].tolist(), "k": 1})
        assert [row[0]["id"] for row in r.json()["results"]] == [7, 8], r.text
        if kind == "hnsw":  # l2: squared distances on both
            assert r.json()["results"][0][0]["score"] == pytest.approx(0.0, abs=1e-4)


def test_milvus_refuses_what_it_cannot_do_with_a_4xx_naming_it(http):
    r = http.post("/index/m-auto", json={"type": "auto", "backend": "milvus"})
    assert r.status_code == 422 and "'auto'" in r.json()["error"] and "faiss" in r.json()["error"]
    assert http.get("/index/m-auto").status_code == 404
    big = [{"x": "y" * 66_000}]  # within --max-metadata-bytes 70000, beyond a Milvus VARCHAR
    assert http.post("/index/f-big", json={}).status_code == 201
    assert http.post("/index/f-big/add", json={"ids": [1], "vectors": [[0.1] * DIM], "metadata": big}
                     ).status_code == 200
    assert http.post("/index/m-big", json={"backend": "milvus"}).status_code == 201
    r = http.post("/index/m-big/add", json={"ids": [1], "vectors": [[0.1] * DIM], "metadata": big})
    assert r.status_code == 413 and "Milvus" in r.json()["error"] and "65535" in r.json()["error"]
    assert http.get("/index/m-big").json()["ntotal"] == 0


def _milvus_files(data: Path) -> dict[str, str]:
    root = data / "milvus.db"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "LOCK"}


@pytest.mark.slow  # three servers, a kill -9, two bundles and a re-embedding
def test_milvus_index_is_bound_to_its_model_kept_across_kill9_and_migrated(bundle_dir, tmp_path):
    bundle_b = tmp_path / "bundle-b"  # the same weights under another model id: what a retrained model looks like
    shutil.copytree(bundle_dir, bundle_b)
    meta = json.loads((bundle_b / "msn.json").read_text())
    meta["model_id"] += "-b"
    (bundle_b / "msn.json").write_text(json.dumps(meta))
    a, b = load_bundle_info(bundle_dir).model_id, load_bundle_info(bundle_b).model_id
    images = tmp_path / "images"
    images.mkdir()
    pngs = [encode(random_image(s)) for s in range(6)]
    for s, png in enumerate(pngs):
        (images / f"{s}.png").write_bytes(png)
    data = tmp_path / "data"
    srv = Server(bundle_dir, data, "--index-backend", "milvus").start()
    try:
        with srv.client() as c:  # created by its first add, on the server's default backend
            r = c.post("/index/cat/add", files=[("images", p) for p in pngs], data={
                "ids": json.dumps(list(range(6))), "metadata": json.dumps([{"path": str(images / f"{s}.png")}
                                                                           for s in range(6)])})
            assert r.status_code == 200, r.text
            stats = c.get("/index/cat").json()
            assert stats["backend"] == "milvus" and stats["model_id"] == a
            assert stats["milvus"]["feature"] == "cls_pre_norm"
        srv.kill9()  # acknowledged adds are in Milvus Lite's WAL, not yet in a segment
    finally:
        srv.stop()
    srv = Server(bundle_b, data).start()  # no --milvus-uri: <data-dir>/milvus.db is found
    try:
        before = _milvus_files(data)
        with srv.client() as c:
            assert c.get("/index").json()["indexes"][0]["model_matches"] is False
            assert c.get("/index/cat").json()["ntotal"] == 6
            for r in (c.post("/index/cat/search", files={"image": pngs[0]}),
                      c.post("/index/cat/add", json={"ids": [9], "vectors": [[0.1] * DIM]}),
                      c.post("/index/cat/delete", json={"ids": [0]}),
                      c.post("/index/cat/select", json={"n": 2})):
                assert r.status_code == 409 and a in r.json()["error"] and b in r.json()["error"], r.text
                assert "migrate" in r.json()["error"]
        assert _milvus_files(data) == before  # refused calls wrote nothing
    finally:
        srv.stop()
    assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "cat", "--bundle", str(bundle_b),
                           "--threads", "1"]) == 0
    srv = Server(bundle_b, data).start()
    try:
        with srv.client() as c:
            stats = c.get("/index/cat").json()
            assert (stats["model_id"], stats["backend"], stats["ntotal"]) == (b, "milvus", 6)
            hit = c.post("/index/cat/search?k=1", files={"image": pngs[4]}).json()["results"][0][0]
            assert hit["id"] == 4 and hit["metadata"]["path"].endswith("4.png")
    finally:
        srv.stop()


@pytest.mark.slow  # two servers, a migration and an msn-embed run
def test_migrate_to_milvus_moves_every_id_and_msn_embed_writes_milvus(bundle_dir, tmp_path):
    data = tmp_path / "data"
    vecs = _vectors(30, 3)
    srv = Server(bundle_dir, data).start()
    try:
        with srv.client() as c:
            assert c.post("/index/moved", json={"type": "hnsw"}).status_code == 201
            assert c.post("/index/moved/add", json={"ids": list(range(30)), "vectors": vecs.tolist(),
                                                    "metadata": [{"i": i} for i in range(30)]}).status_code == 200
            before = c.post("/index/moved/search", json={"vectors": vecs[:5].tolist(), "k": 4}).json()["results"]
        srv.kill9()  # the adds are in the FAISS WAL only
    finally:
        srv.stop()
    assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "moved", "--to", "milvus"]) == 0
    assert not (data / "indexes" / "moved").exists()
    assert [p.name.split(".")[:2] for p in (data / "backups" / "indexes").iterdir()] == [["moved", "faiss"]]
    assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "moved", "--to", "milvus"]) == 2  # gone

    images = tmp_path / "images"
    images.mkdir()
    pngs = [encode(random_image(s)) for s in range(5)]
    for s, png in enumerate(pngs):
        (images / f"im{s}.png").write_bytes(png)
    from msn_serve.corpus.cli import main as msn_embed

    assert msn_embed(["--bundle", str(bundle_dir), "--data", str(images), "--out", str(tmp_path / "emb"),
                      "--workers", "0", "--threads", "1", "--runtime", "onnxruntime", "--precision", "fp32",
                      "--index", "corpus", "--data-dir", str(data), "--index-backend", "milvus"]) == 0
    srv = Server(bundle_dir, data).start()
    try:
        with srv.client() as c:
            listed = {i["name"]: (i["backend"], i["ntotal"]) for i in c.get("/index").json()["indexes"]}
            assert listed == {"moved": ("milvus", 30), "corpus": ("milvus", 5)}
            after = c.post("/index/moved/search", json={"vectors": vecs[:5].tolist(), "k": 4}).json()["results"]
            assert [[h["id"] for h in row] for row in after] == [[h["id"] for h in row] for row in before]
            assert after[0][0]["metadata"] == {"i": 0}
            for row_a, row_b in zip(after, before, strict=True):
                assert [h["score"] for h in row_a] == pytest.approx([h["score"] for h in row_b], abs=1e-5)
            hit = c.post("/index/corpus/search?k=1", files={"image": pngs[2]}).json()["results"][0][0]
            assert hit["metadata"]["path"].endswith("im2.png") and hit["score"] == pytest.approx(1.0, abs=1e-4)
    finally:
        srv.stop()


def test_a_large_milvus_add_is_split_under_the_message_cap(tmp_path, monkeypatch):
    """An add larger than one upsert message (Milvus refuses a 400 MB one) is sent in runs and fully stored."""
    from msn_serve.indexes import milvus
    from msn_serve.indexes.config import config_from_spec
    from msn_serve.indexes.milvus_conn import MilvusConnection

    monkeypatch.setattr(milvus, "UPSERT_BYTES", 4096)  # ~15 vectors of 64 floats per message
    conn = MilvusConnection(str(tmp_path / "m.db"))
    try:
        idx = milvus.MilvusIndex.create(conn, "big", config_from_spec({"type": "flat"}, default_dim=64,
                                                                        model_id="m"))
        vecs = _vectors(200, seed=5)
        assert idx.add(list(range(200)), vecs) == {"added": 200, "replaced": 0}
        assert idx.ntotal == 200
        _, ids, _ = idx.query(vecs[[0, 199]], 1)
        assert ids[:, 0].tolist() == [0, 199]
    finally:
        conn.close()
