"""Corpus embedding and indexing at scale, end to end with the real tools.

2-process gloo ``torchrun`` of ``msn-embed`` over an ImageFolder with a corrupt file, a restart that must skip the
committed shards, ``msn-index build`` into a data directory, a real ``msn-serve`` searching it; and the one-writer /
read-only-readers protocol (publish, reload by HTTP, SIGHUP and polling, writes refused on readers).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_helpers import REPO, Server, encode, random_image

PREPROCESSING = {"resize": 32, "crop": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "channels": 3,
                 "interpolation": "bicubic"}
N_FILES, CORRUPT = 40, 17  # image id 17 is a corrupt file


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    encoder = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    out = tmp_path_factory.mktemp("bundle") / "tiny"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=PREPROCESSING, parity_check=False)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ImageFolder with classes a/ and b/; sorted order = id order; id 17 is not an image."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(N_FILES):
        path = root / ("a" if i < 20 else "b") / f"img_{i:03d}.png"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"not a png at all" if i == CORRUPT else encode(random_image(i, 40, 48)))
    return root


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _embed(bundle: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "training.bundle.embed", "--bundle", str(bundle), "--data", str(data), "--out", str(out),
                 "--shard-size", "8", "--batch-size", "4", "--workers", "0", "--threads", "1"])


def _index(*args: str) -> subprocess.CompletedProcess:
    """``msn-index`` in a fresh interpreter that must never import torch."""
    code = ("import sys; from msn_serve.index_tools.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'msn-index imported torch'; sys.exit(rc)")
    return _run([sys.executable, "-c", code, *args])


@pytest.mark.slow
def test_torchrun_embed_restart_index_and_serve(bundle: Path, corpus: Path, tmp_path: Path) -> None:
    emb = tmp_path / "embeddings"
    first = _embed(bundle, corpus, emb)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((emb / "manifest.json").read_text())
    assert manifest["count"] == N_FILES - 1 and manifest["skipped"] == 1 and manifest["dim"] == 64
    assert manifest["num_files"] == N_FILES and len(manifest["shards"]) == 5
    bad = json.loads((emb / "shard-00002.json").read_text())["skipped"]
    assert [b["id"] for b in bad] == [CORRUPT] and bad[0]["path"].endswith(f"img_{CORRUPT:03d}.png")
    ids = np.concatenate([np.load(emb / s["ids"]) for s in manifest["shards"]])
    vecs = np.concatenate([np.load(emb / s["embeddings"]) for s in manifest["shards"]])
    assert ids.tolist() == [i for i in range(N_FILES) if i != CORRUPT] and vecs.dtype == np.float32
    paths = [json.loads(line) for s in manifest["shards"] for line in (emb / s["paths"]).read_text().splitlines()]
    assert [p["id"] for p in paths] == ids.tolist() and paths[0]["label"] == "a"

    # Restart after a "crash" that lost shard 3's commit record: only shard 3 is embedded again.
    stamps = {p.name: p.stat().st_mtime_ns for p in emb.glob("shard-*") if not p.name.startswith("shard-00003")}
    (emb / "shard-00003.json").unlink()
    second = _embed(bundle, corpus, emb)
    assert second.returncode == 0, second.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in emb.glob("shard-*")
            if not p.name.startswith("shard-00003")} == stamps
    assert (emb / "shard-00003.json").is_file()
    assert json.loads((emb / "manifest.json").read_text())["count"] == N_FILES - 1

    data = tmp_path / "data"
    built = _index("build", "--embeddings", str(emb), "--data-dir", str(data), "--name", "corpus", "--store-paths")
    assert built.returncode == 0, built.stderr[-3000:]
    info = json.loads(built.stdout)
    assert info["plan"]["type"] == "flat" and info["recall_at_k"] == 1.0
    assert (data / "indexes" / "corpus" / "index.faiss").is_file()

    server = Server(bundle, data).start()
    try:
        with server.client() as c:
            r = c.post("/index/corpus/search", json={"vectors": vecs.tolist(), "k": 3})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [hits[0]["id"] for hits in results] == ids.tolist()
            assert results[0][0]["metadata"]["path"].endswith("img_000.png")
            # The served embedding of an image file finds that image: msn-embed and msn-serve agree.
            img = (corpus / "b" / "img_025.png").read_bytes()
            r = c.post("/index/corpus/search", files={"image": ("q.png", img)}, data={"k": "1"})
            assert r.json()["results"][0][0]["id"] == 25
            served = np.asarray(c.post("/embed", files={"image": ("q.png", img)}).json()["embeddings"][0])
            np.testing.assert_allclose(served, vecs[ids.tolist().index(25)], atol=1e-3)
            assert c.get("/index/corpus").json()["ntotal"] == N_FILES - 1
    finally:
        server.stop()


def _vec(seed: int) -> list[float]:
    return np.random.default_rng(seed).standard_normal(64).tolist()


def _top(client: httpx.Client, seed: int) -> int | None:
    r = client.post("/index/cat/search", json={"vectors": [_vec(seed)], "k": 1})
    assert r.status_code == 200, r.text
    hits = r.json()["results"][0]
    return hits[0]["id"] if hits else None


@pytest.mark.slow
def test_writer_publishes_readers_reload(bundle: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    writer = Server(bundle, data).start()
    readers: list[Server] = []
    try:
        w = writer.client()
        added = w.post("/index/cat/add", json={"ids": [1, 2, 3], "vectors": [_vec(1), _vec(2), _vec(3)]})
        assert added.status_code == 200
        fit = w.post("/fewshot/fit", json={"name": "ab", "labels": ["a", "b", "a", "b"],
                                            "embeddings": [_vec(10), _vec(11), _vec(12), _vec(13)]})
        assert fit.status_code == 201, fit.text
        pub = w.post("/admin/snapshot").json()
        assert pub["version"] == "00000001" and pub["indexes"]["cat"]["ntotal"] == 3 and pub["classifiers"] == ["ab"]
        assert (data / "published" / "CURRENT").read_text().strip() == "00000001"
        assert w.post("/admin/reload").status_code == 409  # the writer serves its live state

        reader = Server(bundle, data, "--read-only")
        reader.log_path = tmp_path / "reader.log"
        readers.append(reader.start())
        poller = Server(bundle, data, env={"MSN_SERVE_ROLE": "reader", "MSN_SERVE_RELOAD_POLL_S": "0.2"})
        poller.log_path = tmp_path / "poller.log"
        readers.append(poller.start())
        r, p = reader.client(), poller.client()
        assert r.get("/info").json()["role"] == "reader" and r.get("/info").json()["snapshot_version"] == "00000001"
        assert _top(r, 2) == 2 and _top(p, 3) == 3
        assert r.post("/fewshot/ab/predict", json={"embeddings": [_vec(10)]}).status_code == 200
        refused = [r.post("/index/cat/add", json={"ids": [9], "vectors": [_vec(9)]}),
                   r.post("/index/cat/delete", json={"ids": [1]}), r.delete("/index/cat"),
                   r.post("/index/dog", json={}), r.delete("/fewshot/ab"),
                   r.post("/fewshot/fit", json={"name": "x", "labels": ["a", "b"], "embeddings": [_vec(1), _vec(2)]})]
        assert [x.status_code for x in refused] == [403] * 6
        assert all("read-only" in x.json()["error"] for x in refused)
        assert r.post("/admin/snapshot").status_code == 409

        # New vectors reach readers only through publish + reload; searches in flight never fail meanwhile.
        assert w.post("/index/cat/add", json={"ids": [4], "vectors": [_vec(4)]}).status_code == 200
        assert _top(r, 4) != 4
        failures: list[str] = []
        stop = threading.Event()

        def hammer() -> None:
            with reader.client() as c:
                while not stop.is_set():
                    x = c.post("/index/cat/search", json={"vectors": [_vec(1)], "k": 2})
                    if x.status_code != 200:
                        failures.append(x.text)

        t = threading.Thread(target=hammer)
        t.start()
        try:
            assert w.post("/admin/snapshot").json()["version"] == "00000002"
            out = r.post("/admin/reload").json()
            assert out["changed"] and out["version"] == "00000002" and out["previous"] == "00000001"
            assert _top(r, 4) == 4
            assert r.post("/admin/reload").json() == {"changed": False, "version": "00000002"}
        finally:
            stop.set()
            t.join()
        assert not failures

        # SIGHUP reloads too; the polling reader follows by itself.
        assert w.post("/index/cat/add", json={"ids": [5], "vectors": [_vec(5)]}).status_code == 200
        assert w.post("/admin/snapshot").json()["version"] == "00000003"
        reader.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (r.get("/admin/snapshot").json()["serving"] != "00000003"
                                               or p.get("/admin/snapshot").json()["serving"] != "00000003"):
            time.sleep(0.1)
        assert _top(r, 5) == 5 and _top(p, 5) == 5

        # The manifests' fully automatic mode: a restarted writer publishes on its own when something changed.
        w.close()
        writer.stop()
        writer = Server(bundle, data, "--publish-interval-s", "0.2").start()
        with writer.client() as w2:
            assert w2.post("/index/cat/add", json={"ids": [6], "vectors": [_vec(6)]}).status_code == 200
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _top(p, 6) != 6:
            time.sleep(0.1)
        assert _top(p, 6) == 6 and int(p.get("/admin/snapshot").json()["serving"]) >= 4
    finally:
        for s in readers:
            s.stop()
        writer.stop()


def _synthetic_embeddings(root: Path, n: int = 12_000, dim: int = 32, shards: int = 3) -> np.ndarray:
    """Clustered vectors written in msn-embed's output format (the documented manifest + .npy shards)."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((64, dim)).astype(np.float32)
    x = centres[rng.integers(0, 64, n)] + 0.35 * rng.standard_normal((n, dim)).astype(np.float32)
    root.mkdir(parents=True)
    rows, size = [], -(-n // shards)
    for s in range(shards):
        lo, hi = s * size, min(n, (s + 1) * size)
        np.save(root / f"shard-{s:05d}.emb.npy", x[lo:hi])
        np.save(root / f"shard-{s:05d}.ids.npy", np.arange(lo, hi, dtype=np.int64) * 7)  # sparse ids
        (root / f"shard-{s:05d}.paths.jsonl").write_text(
            "".join(json.dumps({"id": i * 7, "path": f"img{i}.png"}) + "\n" for i in range(lo, hi)))
        rows.append({"shard": s, "embeddings": f"shard-{s:05d}.emb.npy", "ids": f"shard-{s:05d}.ids.npy",
                     "paths": f"shard-{s:05d}.paths.jsonl", "first_id": lo, "files": hi - lo, "count": hi - lo,
                     "skipped": 0})
    (root / "manifest.json").write_text(json.dumps({"format": "msn-embeddings", "format_version": 1,
                                                    "model_id": "synthetic", "dim": dim, "count": n, "shards": rows}))
    return x


def test_index_build_tunes_ivfpq_and_loads_mmapped(tmp_path: Path) -> None:
    import faiss

    from msn_serve.index_tools.cli import main
    from msn_serve.indexes.managed import ManagedIndex

    x = _synthetic_embeddings(tmp_path / "emb", dim=16)
    out = tmp_path / "data" / "indexes" / "pq"
    # 12k x 16 floats need ~0.9 MB even as IVF-Flat: a 0.5 MB budget forces IVF-PQ (auto), even below --exact-below.
    assert main(["build", "--embeddings", str(tmp_path / "emb"), "--out", str(out), "--memory-budget-gb", "0.0005",
                 "--exact-below", "1000", "--queries", "200", "--target-recall", "0.9", "--threads", "1"]) == 0
    info = json.loads((out / "build_info.json").read_text())
    assert info["plan"]["type"] == "ivfpq" and info["plan"]["pq_m"] == 16 and info["plan"]["nlist"] == 256
    assert info["recall_at_k"] >= 0.9 and info["queries_held_out"] and info["train_vectors"] <= 12_000 - 200
    assert info["config"]["nprobe"] == info["search_param"] >= 1
    # the writer's loader (in memory) and a reader's (memory-mapped) answer identically
    q = x[:50] / np.linalg.norm(x[:50], axis=1, keepdims=True)
    writer = ManagedIndex.load(out, tmp_path / "data")
    reader = ManagedIndex.open_read_only(out)
    assert isinstance(reader.index, faiss.IndexIVFPQ) and reader.index.ntotal == 12_000
    hits_w, hits_r = writer.search(q, 5), reader.search(q, 5)
    assert [[h["id"] for h in row] for row in hits_w] == [[h["id"] for h in row] for row in hits_r]
    np.testing.assert_allclose([[h["score"] for h in row] for row in hits_w],
                               [[h["score"] for h in row] for row in hits_r], rtol=1e-5)
    top1 = np.array([h[0]["id"] for h in reader.search(q, 1)])
    assert (top1 % 7 == 0).all() and (top1 == np.arange(50) * 7).mean() > 0.8  # external ids, not positions
    assert str(out / "index.faiss") in Path("/proc/self/maps").read_text()  # really mapped
    writer.close()


def test_index_build_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from msn_serve.index_tools.cli import main

    assert main(["build", "--embeddings", str(tmp_path), "--data-dir", str(tmp_path / "d"), "--name", "x"]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    _synthetic_embeddings(tmp_path / "emb", n=300)
    args = ["build", "--embeddings", str(tmp_path / "emb"), "--data-dir", str(tmp_path / "d")]
    assert main([*args, "--name", "../escape"]) == 2 and "matching" in capsys.readouterr().err
    assert main([*args, "--name", "ok", "--index-type", "hnsw"]) == 0
    assert json.loads(capsys.readouterr().out)["recall_at_k"] >= 0.95
    assert main([*args, "--name", "ok"]) == 2 and "--overwrite" in capsys.readouterr().err
    np.save(tmp_path / "emb" / "shard-00001.ids.npy", np.zeros(100, np.int64))  # duplicate ids
    assert main([*args, "--name", "dup", "--overwrite"]) == 2 and "unique" in capsys.readouterr().err


def test_embed_file_list_in_one_process(bundle: Path, corpus: Path, tmp_path: Path) -> None:
    """Plain ``python -m training.bundle.embed`` (no torchrun) over a file list: ids follow the lines, a missing file is
    skipped and counted, and the vectors equal the 2-rank run's layout (same preprocessing and graph)."""
    from training.bundle.embed import main

    lines = [str(corpus / "b" / "img_021.png"), str(tmp_path / "missing.png"), str(corpus / "a" / "img_003.png")]
    (tmp_path / "list.txt").write_text("# corpus\n" + "\n".join(lines) + "\n")
    out = tmp_path / "emb"
    assert main(["--bundle", str(bundle), "--data", str(tmp_path / "list.txt"), "--out", str(out),
                 "--workers", "0", "--threads", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["count"], manifest["skipped"], manifest["num_files"]) == (2, 1, 3)
    assert np.load(out / "shard-00000.ids.npy").tolist() == [0, 2]
    rows = [json.loads(line) for line in (out / "shard-00000.paths.jsonl").read_text().splitlines()]
    assert [r["path"] for r in rows] == [lines[0], lines[2]]


def test_embed_rejects_bad_input(tmp_path: Path) -> None:
    from training.bundle.embed import list_corpus, main

    with pytest.raises(SystemExit):
        main(["--bundle", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o")])
    (tmp_path / "list.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no entries"):
        list_corpus(tmp_path / "list.txt")
    with pytest.raises(FileNotFoundError, match="neither"):
        list_corpus(tmp_path / "missing")
