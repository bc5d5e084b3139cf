"""A ``kill -9`` at any step of replacing a Milvus index leaves a whole index under its name, the old one or the new
one, and running the same command again finishes or redoes what was left.

Three offline commands replace what a name holds on Milvus (Milvus Lite here): ``msn-index migrate --to milvus``
(FAISS directory -> collection), ``msn-index migrate`` of a Milvus index to another model (re-embedding into a new
collection, :mod:`msn_serve.index_tools.milvus_copy`) and ``msn-embed``'s copy of its shards with ``--overwrite-index``
(:func:`msn_serve.corpus.to_milvus.shards_to_milvus`). Each run is a real process that ``SIGKILL``s itself at one
named step (``milvus_copy._checkpoint``, the seam ``msn_core.durable`` offers the FAISS swap); what it leaves is then
opened the way ``msn-serve`` opens its data directory (:class:`IndexStore`), and every id checked. Both layouts a
name can have are replaced: a collection under the name itself (``POST /index``) and an alias (the copies').
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import REPO, encode, random_image

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from msn_core.bundle import load_bundle_info
from msn_serve.corpus.to_milvus import shards_to_milvus
from msn_serve.index_tools import cli as msn_index
from msn_serve.indexes.config import config_from_spec
from msn_serve.indexes.milvus import MilvusIndex, NotReady
from msn_serve.indexes.milvus_conn import MilvusConnection
from msn_serve.indexes.store import IndexStore

DIM, OLD_N, NEW_N, IMAGES = 16, 12, 9, 4
KILLED = """
import os, signal, sys
from pathlib import Path
from msn_serve.index_tools import milvus_copy
step, command, args = sys.argv[1], sys.argv[2], sys.argv[3:]
milvus_copy._checkpoint = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == step else None
if command == "msn-index":
    from msn_serve.index_tools.cli import main
    main(args)
else:
    from msn_serve.corpus.to_milvus import shards_to_milvus
    emb, data, name = args
    shards_to_milvus(Path(emb), Path(data), name, str(Path(data) / "milvus.db"), index_type="flat",
                     store_paths=False, overwrite=True)
raise SystemExit("the command never reached step " + step)
"""


def _embeddings(root: Path, n: int, seed: int, *, model_id: str, images: Path) -> Path:
    """An ``msn-embed`` output folder: ``n`` random vectors (one shard), ids 0..n-1, paths into ``images``."""
    root.mkdir(parents=True)
    np.save(root / "shard-00000.npy", np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32))
    np.save(root / "shard-00000.ids.npy", np.arange(n, dtype=np.int64))
    (root / "shard-00000.paths.jsonl").write_text("".join(
        json.dumps({"id": i, "path": f"img{i % IMAGES}.png"}) + "\n" for i in range(n)))
    (root / "manifest.json").write_text(json.dumps({
        "format": "msn-embeddings", "dim": DIM, "model_id": model_id, "base": str(images),
        "shards": [{"count": n, "embeddings": "shard-00000.npy", "ids": "shard-00000.ids.npy",
                    "paths": "shard-00000.paths.jsonl"}]}))
    return root


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A data directory holding, all of model ``msn-old`` with OLD_N ids whose image paths are kept: FAISS index
    ``docs``; Milvus index ``cat``, a collection under its own name (made as ``POST /index`` makes one); Milvus
    index ``corpus``, an alias (made by msn-embed's copy). And the NEW_N-vector embeddings of an overwrite."""
    root = tmp_path_factory.mktemp("milvus-swap-kills")
    images = root / "images"
    images.mkdir()
    for i in range(IMAGES):
        (images / f"img{i}.png").write_bytes(encode(random_image(i, 32, 32)))
    old = _embeddings(root / "emb-old", OLD_N, 0, model_id="msn-old", images=images)
    data = root / "data"
    assert msn_index.main(["build", "--embeddings", str(old), "--data-dir", str(data), "--name", "docs",
                           "--index-type", "flat", "--queries", "4", "--k", "3", "--threads", "1",
                           "--store-paths"]) == 0
    shards_to_milvus(old, data, "corpus", str(data / "milvus.db"), index_type="flat", store_paths=True,
                     overwrite=False)
    conn = MilvusConnection(str(data / "milvus.db"))
    try:
        cat = MilvusIndex.create(conn, "cat", config_from_spec({"type": "flat"}, DIM, "msn-old"))
        vecs = np.random.default_rng(2).standard_normal((OLD_N, DIM)).astype(np.float32)
        cat.add(list(range(OLD_N)), vecs, [{"path": str(images / f"img{i % IMAGES}.png")} for i in range(OLD_N)])
        assert conn.client.list_aliases()["aliases"] == ["msn_corpus"]  # the two layouts
    finally:
        conn.close()
    return {"data": data, "new": _embeddings(root / "emb-new", NEW_N, 1, model_id="msn-new", images=images)}


@pytest.fixture
def data(template, tmp_path: Path) -> Path:
    shutil.copytree(template["data"], tmp_path / "data")
    return tmp_path / "data"


