"""The serving engines: an exported bundle's graph on ONNX Runtime (CPU or CUDA) or OpenVINO (CPU).

How a graph is opened and run, with which settings, is :mod:`msn_core.inference` (training evaluates and measures
graphs with the same code). What the service adds here: which of the bundle's graphs a precision means, the CUDA
fp16 variant with its accuracy gate, and the attributes ``/info`` and the runtime choice report. The service never
imports torch: what it knows about the model comes from ``msn.json`` (:func:`msn_core.bundle.load_bundle_info`), and
the graph's inputs are checked against the bundle contract at load time, so a mismatched bundle fails at start-up
rather than on the first request.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from msn_core.bundle import BundleInfo
from msn_core.inference import OpenVinoGraph, OrtGraph, available_cpus, ort_device
from msn_core.optional import optional, require

log = logging.getLogger("msn_serve.embedding.engine")


class InferenceEngine(Protocol):
    """What the batcher needs of an engine: :class:`Engine` (ONNX Runtime) or :class:`OpenVinoEngine`;
    :mod:`msn_serve.embedding.choice` picks one."""

    info: BundleInfo
    runtime: str
    precision: str
    device: str
    model_path: Path

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray: ...


class Engine:
    """The bundle's graph for ``precision`` in one ONNX Runtime session (:class:`msn_core.inference.OrtGraph`)."""

    runtime = "onnxruntime"

    def __init__(self, info: BundleInfo, *, device: str = "cpu", intra_op_threads: int = 0,
                 fp16: bool = True, cache_dir: Path | None = None, precision: str = "fp32"):
        self.info = info
        if precision == "int8" and device == "cuda":
            raise ValueError("--precision int8 serves the bundle's CPU int8 graph; on CUDA use the fp16 variant "
                             "(the default) or --no-fp16")
        model_path = info.graph_path(precision)  # BundleError (a ValueError) names the missing int8 graph
        self.precision = precision
        self._threads = intra_op_threads
        device = ort_device(device)  # CudaUnavailable when onnxruntime has no CUDA provider or sees no GPU
        if device == "cuda" and fp16:
            model_path = _fp16_variant(model_path, cache_dir or info.path)
        self.graph = OrtGraph(model_path, device=device, intra_op_threads=intra_op_threads)
        if device == "cuda" and model_path != info.onnx_path:
            if self._fp16_close_enough():
                self.precision = "fp16"
            else:
                self.graph = OrtGraph(info.onnx_path, device=device, intra_op_threads=intra_op_threads)
        self.device, self.model_path = self.graph.device, self.graph.model_path
        log.info("ONNX Runtime %s session on %s (%s), %s graph %s; inputs %s", self.graph.version, self.device,
                 self.graph.provider, self.precision, self.model_path.name, sorted(self.graph.input_names))

    def _fp16_close_enough(self, min_cosine: float = 0.999) -> bool:
        """Accuracy gate for the fp16 graph: cosine >= ``min_cosine`` against fp32 on CPU for random inputs."""
        i = self.info
        reference = OrtGraph(i.onnx_path, intra_op_threads=self._threads)
        rng = np.random.default_rng(0)
        pixels = rng.standard_normal((4, i.in_chans, i.image_size, i.image_size)).astype(np.float32)
        keep = np.tile(np.arange(i.num_patches), (4, 1))
        a = reference.run(pixels, keep).astype(np.float64)
        b = self.graph.run(pixels, keep).astype(np.float64)
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        ok = bool(np.isfinite(b).all() and cos.min() >= min_cosine)
        log.log(logging.INFO if ok else logging.WARNING, "fp16 graph: min cosine %.6f vs fp32 -> %s",
                float(cos.min()), "using fp16" if ok else "falling back to fp32")
        return ok

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding."""
        return self.graph.run(pixels, keep_idx)


class OpenVinoEngine:
    """The bundle's graph on OpenVINO's CPU plugin (:class:`msn_core.inference.OpenVinoGraph`): the same ONNX files,
    bf16 on CPUs with bf16 matrix units, and the QDQ int8 graph (``msn-export --quantize int8 --quantize-method qdq``)
    on OpenVINO's int8 kernels. Optional (``pip install openvino``, part of the ``serve`` extra):
    :func:`msn_core.inference.openvino_status` says whether it can be used, and why not."""

    runtime = "openvino"

    def __init__(self, info: BundleInfo, *, precision: str = "fp32", intra_op_threads: int = 0):
        self.info, self.precision, self.device = info, precision, "cpu"
        threads = intra_op_threads or available_cpus()
        self.graph = OpenVinoGraph(info.graph_path("int8" if precision == "int8" else "fp32"), precision=precision,
                                   threads=threads)
        self.model_path = self.graph.model_path
        log.info("OpenVINO %s session on CPU, %s (hint %s, %d threads), graph %s", self.graph.version, precision,
                 self.graph.config["INFERENCE_PRECISION_HINT"], threads, self.model_path.name)

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding."""
        return self.graph.run(pixels, keep_idx)


def _fp16_variant(model_path: Path, cache_dir: Path) -> Path:
    """Convert the graph to fp16 with fp32 inputs/outputs (cached next to the data); fp32 if no converter."""
    out = cache_dir / "model.fp16.onnx"
    if out.is_file() and out.stat().st_mtime >= model_path.stat().st_mtime:
        return out
    try:
        onnx = require("onnx", "fp16 conversion for --device cuda")
        f16 = optional("onnxconverter_common.float16") or require("onnxruntime.transformers.float16",
                                                                    "fp16 conversion for --device cuda")
        convert = f16.convert_float_to_float16
        model = onnx.load(str(model_path))
        half = convert(model, keep_io_types=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        onnx.save(half, str(tmp))
        os.replace(tmp, out)
        log.info("wrote fp16 model variant %s", out)
        return out
    except Exception as e:  # noqa: BLE001 - any converter failure means "serve fp32", loudly
        log.warning("fp16 conversion failed (%s); serving the fp32 model on CUDA", e)
        return model_path
