"""In-process tests of serving components against the real tiny bundle (no HTTP)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_helpers import PREPROCESSING, encode, random_image

from msn_core.bundle import load_bundle_info
from msn_core.preprocessing import preprocess_uint8, resize_crop
from msn_serve.classifiers.fewshot import ClassifierStore, fit
from msn_serve.embedding.preprocess import preprocess_bytes
from msn_serve.errors import ApiError
from msn_serve.indexes.store import IndexStore
from msn_serve.indexes.wal import WriteAheadLog


# ---- preprocessing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(50, 50), (36, 36), (64, 48), (29, 77)])
def test_preprocessing_matches_training_eval_transform(bundle_dir: Path, shape: tuple[int, int]):
    """Serving's Pillow pipeline equals training's eval_transform to within one grey level (pre-normalisation)."""
    import torch

    from training.views import eval_transform

    info = load_bundle_info(bundle_dir)
    img = random_image(3, *shape)
    ours = preprocess_uint8(img.transpose(2, 0, 1), info.preprocessing)
    ref = eval_transform(torch.from_numpy(img.transpose(2, 0, 1)[None].copy()), resize=36, crop=32,
                         mean=PREPROCESSING["mean"], std=PREPROCESSING["std"])[0].numpy()
    assert ours.shape == ref.shape == (3, 32, 32)
    grey = 1.0 / 255.0 / min(PREPROCESSING["std"])
    assert np.abs(ours - ref).max() <= grey * 1.01
    assert np.abs(ours - ref).mean() < grey * 0.35  # most pixels identical, the rest off by one level
    # The decode path (file bytes) is the same transform.
    assert np.array_equal(preprocess_bytes(encode(img), info.preprocessing, max_pixels=10**8), ours)


def test_extreme_aspect_uses_windowed_resize_equivalently(bundle_dir: Path):
    pre = load_bundle_info(bundle_dir).preprocessing
    im = Image.fromarray(random_image(5, 20, 900))  # resized strip would be 36 x 1620 -> windowed path
    windowed = np.asarray(resize_crop(im, pre), dtype=np.int16)
    nw, nh = 1620, 36
    full = im.resize((nw, nh), Image.Resampling.BICUBIC)
    left = (nw - 32) // 2
    ref = np.asarray(full.crop((left, 2, left + 32, 34)), dtype=np.int16)
    assert np.abs(windowed - ref).max() <= 1


# ---- few-shot ------------------------------------------------------------------------------------------------------
def _blobs(n_per: int, classes: int, dim: int = 64, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)) * 3
    x = np.concatenate([c + rng.standard_normal((n_per, dim)) for c in centres]).astype(np.float32)
    return x, [f"c{i}" for i in range(classes) for _ in range(n_per)]


@pytest.mark.parametrize("classes", [2, 5])
def test_fewshot_fit_predicts_and_roundtrips(tmp_path: Path, classes: int):
    x, y = _blobs(6, classes)
    clf = fit("demo", x, y, lambd=0.0025)
    pred = [p[0]["label"] for p in clf.predict(x, 3)]
    assert pred == y
    probs = [sum(d["probability"] for d in p) for p in clf.predict(x, classes)]
    assert np.allclose(probs, 1.0)
    store = ClassifierStore(tmp_path, "m")
    store.put(clf, overwrite=False)
    again = ClassifierStore(tmp_path, "m")
    assert again.load_all() == []
    assert np.array_equal(again.get("demo").weights, clf.weights) and again.get("demo").classes == clf.classes


def test_fewshot_rejects_single_class_and_nan():
    x, _ = _blobs(4, 2)
    with pytest.raises(ApiError, match="2 distinct labels"):
        fit("a", x, ["same"] * len(x), lambd=0.0025)
    x[0, 0] = np.nan
    with pytest.raises(ApiError, match="NaN"):
        fit("a", x, ["a", "b"] * 4, lambd=0.0025)


# ---- storage / indexes ---------------------------------------------------------------------------------------------
def test_wal_torn_tail_and_corruption(tmp_path: Path):
    wal = WriteAheadLog(tmp_path / "w.log")
    for i in range(3):
        wal.append(i + 1, f"payload-{i}".encode())
    wal.close()
    data = (tmp_path / "w.log").read_bytes()
    recs, n, problem = WriteAheadLog.read(tmp_path / "w.log")
    assert [r[0] for r in recs] == [1, 2, 3] and n == len(data) and problem is None
    (tmp_path / "w.log").write_bytes(data[:-3])
    recs, _, problem = WriteAheadLog.read(tmp_path / "w.log")
    assert len(recs) == 2 and problem.startswith("torn tail")
    bad = bytearray(data)
    bad[22] ^= 0xFF  # inside the first payload (20-byte header)
    (tmp_path / "w.log").write_bytes(bytes(bad))
    recs, _, problem = WriteAheadLog.read(tmp_path / "w.log")
    assert len(recs) == 0 and "checksum" in problem


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_index_types_persist_and_search(tmp_path: Path, kind: str):
    rng = np.random.default_rng(0)
    v = rng.standard_normal((300, 16)).astype(np.float32)
    store = IndexStore(tmp_path, default_dim=16, model_id="m")
    idx = store.create("x", {"type": kind, "nlist": 8, "nprobe": 8} if kind == "ivf" else {"type": kind})
    idx.add(list(range(1000, 1300)), v, [{"i": i} for i in range(300)])
    hits = idx.search(v[:5], 3)
    assert [h[0]["id"] for h in hits] == [1000, 1001, 1002, 1003, 1004]
    assert hits[0][0]["metadata"] == {"i": 0}
    if kind != "hnsw":
        assert idx.remove([1000, 5])["not_found"] == [5]
    else:
        with pytest.raises(ApiError, match="hnsw"):
            idx.remove([1000])
    idx.wal.close()  # simulate a crash: no snapshot on close
    again = IndexStore(tmp_path, default_dim=16, model_id="m")
    assert again.load_all() == []
    j = again.get("x")
    assert j.index.ntotal == (299 if kind != "hnsw" else 300)
    assert j.search(v[1:2], 1)[0][0]["id"] == 1001
    again.close()


def test_index_rejects_bad_vectors_and_ids(tmp_path: Path):
    idx = IndexStore(tmp_path, default_dim=4, model_id="m").create("x", {})
    for ids, vecs, needle in [([1], np.full((1, 4), np.nan, np.float32), "NaN"),
                              ([1], np.ones((1, 3), np.float32), "shape"), ([-1], np.ones((1, 4), np.float32), "ids"),
                              ([1, 1], np.ones((2, 4), np.float32), "duplicates"),
                              ([1, 2], np.ones((1, 4), np.float32), "2 ids")]:
        with pytest.raises(ApiError, match=needle):
            idx.add(ids, vecs, None)
    assert idx.add([1], np.ones((1, 4), np.float32), [{"v": 1}]) == {"added": 1, "replaced": 0}
    # re-adding an id replaces its vector and metadata: never a duplicate
    assert idx.add([1, 2], np.eye(4, dtype=np.float32)[:2], [{"v": 2}, None]) == {"added": 1, "replaced": 1}
    assert idx.ntotal == 2 and idx.metadata.value(1) == {"v": 2}
    hits = idx.search(np.eye(4, dtype=np.float32)[:1], 5)[0]
    assert [h["id"] for h in hits] == [1, 2] and hits[0]["score"] == pytest.approx(1.0)


def test_bundle_metadata_is_what_export_wrote(bundle_dir: Path):
    info = load_bundle_info(bundle_dir)
    raw = json.loads((bundle_dir / "msn.json").read_text())
    assert info.model_id == raw["model_id"] and info.grid == 8 and info.embed_dim == 64


def test_serving_never_imports_torch_or_training(bundle_dir: Path, tmp_path: Path):
    """``pip install .[serve]`` has no torch: every serving module must import and build the app without it."""
    import subprocess
    import sys

    code = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'training', 'torchvision', 'visualizer'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import msn_serve
for m in pkgutil.iter_modules(msn_serve.__path__):
    if m.name != '__main__':
        importlib.import_module('msn_serve.' + m.name)
from msn_serve.http.app import create_app
from msn_serve.config import Settings
app = create_app(Settings(bundle={str(bundle_dir)!r}, data_dir={str(tmp_path)!r}))
print('ok', len(app.routes))
"""
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_fp16_variant_for_cuda_is_accurate_and_cuda_without_its_provider_is_refused(bundle_dir: Path, tmp_path: Path):
    """The CUDA path's fp16 conversion can be checked on CPU (ORT has fp16 CPU kernels); the GPU run itself
    needs onnxruntime-gpu and a GPU."""
    import onnxruntime as ort

    from msn_core.inference import OrtGraph
    from msn_serve.embedding.engine import Engine, _fp16_variant

    info = load_bundle_info(bundle_dir)
    path = _fp16_variant(bundle_dir / "model.onnx", tmp_path)
    assert path.name == "model.fp16.onnx"
    eng = Engine(info, intra_op_threads=1)
    eng.graph = OrtGraph(path, intra_op_threads=1)
    assert eng._fp16_close_enough()
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # no quiet CPU fallback for an explicit cuda
        from msn_core.gpu import CudaUnavailable

        with pytest.raises(CudaUnavailable, match="onnxruntime-gpu with its CUDA provider"):
            Engine(info, device="cuda", intra_op_threads=1, cache_dir=tmp_path)
