"""The README's ONNX example, run exactly as written against a real exported bundle with plain onnxruntime.

The issue this guards against: the README called ``keep_mask`` optional while the graph required it, so a client
following the README got "Required inputs (['keep_mask']) are missing".
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from msn_core.masks import resolve_mask

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- tests/serve/test_readme_onnx.py runs this block as written -->"


def readme_example() -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its ONNX example"
    block = re.match(r"\s*```python\n(.*?)```", text.split(MARKER, 1)[1], re.DOTALL)
    assert block is not None
    return block.group(1)


def test_the_readme_example_runs_as_written(bundle_dir: Path):
    code = readme_example()
    assert 'bundle = "bundles/demo"' in code and "keep_mask" not in code
    namespace: dict = {}
    exec(compile(code.replace('"bundles/demo"', repr(str(bundle_dir))), str(README), "exec"), namespace)  # noqa: S102
    embedding, keep = namespace["embedding"], namespace["keep"]
    assert embedding.shape == (2, 64) and embedding.dtype == np.float32
    assert keep.tolist() == resolve_mask({"ratio": 0.7, "seed": 1}, 8).tolist()  # the comment's claim

    # What the example promises: -1 padding gives each row the embedding it has alone, unpadded.
    session = namespace["session"]
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    batch = session.run(["embedding"], {"pixel_values": pixels, "keep_idx": namespace["keep_idx"]})[0]
    alone = session.run(["embedding"], {"pixel_values": pixels[1:], "keep_idx": keep[None]})[0]
    np.testing.assert_allclose(batch[1:], alone, atol=1e-6, rtol=0)
    assert np.abs(batch[0] - batch[1]).max() > 1e-3


def test_the_graph_has_exactly_the_inputs_the_readme_names(bundle_dir: Path):
    session = ort.InferenceSession(str(bundle_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixel_values", "keep_idx"]
    assert [o.name for o in session.get_outputs()] == ["embedding"]
    pixels = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(Exception, match="keep_idx"):  # both inputs are required, as the README says
        session.run(["embedding"], {"pixel_values": pixels})
