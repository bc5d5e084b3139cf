"""The label loop over HTTP: select, fit from stored ids, suggest, predict_index (real server, FAISS, Milvus Lite,
cyanure). The main tests run on a FAISS ``flat`` index and on a Milvus one (``mflat``) holding the same items.

The data are four well-separated clusters of 64-d vectors (the tiny bundle's width) plus a few items halfway
between two clusters, so "diverse", "representative" and "uncertain" have answers a test can check.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server

CLUSTERS, PER, DIM = 4, 15, 64
KEY = "label-loop-key"
LIMITS = {"MSN_SERVE_MAX_SELECT": "30", "MSN_SERVE_MAX_PAGE": "25", "MSN_SERVE_SELECT_CANDIDATES": "50",
          "MSN_SERVE_MAX_RESULTS_PER_REQUEST": "60"}


def clustered() -> tuple[list[int], np.ndarray, list[str], list[int]]:
    """``(ids, vectors, labels, boundary ids)``: 4 x 15 clustered items (ids 100..159) + 4 boundary items."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(CLUSTERS, DIM)) * 4
    vecs = np.concatenate([c + rng.normal(size=(PER, DIM)) * 0.3 for c in centres])
    labels = [f"c{i // PER}" for i in range(len(vecs))]
    between = np.stack([(centres[0] + centres[1]) / 2, (centres[2] + centres[3]) / 2,
                        (centres[0] + centres[2]) / 2, (centres[1] + centres[3]) / 2])
    between += rng.normal(size=between.shape) * 0.05
    ids = list(range(100, 100 + len(vecs))) + [900, 901, 902, 903]
    return ids, np.concatenate([vecs, between]).astype(np.float32), labels + ["?"] * 4, [900, 901, 902, 903]


