"""A ``kill -9`` at any point of ``msn-index build --overwrite`` or ``msn-index migrate`` leaves a whole index at its
path: the old one or the new one, as the next ``msn-serve`` (its index store) or ``msn-index`` opens it.

Each run is a real ``msn-index`` process (``msn_serve.index_tools.cli.main``, the console script's function) that
``SIGKILL``s itself at one step of the directory swap (:func:`msn_core.durable.replace_dir`'s test seam); the
state it leaves is then opened the way ``msn-serve`` opens its data directory.
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

from msn_core.bundle import load_bundle_info
from msn_serve.index_tools import cli as msn_index
from msn_serve.indexes.store import IndexStore

DIM, OLD_N, NEW_N, IMAGES = 64, 40, 60, 8
BEFORE_COMMIT = ["staged", "written", "synced"]
AFTER_COMMIT = ["journaled", "aside", "placed", "old_removed", "done"]
KILLED = """
import os, signal, sys
import msn_core.durable as durable
from msn_serve.index_tools.cli import main
step = sys.argv[1]
durable._checkpoint = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == step else None
main(sys.argv[2:])
raise SystemExit("the swap never reached step " + step)
"""


def _embeddings(root: Path, n: int, seed: int, *, model_id: str, images: Path | None = None) -> Path:
    """An ``msn-embed`` output folder of ``n`` random vectors (one shard); ids 0..n-1, paths to ``images``."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    np.save(root / "shard-00000.npy", rng.standard_normal((n, DIM)).astype(np.float32))
    np.save(root / "shard-00000.ids.npy", np.arange(n, dtype=np.int64))
    (root / "shard-00000.paths.jsonl").write_text("".join(
        json.dumps({"id": i, "path": f"img{i % IMAGES}.png"}) + "\n" for i in range(n)))
    (root / "manifest.json").write_text(json.dumps({
        "format": "msn-embeddings", "dim": DIM, "model_id": model_id, "base": str(images) if images else None,
        "shards": [{"count": n, "embeddings": "shard-00000.npy", "ids": "shard-00000.ids.npy",
                    "paths": "shard-00000.paths.jsonl"}]}))
    return root


def _build_args(embeddings: Path, data: Path, *extra: str) -> list[str]:
    return ["build", "--embeddings", str(embeddings), "--data-dir", str(data), "--name", "docs", "--index-type",
            "flat", "--queries", "4", "--k", "3", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A data directory holding index ``docs`` (OLD_N vectors of model ``msn-old``, image paths kept), the
    embeddings of a NEW_N-vector rebuild, and the images ``migrate`` re-embeds."""
    root = tmp_path_factory.mktemp("swap-kills")
    images = root / "images"
    images.mkdir()
    for i in range(IMAGES):
        (images / f"img{i}.png").write_bytes(encode(random_image(i, 32, 32)))
    old = _embeddings(root / "emb-old", OLD_N, 0, model_id="msn-old", images=images)
    assert msn_index.main(_build_args(old, root / "data", "--store-paths")) == 0
    return {"data": root / "data", "new": _embeddings(root / "emb-new", NEW_N, 1, model_id="msn-old")}


def _killed(args: list[str], step: str) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED, step, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120, check=False, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                                      "PYTHONPATH": str(REPO)})
    assert r.returncode == -signal.SIGKILL, (step, r.returncode, r.stderr[-3000:])


def _open(data: Path) -> tuple[int, str]:
    """``(vectors, model id)`` of index ``docs`` opened as msn-serve's writer opens it (recovery first); nothing
    else (no staging directory, aside or commit record) may be left beside it."""
    store = IndexStore(data, default_dim=DIM, model_id="any")
    assert store.load_all() == []  # nothing quarantined: the index loads whole
    assert sorted(p.name for p in (data / "indexes").iterdir()) == ["docs"]
    index = store.get("docs")
    n, model = index.ntotal, index.cfg.model_id
    index.close()
    return n, model


@pytest.mark.parametrize("step", BEFORE_COMMIT + AFTER_COMMIT)
def test_a_killed_rebuild_leaves_the_old_or_the_new_index(template, tmp_path: Path, step: str):
    data = tmp_path / "data"
    shutil.copytree(template["data"], data)
    _killed(_build_args(template["new"], data, "--overwrite"), step)
    # renameat2's exchange: the path holds a whole index at every kill, before any recovery
    assert (data / "indexes" / "docs" / "config.json").is_file()
    assert _open(data) == ((OLD_N if step in BEFORE_COMMIT else NEW_N), "msn-old")


@pytest.mark.parametrize("step", ["staged", "synced", "journaled", "aside", "placed", "done"])
def test_a_killed_migrate_leaves_the_old_or_the_new_index_and_its_backup(template, bundle_dir, tmp_path: Path,
                                                                         step: str):
    data = tmp_path / "data"
    shutil.copytree(template["data"], data)
    _killed(["migrate", "--data-dir", str(data), "--name", "docs", "--bundle", str(bundle_dir), "--threads", "1"],
            step)
    backups = data / "backups" / "indexes"
    assert (data / "indexes" / "docs" / "config.json").is_file()  # whole at every kill (the exchange)
    if step == "aside":  # a later msn-index finishes the swap before it reads the index
        assert msn_index.main(["migrate", "--data-dir", str(data), "--name", "docs", "--bundle",
                               str(bundle_dir)]) == 0  # "already made with this model": the swap was finished
    new_model = load_bundle_info(bundle_dir).model_id
    if step in ("staged", "synced"):
        assert _open(data) == (OLD_N, "msn-old") and not backups.exists()
    else:
        assert _open(data) == (OLD_N, new_model)
        (backup,) = backups.iterdir()
        assert backup.name.startswith("docs.msn-old.")
        assert json.loads((backup / "config.json").read_text())["model_id"] == "msn-old"