def _killed(step: str, command: str, *args: str) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED, step, command, *args], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=False,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert r.returncode == -signal.SIGKILL, (step, r.returncode, r.stderr[-3000:])


def _served(data: Path, name: str) -> tuple[str, str, int] | None:
    """``(backend, model id, ids)`` of index ``name`` as msn-serve's writer opens the data directory (None: not
    served); every id 0..ids-1 present, none other, each with its vector, and nothing else quarantined."""
    store = IndexStore(data, default_dim=DIM, model_id="any", milvus_uri=str(data / "milvus.db"))
    try:
        problems = store.load_all()
        assert set(problems) <= {name}
        idx = store.find(name)
        if idx is None:
            return None
        ids, vecs = idx.stored_vectors()
        assert ids.tolist() == list(range(len(ids))) and len(vecs) == len(ids) == idx.ntotal
        return idx.backend, idx.cfg.model_id, len(ids)
    finally:
        store.close()


def _leftovers(data: Path, name: str) -> tuple[list[str], list[str]]:
    """``(collections of ``name`` it does not resolve to, msnbak_ backups of it)``."""
    conn = MilvusConnection(str(data / "milvus.db"))
    try:
        backups = [c for c in conn.client.list_collections() if c.startswith(f"msnbak_{name}_")]
        return conn.orphans(name), backups
    finally:
        conn.close()


def _migrate(data: Path, name: str, *extra: str) -> list[str]:
    return ["migrate", "--data-dir", str(data), "--name", name, "--threads", "1", *extra]


@pytest.mark.parametrize("step", ["copied", "pointed", "aside", "done"])
def test_a_killed_move_to_milvus_leaves_the_faiss_index_or_the_copy(data: Path, step: str):
    _killed(step, "msn-index", *_migrate(data, "docs", "--to", "milvus"))
    backups = data / "backups" / "indexes"
    if step in ("copied", "pointed"):  # before the commit point: the FAISS index is served, the copy is not
        assert _served(data, "docs") == ("faiss", "msn-old", OLD_N)
        assert not backups.exists()
    elif step == "aside":  # committed, not yet marked ready: refused, with the command that finishes it
        assert _served(data, "docs") is None
        conn = MilvusConnection(str(data / "milvus.db"))
        try:
            with pytest.raises(NotReady) as e:
                MilvusIndex.open(conn, "docs")
        finally:
            conn.close()
        assert e.value.status == 409 and "msn-index migrate" in e.value.message and "--to milvus" in e.value.message
    rerun = msn_index.main(_migrate(data, "docs", "--to", "milvus"))
    assert rerun == (2 if step == "done" else 0)  # done: "no FAISS index to move", the move is complete
    assert _served(data, "docs") == ("milvus", "msn-old", OLD_N)
    assert not (data / "indexes" / "docs").exists() and len(list(backups.iterdir())) == 1
    assert _leftovers(data, "docs") == ([], [])


@pytest.mark.parametrize(("name", "step"), [
    ("cat", "copied"), ("cat", "ready"), ("cat", "journaled"), ("cat", "aside"), ("cat", "pointed"),
    ("corpus", "aside"), ("corpus", "done")])
def test_a_killed_reembedding_leaves_the_old_or_the_new_index(data: Path, bundle_dir: Path, name: str, step: str):
    new_model = load_bundle_info(bundle_dir).model_id
    _killed(step, "msn-index", *_migrate(data, name, "--bundle", str(bundle_dir)))
    committed = step in ("pointed", "done") or (name, step) == ("cat", "aside")  # its record finishes the swap
    assert _served(data, name) == ("milvus", new_model if committed else "msn-old", OLD_N)
    assert msn_index.main(_migrate(data, name, "--bundle", str(bundle_dir))) == 0  # redone, or nothing to do
    assert _served(data, name) == ("milvus", new_model, OLD_N)
    orphans, backups = _leftovers(data, name)
    assert orphans == [] and len(backups) == 1  # the old collection, kept once


@pytest.mark.parametrize(("name", "step"), [
    ("corpus", "copied"), ("corpus", "pointed"), ("corpus", "old_removed"),
    ("cat", "journaled"), ("cat", "aside"), ("cat", "pointed")])
def test_a_killed_overwrite_by_the_corpus_copy_leaves_the_old_or_the_new_index(template, data: Path, name: str,
                                                                               step: str):
    _killed(step, "msn-embed", str(template["new"]), str(data), name)
    new = step != "copied" and (name, step) != ("cat", "journaled")
    assert _served(data, name) == (("milvus", "msn-new", NEW_N) if new else ("milvus", "msn-old", OLD_N))
    shards_to_milvus(template["new"], data, name, str(data / "milvus.db"), index_type="flat", store_paths=False,
                     overwrite=True)  # the same command again
    assert _served(data, name) == ("milvus", "msn-new", NEW_N)
    assert _leftovers(data, name) == ([], [])