@pytest.fixture(scope="module")
def loop_server(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("loop")
    (root / "key").write_text(KEY)
    srv = Server(bundle_dir, root / "data", "--api-key-file", str(root / "key"), env=LIMITS).start()
    ids, vecs, _, _ = clustered()
    with srv.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        for kind, extra in (("flat", {}), ("ivf", {"nlist": 4, "nprobe": 4}), ("hnsw", {})):
            assert c.post(f"/index/{kind}", json={"type": kind, **extra}).status_code == 201
            meta = [{"file": f"img{i}.png"} for i in ids]
            assert c.post(f"/index/{kind}/add", json={"ids": ids, "vectors": vecs.tolist(), "metadata": meta}
                          ).status_code == 200
        assert c.post("/index/mflat", json={"backend": "milvus"}).status_code == 201
        assert c.post("/index/mflat/add", json={"ids": ids, "vectors": vecs.tolist(),
                                                "metadata": [{"file": f"img{i}.png"} for i in ids]}).status_code == 200
        assert c.post("/index/other", json={}).status_code == 201
        assert c.post("/index/other/add", json={"ids": [5000, 5001], "vectors": vecs[:2].tolist()}).status_code == 200
        assert c.post("/index/empty", json={}).status_code == 201
    yield srv
    srv.stop()


@pytest.fixture
def c(loop_server: Server):
    with loop_server.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def cluster_of(i: int) -> int:
    return (i - 100) // PER


def fit(c, name: str, ids: list[int], index: str = "flat", **kw):
    labels = [f"c{cluster_of(i)}" for i in ids]
    return c.post("/fewshot/fit", json={"name": name, "index": index, "ids": ids, "labels": labels,
                                        "overwrite": True, **kw})


# ---- select -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", ["flat", "mflat"])
def test_select_is_deterministic_diverse_and_excludes(c, index):
    first = c.post(f"/index/{index}/select", json={"n": 4, "seed": 3})
    assert first.status_code == 200, first.text
    ids = first.json()["ids"]
    assert ids == c.post(f"/index/{index}/select", json={"n": 4, "seed": 3}).json()["ids"]
    assert sorted(cluster_of(i) for i in ids) == [0, 1, 2, 3]  # one representative per cluster, no boundary item
    for strategy in ("kmeans", "kcenter", "random"):
        a = c.post(f"/index/{index}/select", json={"n": 6, "seed": 1, "strategy": strategy}).json()["ids"]
        assert a == c.post(f"/index/{index}/select", json={"n": 6, "seed": 1, "strategy": strategy}).json()["ids"]
        assert len(set(a)) == 6
    assert c.post(f"/index/{index}/select", json={"n": 6, "seed": 2, "strategy": "random"}).json()["ids"] != \
        c.post(f"/index/{index}/select", json={"n": 6, "seed": 1, "strategy": "random"}).json()["ids"]
    # labelled clusters count as covered: the next pick comes from a cluster with no label yet
    covered = [100, 115, 130]
    nxt = c.post(f"/index/{index}/select", json={"n": 1, "exclude_ids": covered}).json()
    assert cluster_of(nxt["ids"][0]) == 3 and nxt["available"] == 64 - 3


def test_select_caps_n_and_refuses_bad_input(c):
    everything = c.post("/index/flat/select", json={"n": 30, "exclude_ids": list(range(100, 140))}).json()
    assert len(everything["ids"]) == everything["available"] == 24 and not set(everything["ids"]) & set(range(100, 140))
    assert c.post("/index/other/select", json={"n": 20}).json()["ids"] in ([5000, 5001], [5001, 5000])
    r = c.post("/index/empty/select", json={"n": 2})
    assert r.status_code == 422 and "holds no items" in r.json()["error"]
    assert c.post("/index/nope/select", json={"n": 2}).status_code == 404
    r = c.post("/index/flat/select", json={"n": 31})
    assert r.status_code == 413 and "max_select" in r.json()["error"]
    for body, field in (({"n": 0}, "n"), ({"strategy": "best"}, "strategy"), ({"seed": True}, "seed"),
                        ({"exclude_ids": [-1]}, "exclude_ids"), ({"n": 2, "extra": 1}, "extra")):
        r = c.post("/index/flat/select", json=body)
        assert r.status_code == 422 and field in r.json()["error"], (body, r.text)


# ---- fit from stored items ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "mflat"])
def test_fit_from_ids_matches_fit_from_vectors(c, kind):
    ids, vecs, _, _ = clustered()
    chosen = [100, 101, 115, 116, 130, 131, 145, 146]
    r = fit(c, f"from-{kind}", chosen, index=kind)
    assert r.status_code == 201, r.text
    assert r.json()["index"] == kind and r.json()["n"] == 8 and "ids" not in r.json()
    rows = [ids.index(i) for i in chosen]
    direct = c.post("/fewshot/fit", json={"name": "direct", "embeddings": vecs[rows].tolist(), "overwrite": True,
                                          "labels": [f"c{cluster_of(i)}" for i in chosen]})
    assert direct.status_code == 201
    probe = {"embeddings": vecs[::7].tolist(), "k": 4}
    a = c.post(f"/fewshot/from-{kind}/predict", json=probe).json()["predictions"]
    b = c.post("/fewshot/direct/predict", json=probe).json()["predictions"]
    for pa, pb in zip(a, b, strict=True):  # normalised stored vectors give the same classifier
        assert pa[0]["label"] == pb[0]["label"]
        assert abs(pa[0]["probability"] - pb[0]["probability"]) < 2e-3


def test_fit_from_ids_bad_input(c):
    r = fit(c, "bad", [100, 115, 99999])
    assert r.status_code == 422 and "99999" in r.json()["error"] and "'flat'" in r.json()["error"]
    r = fit(c, "bad", [5000, 5001, 100])  # ids of another index
    assert r.status_code == 422 and "5000" in r.json()["error"]
    r = fit(c, "bad", [100, 115], index="nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = c.post("/fewshot/fit", json={"name": "bad", "index": "flat", "labels": ["a", "b"]})
    assert r.status_code == 422 and "index and ids go together" in r.json()["error"]
    r = c.post("/fewshot/fit", json={"name": "bad", "index": "flat", "ids": [100, 115], "labels": ["a"]})
    assert r.status_code == 422 and "1 labels for 2 ids" in r.json()["error"]
    r = c.post("/fewshot/fit", json={"name": "bad", "index": "flat", "ids": [100, 115], "labels": ["a", "b"],
                                     "embeddings": [[0.0] * DIM] * 2})
    assert r.status_code == 422 and "not both" in r.json()["error"]
    r = c.post("/fewshot/fit", json={"name": "bad", "index": "../x", "ids": [100, 115], "labels": ["a", "b"]})
    assert r.status_code == 422 and "index" in r.json()["error"]
    r = fit(c, "bad", [100, 101])  # one class
    assert r.status_code == 422 and "at least 2 distinct labels" in r.json()["error"]


# ---- suggest ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", ["flat", "mflat"])
def test_suggest_prefers_uncertain_diverse_items_and_skips_fit_ids(c, index):
    _, _, _, boundary = clustered()
    chosen = [100, 101, 115, 116, 130, 131, 145, 146]
    assert fit(c, "sug", chosen, index).status_code == 201
    r = c.post("/fewshot/sug/suggest", json={"index": index, "n": 4, "seed": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(body["ids"]) == boundary  # the four items between clusters, one per uncertain group
    assert body["uncertainty"] == sorted(body["uncertainty"], reverse=True)
    assert body["available"] == 64 - len(chosen)
    assert body == c.post("/fewshot/sug/suggest", json={"index": index, "n": 4, "seed": 0}).json()
    for strategy in ("entropy", "typical", "random"):
        got = c.post("/fewshot/sug/suggest", json={"index": index, "n": 30, "strategy": strategy}).json()["ids"]
        assert len(got) == 30 and not set(got) & set(chosen), strategy
    rest = c.post("/fewshot/sug/suggest", json={"index": index, "n": 30, "exclude_ids": list(range(100, 150))})
    assert sorted(rest.json()["ids"]) == [*range(150, 160), *boundary]  # n capped at what is left


def test_suggest_bad_input(c):
    assert fit(c, "sug2", [100, 115]).status_code == 201
    assert c.post("/fewshot/nope/suggest", json={"index": "flat"}).status_code == 404
    assert c.post("/fewshot/sug2/suggest", json={"index": "nope"}).status_code == 404
    r = c.post("/fewshot/sug2/suggest", json={"index": "empty"})
    assert r.status_code == 422 and "holds no items" in r.json()["error"]
    r = c.post("/fewshot/sug2/suggest", json={"index": "flat", "n": 31})
    assert r.status_code == 413 and "max_select" in r.json()["error"]
    r = c.post("/fewshot/sug2/suggest", json={"n": 3})
    assert r.status_code == 422 and "index" in r.json()["error"]
    assert c.post("/index/narrow", json={"dim": 3}).status_code in (201, 409)
    assert c.post("/index/narrow/add", json={"ids": [1, 2], "vectors": [[1.0, 0.0, 2.0], [0.0, 3.0, 1.0]]}
                  ).status_code == 200
    small = c.post("/fewshot/fit", json={"name": "narrow", "index": "narrow", "ids": [1, 2], "labels": ["a", "b"],
                                         "overwrite": True})
    assert small.status_code == 201, small.text
    r = c.post("/fewshot/narrow/suggest", json={"index": "flat"})
    assert r.status_code == 422 and "3-d" in r.json()["error"] and "64-d" in r.json()["error"]


# ---- predict_index ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", ["flat", "mflat"])
def test_predict_index_pages_counts_and_order(c, index):
    assert fit(c, "pi", [100, 101, 115, 116, 130, 131, 145, 146], index).status_code == 201
    seen, offset, pages = [], 0, 0
    while offset is not None:
        r = c.post("/fewshot/pi/predict_index", json={"index": index, "offset": offset, "limit": 25, "k": 2})
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["total"] == 64 and len(page["items"]) <= 25
        seen += page["items"]
        offset, pages = page["next_offset"], pages + 1
    assert pages == 3 and [it["id"] for it in seen] == sorted(clustered()[0])
    assert sum(page["class_counts"].values()) == 64
    for it in seen:
        assert it["label"] == it["top"][0]["label"] and len(it["top"]) == 2
        assert it["metadata"] == {"file": f"img{it['id']}.png"}
        if it["id"] < 900:
            assert it["label"] == f"c{cluster_of(it['id'])}"
    unc = c.post("/fewshot/pi/predict_index", json={"index": index, "limit": 25, "k": 2, "order": "uncertain"}).json()
    margins = [it["margin"] for it in unc["items"]]
    assert margins == sorted(margins) and {it["id"] for it in unc["items"][:4]} == set(clustered()[3])
    beyond = c.post("/fewshot/pi/predict_index", json={"index": index, "offset": 500, "k": 2}).json()
    assert beyond["items"] == [] and beyond["next_offset"] is None


def test_predict_index_limits_and_bad_input(c):
    assert fit(c, "pi2", [100, 115, 130]).status_code == 201
    r = c.post("/fewshot/pi2/predict_index", json={"index": "flat", "limit": 26})
    assert r.status_code == 413 and "max_page" in r.json()["error"]
    r = c.post("/fewshot/pi2/predict_index", json={"index": "flat", "limit": 25, "k": 3})
    assert r.status_code == 413 and "max_results_per_request" in r.json()["error"]
    assert c.post("/fewshot/pi2/predict_index", json={"index": "flat", "limit": 20, "k": 3}).status_code == 200
    for body, field in (({"index": "flat", "offset": -1}, "offset"), ({"index": "flat", "order": "x"}, "order"),
                        ({"index": "flat", "limit": 0}, "limit"), ({}, "index")):
        r = c.post("/fewshot/pi2/predict_index", json=body)
        assert r.status_code == 422 and field in r.json()["error"], (body, r.text)
    assert c.post("/fewshot/pi2/predict_index", json={"index": "nope"}).status_code == 404
    empty = c.post("/fewshot/pi2/predict_index", json={"index": "empty", "k": 2}).json()
    assert empty["total"] == 0 and empty["items"] == [] and sum(empty["class_counts"].values()) == 0


# ---- auth and replicas ----------------------------------------------------------------------------------------
def test_label_loop_needs_the_api_key(loop_server):
    with loop_server.client() as anon:
        for path, body in (("/index/flat/select", {"n": 2}), ("/fewshot/pi/suggest", {"index": "flat"}),
                           ("/fewshot/pi/predict_index", {"index": "flat"}),
                           ("/fewshot/fit", {"name": "x", "index": "flat", "ids": [100, 115], "labels": ["a", "b"]})):
            r = anon.post(path, json=body)
            assert r.status_code == 401 and "API key" in r.json()["error"], path


def test_read_only_replica_serves_the_loop_but_refuses_fits(c, loop_server, bundle_dir):
    assert fit(c, "pub", [100, 115, 130, 145]).status_code == 201
    assert c.post("/admin/snapshot").status_code == 200
    reader = Server(bundle_dir, loop_server.data_dir, "--read-only", "--api-key-file",
                    str(loop_server.data_dir.parent / "key"), env=LIMITS)
    reader.log_path = loop_server.data_dir.parent / "reader.log"
    reader.start()
    try:
        with reader.client(headers={"Authorization": f"Bearer {KEY}"}) as r:
            for kind in ("flat", "ivf", "hnsw"):  # memory-mapped published copies give their vectors back too
                assert r.post(f"/index/{kind}/select", json={"n": 4, "seed": 3}).json()["ids"] == \
                    c.post(f"/index/{kind}/select", json={"n": 4, "seed": 3}).json()["ids"]
            assert r.post("/fewshot/pub/suggest", json={"index": "flat", "n": 3}).json()["ids"] == \
                c.post("/fewshot/pub/suggest", json={"index": "flat", "n": 3}).json()["ids"]
            assert r.post("/fewshot/pub/predict_index", json={"index": "flat", "k": 2}).json()["total"] == 64
            refused = fit(r, "pub2", [100, 115])
            assert refused.status_code == 403 and "read-only" in refused.json()["error"]
    finally:
        reader.stop()


def test_ivfpq_vectors_cannot_be_given_back(tmp_path):
    from msn_serve.classifiers.indexvectors import stored_vectors
    from msn_serve.errors import ApiError
    from msn_serve.indexes.config import IndexConfig
    from msn_serve.indexes.managed import ManagedIndex

    idx = ManagedIndex.create(tmp_path / "pq", IndexConfig(dim=8, type="ivfpq", nlist=2, pq_m=2))
    with pytest.raises(ApiError) as e:
        stored_vectors(idx)
    assert e.value.status == 422 and "ivfpq" in e.value.message and "flat, ivf, hnsw" in e.value.message
    idx.close()
