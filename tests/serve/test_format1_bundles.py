"""Bundles exported before format 2 (a third, required ``keep_mask`` graph input) are still read everywhere.

A format-1 bundle is rebuilt here the way the old exporter wrote it (same weights, three-input graph), and the
service's engine and evaluation's embedder must give it the same embeddings as the format-2 graph for a padded
mixed-K batch.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from msn_core.bundle import load_bundle_info
from msn_core.masks import pad_keep, resolve_mask
from msn_serve.embedding.engine import Engine


@pytest.fixture(scope="module")
def format1_bundle(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from training.model.load import load_encoder

    encoder, _ = load_encoder(bundle_dir)

    class ThreeInputs(torch.nn.Module):  # the format-1 graph: padding as a separate boolean input
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, pixel_values, keep_idx, keep_mask):
            return self.encoder(pixel_values, keep_idx, keep_mask)[0]

    out = tmp_path_factory.mktemp("format1") / "bundle"
    shutil.copytree(bundle_dir, out)
    example = (torch.randn(2, 3, 32, 32), torch.arange(32).expand(2, -1).contiguous(), torch.ones(2, 32, dtype=bool))
    batch, keep = torch.export.Dim("batch"), torch.export.Dim("num_keep")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(ThreeInputs().eval(), example, dynamo=True,
                                    input_names=["pixel_values", "keep_idx", "keep_mask"],
                                    output_names=["embedding"], opset_version=18,
                                    dynamic_shapes={"pixel_values": {0: batch}, "keep_idx": {0: batch, 1: keep},
                                                    "keep_mask": {0: batch, 1: keep}})
    program.save(str(out / "model.onnx"))
    meta = json.loads((out / "msn.json").read_text())
    (out / "msn.json").write_text(json.dumps({**meta, "format_version": 1}))
    return out


def test_engine_and_evaluation_read_format1_bundles(bundle_dir: Path, format1_bundle: Path):
    from training.evaluation.features import OnnxEmbedder

    old, new = load_bundle_info(format1_bundle), load_bundle_info(bundle_dir)
    assert old.format_version == 1 and new.format_version == 2
    pixels = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    keep = pad_keep([resolve_mask(None, 8), resolve_mask({"ratio": 0.7, "seed": 1}, 8),
                     resolve_mask({"focal": {"size": 2}}, 8)])
    want = Engine(new, intra_op_threads=1).run(pixels, keep)
    np.testing.assert_allclose(Engine(old, intra_op_threads=1).run(pixels, keep), want, atol=1e-5)
    np.testing.assert_allclose(OnnxEmbedder(format1_bundle)(pixels, keep), want, atol=1e-5)
