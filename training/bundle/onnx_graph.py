"""The ONNX graph of a bundle: what it computes, its dynamo export, and the ORT-vs-torch parity check.

The graph's input contract (names, ``-1`` padding in ``keep_idx``) is :mod:`msn_core.bundle`'s; this module makes
the graph that honours it and proves, before the bundle is published, that ONNX Runtime reproduces torch.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from msn_core.bundle import GRAPH_INPUTS, ONNX_FILE, OUTPUT_NAME
from training.bundle.files import ExportError
from training.masking import split_padding
from training.model.readout import feature_spec, read_feature
from training.model.vit import VisionTransformer

__all__ = ["PARITY_ATOL", "EmbeddingGraph", "example_inputs", "export_onnx", "onnx_summary", "parity_check",
           "run_onnx"]

PARITY_ATOL = 1e-4


class EmbeddingGraph(nn.Module):
    """What the ONNX graph computes: the bundle's feature of the kept patches; ``-1`` in ``keep_idx`` is padding.

    Padding travels inside ``keep_idx`` rather than as a third ``keep_mask`` input so that a client with one mask
    per batch (the common case) feeds two inputs and a mixed-K batch needs no extra tensor (msn_core.bundle).
    """

    def __init__(self, encoder: VisionTransformer, feature: str) -> None:
        super().__init__()
        self.encoder, self.spec = encoder, feature_spec(encoder, feature)

    def forward(self, pixel_values: Tensor, keep_idx: Tensor) -> Tensor:
        _, keep_mask = split_padding(keep_idx)
        return read_feature(self.encoder, self.spec, pixel_values, keep_idx, keep_mask)


def example_inputs(encoder: VisionTransformer, batch: int, keep: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = encoder.image_size
    images = torch.randn(batch, encoder.in_chans, size, size, generator=generator)
    keep_idx = torch.stack(
        [torch.randperm(encoder.num_patches, generator=generator)[:keep] for _ in range(batch)]
    )
    return images, keep_idx


def export_onnx(graph: EmbeddingGraph, path: Path, opset: int) -> None:
    """Dynamo export with dynamic batch and kept-patch count; H and W stay fixed (no resize op in the graph)."""
    num_patches = graph.encoder.num_patches
    # Example sizes must avoid 0/1 (torch.export specialises them) and must not tie K to the patch count.
    example = example_inputs(graph.encoder, batch=2, keep=max(2, num_patches // 2))
    batch, num_keep = torch.export.Dim("batch"), torch.export.Dim("num_keep")
    dynamic_shapes = {"pixel_values": {0: batch}, "keep_idx": {0: batch, 1: num_keep}}
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # silences "torchvision is not installed" registry chatter
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                graph, example, dynamo=True, input_names=list(GRAPH_INPUTS), output_names=[OUTPUT_NAME],
                dynamic_shapes=dynamic_shapes, opset_version=opset, verbose=False,
            )  # fmt: skip
            program.save(str(path))  # weights go to model.onnx.data automatically above 2 GB
    except Exception as exc:
        raise ExportError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc
    finally:
        onnx_logger.setLevel(level)


def onnx_summary(bundle: Path, opset: int) -> dict:
    """Inputs/outputs as written in the graph (names, dtypes, symbolic dims), so readers need not guess."""
    import onnx

    model = onnx.load(str(bundle / ONNX_FILE), load_external_data=False)

    def describe(value) -> dict:
        tensor = value.type.tensor_type
        shape = [dim.dim_param or dim.dim_value for dim in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        return {"name": value.name, "dtype": dtype, "shape": shape}

    extra = sorted(p.name for p in bundle.iterdir() if p.name.startswith(ONNX_FILE + "."))
    return {
        "file": ONNX_FILE,
        "external_data": extra[0] if extra else None,
        "opset": opset,
        "inputs": [describe(value) for value in model.graph.input],
        "outputs": [describe(value) for value in model.graph.output],
        "torch_version": torch.__version__,
    }


def run_onnx(path: Path, inputs: Sequence[Tensor]) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {name: tensor.numpy() for name, tensor in zip(GRAPH_INPUTS, inputs, strict=True)}
    return session.run([OUTPUT_NAME], feeds)[0]


def parity_check(graph: EmbeddingGraph, path: Path, atol: float) -> dict:
    """Compare ORT with torch on random inputs; raise ExportError above ``atol``."""
    encoder = graph.encoder
    keep_30 = max(1, round(0.3 * encoder.num_patches))
    padded = example_inputs(encoder, batch=3, keep=encoder.num_patches, seed=2)
    padded[1][0, keep_30:] = -1  # sample 0 keeps 30 %, the rest is padding
    cases = {
        "keep_all": example_inputs(encoder, batch=2, keep=encoder.num_patches, seed=0),
        "keep_30pct": example_inputs(encoder, batch=2, keep=keep_30, seed=1),
        "padded_mixed": padded,
    }
    diffs = {}
    for name, inputs in cases.items():
        with torch.no_grad():
            expected = graph(*inputs).numpy()
        diffs[name] = float(np.abs(run_onnx(path, inputs) - expected).max())
    failed = {name: diff for name, diff in diffs.items() if not diff <= atol}  # `not <=` also catches NaN
    if failed:
        raise ExportError(f"ONNX Runtime output differs from torch by more than {atol:g}: {failed}")
    return {"tolerance": atol, "max_abs_diff": diffs}
