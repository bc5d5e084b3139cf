"""``msn-embed`` without torch (msn_serve.corpus): odd images embedded as ``/embed`` embeds them, a real kill and
restart that ends with the same files, the index it builds loaded by msn-serve's IndexStore, file lists and globs,
Parquet, and the hand-over to the torch driver.

Every CLI run here is a subprocess whose import system refuses ``torch`` and ``training`` and which asserts at exit
that ``torch`` never entered ``sys.modules``: what a ``.[serve]`` install (no torch) runs.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_helpers import REPO, encode, random_image

from msn_core.bundle import load_bundle_info

TORCH_FREE = """
import sys
blocked = ('torch', 'training') + tuple(b for b in sys.argv.pop(1).split(',') if b != '-')
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in blocked:
            raise ImportError('blocked in this test: ' + name)
sys.meta_path.insert(0, Block())
from msn_serve.corpus.cli import main
rc = main(sys.argv[1:])
assert 'torch' not in sys.modules, 'msn-embed imported torch'
sys.exit(rc)
"""


def msn_embed(*args: str, block: str = "", wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-c", TORCH_FREE, block or "-", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)


def write_odd_corpus(root: Path) -> dict[str, bytes]:
    """A nested folder of awkward images (name -> bytes) plus one file that is not an image."""
    rgb = random_image(1)
    palette = Image.fromarray(random_image(2)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    rgba = np.dstack([random_image(3), np.linspace(0, 255, 40 * 48).reshape(40, 48).astype(np.uint8)])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to be upright
    files = {
        "rgb.png": encode(rgb),
        "sub/gray.png": encode(random_image(4)[:, :, 0]),
        "sub/rgba.png": encode(Image.fromarray(rgba)),
        "sub/palette.png": encode(palette, transparency=0),
        "sub/deep/sixteen.png": encode(Image.fromarray(random_image(5)[:, :, 0].astype(np.uint16) * 257)),
        "sub/deep/rotated.jpg": encode(Image.fromarray(random_image(6, 30, 50)), "JPEG", exif=exif.tobytes()),
        "sub/deep/cmyk.jpg": encode(Image.fromarray(random_image(7)).convert("CMYK"), "JPEG"),
    }
    assert Image.open(io.BytesIO(files["sub/deep/sixteen.png"])).mode in ("I;16", "I")
    for name, data in {**files, "broken.png": b"this is not an image"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_output(out: Path) -> tuple[dict, list[dict], np.ndarray, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [json.loads(line) for s in manifest["shards"] for line in (out / s["paths"]).read_text().splitlines()]
    ids = np.concatenate([np.load(out / s["ids"]) for s in manifest["shards"]])
    vecs = np.concatenate([np.load(out / s["embeddings"]) for s in manifest["shards"] if s["count"]])
    return manifest, rows, ids, vecs


def test_odd_images_embed_as_the_server_embeds_them_and_the_index_loads(bundle_dir, server, tmp_path):
    from msn_serve.indexes.store import IndexStore

    files = write_odd_corpus(tmp_path / "corpus")
    out, data = tmp_path / "emb", tmp_path / "data"
    r = msn_embed("--bundle", str(bundle_dir), "--data", str(tmp_path / "corpus"), "--out", str(out),
                  "--runtime", "onnxruntime", "--precision", "fp32", "--batch-size", "3", "--shard-size", "5",
                  "--index", "corpus", "--data-dir", str(data), "--index-type", "flat")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "8/8" in r.stderr  # the progress bar's last word
    manifest, rows, ids, vecs = read_output(out)
    assert (manifest["count"], manifest["skipped"], manifest["num_files"], manifest["dim"]) == (7, 1, 8, 64)
    assert manifest["backend"] == "onnxruntime/fp32" and len(manifest["shards"]) == 2
    skipped = [s for shard in manifest["shards"]
               for s in json.loads((out / f"shard-{shard['shard']:05d}.json").read_text())["skipped"]]
    assert [s["path"] for s in skipped] == ["broken.png"] and "not a recognised image" in skipped[0]["error"]
    assert [row["id"] for row in rows] == ids.tolist() and {row["path"] for row in rows} == set(files)

    with server.client() as c:  # the same files through POST /embed of a real msn-serve
        resp = c.post("/embed", files=[("images", (name, files[name])) for name in (row["path"] for row in rows)])
        assert resp.status_code == 200, resp.text
    served = np.asarray(resp.json()["embeddings"], dtype=np.float32)
    np.testing.assert_allclose(vecs, served, atol=1e-5, rtol=0)

    store = IndexStore(data, default_dim=64, model_id=load_bundle_info(bundle_dir).model_id)
    assert store.load_all() == []
    index = store.get("corpus")
    assert index.ntotal == 7
    hits = index.search(vecs[:2], k=1)
    assert [h[0]["id"] for h in hits] == ids[:2].tolist()
    assert hits[0][0]["metadata"]["path"] == rows[0]["path"]  # paths kept: msn-index migrate can re-embed


def test_a_killed_run_restarts_where_it_stopped_and_ends_with_the_same_files(bundle_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pngs = {f"img_{i:03d}.png": encode(random_image(100 + i, 24, 30)) for i in range(20)}
    for name, png in pngs.items():
        (corpus / name).write_bytes(png)
    blocker = corpus / "img_013.png"  # shard 3 (ids 12-15): decoding blocks on a FIFO nobody writes to
    blocker.unlink()
    os.mkfifo(blocker)
    out = tmp_path / "emb"
    args = ["--bundle", str(bundle_dir), "--data", str(corpus), "--out", str(out), "--shard-size", "4",
            "--batch-size", "2", "--workers", "2"]
    proc = msn_embed(*args, wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (out / "shard-00002.json").is_file():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no shard committed in time"
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.poll() is None and not (out / "shard-00003.json").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert not (out / "manifest.json").exists()
    committed = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-0000[012]*")}
    assert len(committed) == 12
    backend = json.loads((out / "run.json").read_text())["backend"]

    blocker.unlink()
    blocker.write_bytes(pngs[blocker.name])
    again = msn_embed(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-0000[012]*")} == committed  # not redone
    runtime, precision = backend.split("/")
    fresh = msn_embed(*[a if a != str(out) else str(tmp_path / "fresh") for a in args],
                      "--runtime", runtime, "--precision", precision)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    m1, rows1, ids1, vecs1 = read_output(out)
    m2, rows2, ids2, vecs2 = read_output(tmp_path / "fresh")
    assert m1["count"] == m2["count"] == 20 and m1["backend"] == m2["backend"] == backend
    assert rows1 == rows2 and ids1.tolist() == ids2.tolist() == list(range(20))
    np.testing.assert_array_equal(vecs1, vecs2)

    other = msn_embed("--bundle", str(bundle_dir), "--data", str(corpus), "--out", str(out), "--shard-size", "5")
    assert other.returncode != 0 and "different run" in other.stderr and "shard_size" in other.stderr


def test_file_lists_and_globs(bundle_dir, tmp_path):
    files = write_odd_corpus(tmp_path / "corpus")
    listed = tmp_path / "lists" / "train.csv"
    listed.parent.mkdir()
    listed.write_text("path,label\n" + "".join(f"{n},{'jpg' if n.endswith('.jpg') else 'png'}\n" for n in files))
    r = msn_embed("--bundle", str(bundle_dir), "--data", str(listed), "--image-root", str(tmp_path / "corpus"),
                  "--out", str(tmp_path / "list"), "--runtime", "onnxruntime", "--precision", "fp32")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest, rows, _, _ = read_output(tmp_path / "list")
    assert manifest["count"] == len(files) and manifest["base"] == str((tmp_path / "corpus").resolve())
    assert [(row["path"], row["label"]) for row in rows] == [(n, n[-3:]) for n in files]

    pattern = str(tmp_path / "corpus" / "**" / "*.png")
    r = msn_embed("--bundle", str(bundle_dir), "--data", pattern, "--out", str(tmp_path / "glob"),
                  "--runtime", "onnxruntime", "--precision", "fp32", "--limit", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest, rows, _, _ = read_output(tmp_path / "glob")
    first4 = sorted(str(tmp_path / "corpus" / n) for n in [*files, "broken.png"] if n.endswith(".png"))[:4]
    assert first4[0].endswith("broken.png") and manifest["num_files"] == 4 and manifest["skipped"] == 1
    assert [row["path"] for row in rows] == [os.path.relpath(f, tmp_path / "corpus") for f in first4[1:]]


def test_parquet_is_written_or_refused_with_a_reason(bundle_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.png").write_bytes(encode(random_image(i)))
    common = ["--bundle", str(bundle_dir), "--data", str(corpus), "--runtime", "onnxruntime", "--precision", "fp32",
              "--format", "parquet"]
    refused = msn_embed(*common, "--out", str(tmp_path / "no"), block="pyarrow")
    assert refused.returncode == 2 and "--format parquet needs pyarrow" in refused.stderr
    assert not (tmp_path / "no").exists()  # refused before anything was embedded
    pq = pytest.importorskip("pyarrow.parquet")
    r = msn_embed(*common, "--out", str(tmp_path / "pq"))
    assert r.returncode == 0, r.stderr[-3000:]
    table = pq.read_table(tmp_path / "pq" / "embeddings.parquet")
    _, _, ids, vecs = read_output(tmp_path / "pq")
    assert table.column("id").to_pylist() == ids.tolist()
    np.testing.assert_array_equal(np.asarray(table.column("embedding").to_pylist(), np.float32), vecs)


def test_torch_backend_and_torchrun_ranks_hand_over_to_the_training_driver(bundle_dir, tmp_path):
    from msn_serve.corpus.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.png").write_bytes(encode(random_image(i)))
    common = ["--bundle", str(bundle_dir), "--data", str(corpus), "--out", str(tmp_path / "t")]
    with pytest.raises(SystemExit) as e:
        main([*common, "--backend", "torch", "--format", "parquet"])
    assert e.value.code == 2  # the torch driver has no Parquet output: refused before the hand-over
    r = subprocess.run([sys.executable, "-m", "msn_serve.corpus.cli", *common, "--backend", "torch",
                        "--workers", "0", "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False, env={**os.environ, "WORLD_SIZE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["backend"] == "torch" and manifest["count"] == 3


def test_progress_without_tqdm_prints_a_plain_line():
    from msn_serve.corpus.progress import Progress

    stream = io.StringIO()
    bar = Progress(10, stream=stream, every_s=0.0, use_tqdm=False)
    bar.update(4, 1)
    bar.update(6)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("msn-embed: 4/10 images (40.0 %)") and "1 skipped" in lines[0]
    assert lines[-1].startswith("msn-embed: 10/10 images (100.0 %)")
