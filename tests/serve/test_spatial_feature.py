"""A bundle that serves a spatial feature (patch_grid2): /info and /embed widths, what a dropped patch gives, and
indexes, few-shot fits and the label loop on top, through a real msn-serve process."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from serve_helpers import PREPROCESSING, Server, encode, random_image

GRID, DIM = 8, 32  # 32 px images, patch 4: an 8 x 8 patch grid pooled to 2 x 2 cells of 4 x 4 patches


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    encoder = VisionTransformer(image_size=32, patch_size=4, embed_dim=DIM, depth=2, num_heads=2)
    bundle = tmp_path_factory.mktemp("bundle") / "grid"
    export_bundle(encoder, bundle, arch="vit_tiny", preprocessing=PREPROCESSING, feature="patch_grid2")
    server = Server(bundle, tmp_path_factory.mktemp("serve") / "data").start()
    yield server
    server.stop()


def _emb(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def test_width_and_a_masked_cell_reads_zero(srv):
    with srv.client() as c:
        info = c.get("/info").json()
        assert info["feature"] == "patch_grid2" and info["dim"] == 4 * DIM
        img = encode(random_image(1))
        full = _emb(c.post("/embed", files={"image": img}, headers={"Accept": "application/x-npy"}))
        # keep only the top-left 4 x 4 patches: the other three cells saw nothing and are exactly zero
        top_left = [r * GRID + col for r in range(4) for col in range(4)]
        masked = _emb(c.post("/embed", files={"image": img}, data={"mask": json.dumps({"keep_idx": top_left})},
                             headers={"Accept": "application/x-npy"}))
    assert full.shape == masked.shape == (1, 4 * DIM)
    cells = masked.reshape(4, DIM)
    assert np.count_nonzero(cells[1:]) == 0 and np.count_nonzero(cells[0]) > 0
    assert np.count_nonzero(full.reshape(4, DIM), axis=1).min() > 0


def test_index_fit_and_label_loop_take_the_served_width(srv):
    images = [encode(random_image(10 + i)) for i in range(8)]
    with srv.client() as c:
        files = [("images", (f"{i}.png", b)) for i, b in enumerate(images)]
        r = c.post("/index/grid/add", files=files, data={"ids": json.dumps(list(range(8)))})
        assert r.status_code == 200, r.text
        hits = c.post("/index/grid/search", files={"image": images[3]}, data={"k": "1"}).json()
        assert hits["results"][0][0]["id"] == 3
        fit = c.post("/fewshot/fit", json={"name": "g", "index": "grid", "ids": list(range(8)),
                                           "labels": ["a", "b"] * 4})
        assert fit.status_code == 201, fit.text
        pred = c.post("/fewshot/g/predict", files={"image": images[0]})
        assert pred.status_code == 200 and pred.json()["predictions"][0][0]["label"] in ("a", "b")
        wrong = c.post("/index/grid/add", json={"ids": [99], "vectors": [[0.1] * DIM]})
        assert wrong.status_code == 422 and str(4 * DIM) in wrong.text
