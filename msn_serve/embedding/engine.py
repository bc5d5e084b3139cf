"""ONNX Runtime session for an exported bundle, and the knowledge of how to feed it.

The service never imports torch: what it knows about the model comes from ``msn.json`` (read by
:func:`msn_core.bundle.load_bundle_info`), and the graph's inputs are checked against the bundle contract at load
time, so a mismatched bundle fails at start-up rather than on the first request.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from msn_core.bundle import BundleInfo, check_graph_inputs, onnx_feeds

log = logging.getLogger("msn_serve.embedding.engine")


def _physical_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class InferenceEngine(Protocol):
    """What the batcher needs of an engine: this module's :class:`Engine` (ONNX Runtime) or
    :class:`~msn_serve.embedding.openvino_engine.OpenVinoEngine`; :mod:`msn_serve.embedding.choice` picks one."""

    info: BundleInfo
    runtime: str
    precision: str
    device: str
    model_path: Path

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray: ...


class Engine:
    """One ONNX Runtime session plus the knowledge of how to feed it.

    Runs are serialised by a lock: the batcher already sends one batch at a time, and a single CUDA session has
    one stream anyway; the lock makes direct callers (warm-up, OIP) safe too.
    """

    runtime = "onnxruntime"

    def __init__(self, info: BundleInfo, *, device: str = "cpu", intra_op_threads: int = 0,
                 fp16: bool = True, cache_dir: Path | None = None, precision: str = "fp32"):
        self.info = info
        self._lock = threading.Lock()
        if precision == "int8" and device == "cuda":
            raise ValueError("--precision int8 serves the bundle's CPU int8 graph; on CUDA use the fp16 variant "
                             "(the default) or --no-fp16")
        model_path = info.graph_path(precision)  # BundleError (a ValueError) names the missing int8 graph
        self.precision = precision
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # a ViT is a chain: parallel mode only adds overhead
        so.inter_op_num_threads = 1
        so.intra_op_num_threads = intra_op_threads or _physical_cores()
        # Spinning threads would steal the cores uvicorn and the preprocessing pool need between batches.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.enable_cpu_mem_arena = True
        self.device = "cpu"
        providers: list[Any] = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers = [("CUDAExecutionProvider", {"device_id": 0, "arena_extend_strategy": "kSameAsRequested",
                                                        "cudnn_conv_algo_search": "HEURISTIC",
                                                        "do_copy_in_default_stream": True}),
                             "CPUExecutionProvider"]
                self.device = "cuda"
                if fp16:
                    model_path = _fp16_variant(model_path, cache_dir or info.path)
            else:
                log.warning("--device cuda requested but onnxruntime has no CUDAExecutionProvider "
                            "(install onnxruntime-gpu); falling back to CPU")
        self.model_path = model_path
        self.session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
        if self.device == "cuda" and model_path != info.onnx_path:
            if self._fp16_close_enough(so):
                self.precision = "fp16"
            else:
                self.model_path = info.onnx_path
                self.session = ort.InferenceSession(str(self.model_path), sess_options=so, providers=providers)
        self.input_names = {i.name for i in self.session.get_inputs()}
        check_graph_inputs(self.input_names, where=str(model_path))
        outs = [o.name for o in self.session.get_outputs()]
        self.output_name = "embedding" if "embedding" in outs else outs[0]
        log.info("ONNX Runtime %s session on %s (%s), %s graph %s; inputs %s", ort.__version__, self.device,
                 self.session.get_providers()[0], self.precision, self.model_path.name, sorted(self.input_names))

    def _fp16_close_enough(self, so: ort.SessionOptions, min_cosine: float = 0.999) -> bool:
        """Accuracy gate for the fp16 graph: cosine >= ``min_cosine`` against fp32 on CPU for random inputs."""
        i = self.info
        ref = ort.InferenceSession(str(i.onnx_path), sess_options=so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        pixels = rng.standard_normal((4, i.in_chans, i.image_size, i.image_size)).astype(np.float32)
        feeds = onnx_feeds({x.name for x in ref.get_inputs()}, pixels, np.tile(np.arange(i.num_patches), (4, 1)))
        a = np.asarray(ref.run(None, feeds)[0], dtype=np.float64)
        b = np.asarray(self.session.run(None, feeds)[0], dtype=np.float64)
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        ok = bool(np.isfinite(b).all() and cos.min() >= min_cosine)
        log.log(logging.INFO if ok else logging.WARNING, "fp16 graph: min cosine %.6f vs fp32 -> %s",
                float(cos.min()), "using fp16" if ok else "falling back to fp32")
        return ok

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding."""
        feeds = onnx_feeds(self.input_names, pixels, keep_idx)
        with self._lock:
            if self.device == "cuda":
                return self._run_iobinding(feeds)
            out = self.session.run([self.output_name], feeds)[0]
        return np.asarray(out, dtype=np.float32)

    def _run_iobinding(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """CUDA path: bind inputs once and let the output stay on device until the single copy back."""
        io = self.session.io_binding()
        for name, arr in feeds.items():
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        io.bind_output(self.output_name, "cuda")
        self.session.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[0], dtype=np.float32)


def _fp16_variant(model_path: Path, cache_dir: Path) -> Path:
    """Convert the graph to fp16 with fp32 inputs/outputs (cached next to the data); fp32 if no converter."""
    out = cache_dir / "model.fp16.onnx"
    if out.is_file() and out.stat().st_mtime >= model_path.stat().st_mtime:
        return out
    try:
        import onnx
        try:
            from onnxconverter_common import float16 as f16  # type: ignore[import-not-found]
            convert = f16.convert_float_to_float16
        except ImportError:
            from onnxruntime.transformers.float16 import convert_float_to_float16 as convert
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
