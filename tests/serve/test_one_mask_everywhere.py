"""One mask specification keeps the same patches in every package.

``{"ratio": 0.7, "seed": 1}`` goes through msn_core, a real ``msn-serve`` process (``/embed`` and the Open Inference
Protocol, over HTTP), OIP's parser, the visualizer's mask function and ``msn-visualize sample``'s specification,
and ``msn-eval``'s masked embedding path (whose dataset image ``i`` is masked with ``"seed": [mask_seed, i]``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import encode, random_image

from msn_core.bundle import load_bundle_info
from msn_core.masks import resolve_mask
from msn_serve.embedding.preprocess import preprocess_bytes
from msn_serve.http.oip import oip_items

SPEC = {"ratio": 0.7, "seed": 1}
GRID = 8


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def _embed(http, image: bytes, spec) -> dict:
    r = http.post("/embed", files={"image": image}, data={"mask": json.dumps(spec)})
    assert r.status_code == 200, r.text
    return r.json()


def _oip(http, pixels: np.ndarray, parameters: dict | None = None, keep: np.ndarray | None = None) -> np.ndarray:
    inputs = [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
               "data": pixels.ravel().tolist()}]
    if keep is not None:
        inputs.append({"name": "keep_idx", "shape": list(keep.shape), "datatype": "INT64",
                       "data": keep.ravel().tolist()})
    r = http.post("/v2/models/msn/infer", json={"inputs": inputs, **({"parameters": parameters} if parameters else {})})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_the_spec_is_the_documented_numpy_expression():
    expected = np.sort(np.random.default_rng(1).permutation(GRID * GRID)[:19])  # docs/serving.md, "Masks"
    assert resolve_mask(SPEC, GRID).tolist() == expected.tolist()


def test_serving_embed_and_oip_keep_the_spec_patches(http, bundle_dir: Path):
    expected = resolve_mask(SPEC, GRID)
    image = encode(random_image(21))
    masked = _embed(http, image, SPEC)
    assert masked["keep_idx"] == [expected.tolist()] and masked["kept_tokens"] == [19]
    explicit = _embed(http, image, {"keep_idx": expected.tolist()})
    assert masked["embeddings"] == explicit["embeddings"]

    info = load_bundle_info(bundle_dir)
    pixels = preprocess_bytes(image, info.preprocessing, max_pixels=10**6)[None]
    assert [k.tolist() for _, k in oip_items(info, {"pixel_values": pixels}, SPEC)] == [expected.tolist()]
    assert [k.tolist() for _, k in oip_items(info, {"pixel_values": pixels}, json.dumps(SPEC))] == [expected.tolist()]
    by_spec = _oip(http, pixels, parameters={"mask": json.dumps(SPEC)})  # as tritonclient sends parameters
    by_idx = _oip(http, pixels, keep=expected[None])
    np.testing.assert_array_equal(by_spec, by_idx)
    np.testing.assert_array_equal(by_spec[0], np.asarray(masked["embeddings"][0], dtype=np.float32))


def test_the_visualizer_keeps_the_spec_patches():
    from visualizer.masks import keep_bitmap, mask_spec

    expected = resolve_mask(SPEC, GRID)
    assert mask_spec("random", 0.7, 1, 0.5, GRID) == SPEC  # the app's controls and `sample --mask-ratio/--mask-seed`
    assert np.flatnonzero(keep_bitmap("random", 0.7, 1, 0.5, None, GRID)).tolist() == expected.tolist()
    assert np.flatnonzero(keep_bitmap("focal", 0, 0, 0.5, None, GRID)).tolist() == \
        resolve_mask({"focal": {"size": 4}}, GRID).tolist()


def test_msn_eval_masks_image_i_with_seed_mask_seed_and_i(http, bundle_dir: Path):
    from training.data import SyntheticDataset
    from training.evaluation.features import OnnxEmbedder, extract_features, keep_indices

    info = load_bundle_info(bundle_dir)
    index = 5
    per_image = {**SPEC, "seed": [SPEC["seed"], index]}
    assert keep_indices(np.array([index]), GRID * GRID, 0.7, SPEC["seed"]).tolist() == \
        [resolve_mask(per_image, GRID).tolist()]
    # End to end: msn-eval's features of image 5 equal /embed's for the same image and specification.
    data = SyntheticDataset(8, num_classes=2, load_size=info.preprocessing.resize)
    evaluated = extract_features(data, OnnxEmbedder(bundle_dir), preprocessing=info.preprocessing, indices=[index],
                                 mask_ratio=0.7, mask_seed=SPEC["seed"], progress=False).features[0]
    image = encode(data[index][0].numpy().transpose(1, 2, 0))
    served = _embed(http, image, per_image)
    assert served["keep_idx"] == [resolve_mask(per_image, GRID).tolist()]
    np.testing.assert_allclose(evaluated, served["embeddings"][0], atol=1e-4)
    other = _embed(http, image, {**SPEC, "seed": [SPEC["seed"], index + 1]})["embeddings"][0]
    assert np.abs(evaluated - np.asarray(other)).max() > 1e-2  # a different mask would have shown
