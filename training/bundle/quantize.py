"""int8 graphs for bundles (``msn-export --quantize int8``): ONNX Runtime quantization, chosen by measurement.

Two methods, both ``onnxruntime.quantization`` on the exported graph after its pre-processing pass (symbolic shape
inference + graph optimisation), both quantizing the weight matrix multiplications (the ViT's ``Linear`` layers,
~95 % of its arithmetic) with int8 weights per output channel:

- ``dynamic``: weights quantized ahead of time, activations per batch at run time (``MatMulInteger``); needs no
  calibration data.
- ``static``: activations' ranges calibrated on training images, preprocessed exactly as the bundle says and fed
  unmasked and masked (the service embeds both); ``QLinearMatMul`` operators (QOperator format: on the AVX2
  development CPU it ran a little faster than QDQ, and quantizing the attention's activation-activation products
  too was slower still).
- ``qdq``: the same calibration written as ``QuantizeLinear``/``DequantizeLinear`` pairs around float ``MatMul``s.
  ONNX Runtime fuses them back into int8 kernels, and it is the format OpenVINO reads as int8 (``msn-serve
  --runtime openvino --precision int8``), so it is the int8 graph both serving runtimes can run.

``method="auto"`` (the default) quantizes with each method, runs the accuracy guard
(:mod:`training.bundle.int8_guard`) on each, times each against the fp32 graph at batch 32 in ONNX Runtime (the QDQ
graph also on OpenVINO where it is installed, :mod:`training.bundle.openvino_timing`), and keeps the fastest that
passed; every candidate's figures go to ``msn.json`` either way. When none passes,
:class:`QuantizationRefused` says which check failed and nothing is written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import (
    GRAPH_INPUTS,
    INT8_METHODS,
    INT8_ONNX_FILE,
    load_bundle_info,
    onnx_feeds,
)
from msn_core.inference import OrtGraph
from msn_core.masks import random_keep
from training.bundle.int8_guard import GuardData, GuardThresholds, guard_data, run_guard
from training.bundle.openvino_timing import openvino_images_per_s
from training.evaluation.features import extract_features

__all__ = ["METHODS", "QuantizationRefused", "QuantizeOptions", "add_arguments", "measure_speed", "options_from_args",
           "quantize_bundle", "quantize_graph"]

METHODS = ("auto", *INT8_METHODS)
CALIBRATION_MASKS = (0.0, 0.3, 0.7)  # mask ratios cycled over calibration batches


class QuantizationRefused(RuntimeError):
    """No int8 candidate passed the accuracy guard (or quantization itself failed)."""


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "auto"
    data: str | None = None  # fashion-mnist | synthetic | image folder; None: the training run's data
    data_root: str | None = None
    calibration_images: int = 256
    guard_images: int = 10_000
    synthetic_size: int = 512
    thresholds: GuardThresholds = field(default_factory=GuardThresholds)
    threads: int = 0  # ONNX Runtime threads for the guard and timing (0: all cores)
    seed: int = 0
    speed_seconds: float = 3.0  # how long candidates are timed against fp32


def data_source(options: QuantizeOptions, training: dict | None) -> tuple[str, str | None, int]:
    """(source, root, synthetic size): the options', else the training config's data section."""
    if options.data is not None:
        if options.data in ("fashion-mnist", "synthetic"):
            return options.data, options.data_root, options.synthetic_size
        return "image_folder", options.data, options.synthetic_size
    data = ((training or {}).get("config") or {}).get("data") or {}
    if not data.get("source"):
        raise QuantizationRefused("--quantize int8 needs calibration and held-out images, and the source records "
                                  "no training data: pass --calibration-data (fashion-mnist, synthetic or an "
                                  "image folder with train/ and val/)")
    return data["source"], data.get("root") or options.data_root, int(data.get("synthetic_size") or 512)


# --- quantization -----------------------------------------------------------------------------------------


class _Capture:
    """An Embedder for :func:`extract_features` that keeps the preprocessed pixels instead of embedding them."""

    backend, feature = "capture", "pixels"

    def __init__(self, patch_size: int) -> None:
        self.patch_size, self.batches = patch_size, []

    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        self.batches.append(pixel_values.copy())
        return np.zeros((len(pixel_values), 1), np.float32)


def calibration_feeds(bundle_dir: Path, data: GuardData, batch: int = 32, seed: int = 0) -> list[dict[str, Any]]:
    """Graph feeds of the calibration images, cycling through :data:`CALIBRATION_MASKS`."""
    info = load_bundle_info(bundle_dir)
    capture = _Capture(info.patch_size)
    extract_features(data.train, capture, preprocessing=info.preprocessing, indices=data.calibration_idx,
                     batch_size=batch, progress=False)
    feeds = []
    for b, pixels in enumerate(capture.batches):
        ratio = CALIBRATION_MASKS[b % len(CALIBRATION_MASKS)]
        keep = np.stack([random_keep(info.num_patches, ratio, [seed, b, i]) for i in range(len(pixels))])
        feeds.append(onnx_feeds(GRAPH_INPUTS, pixels, keep))
    return feeds


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over prepared feeds (duck-typed: ORT only calls these)."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = feeds
        self._it: Iterator[dict[str, Any]] = iter(feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.feeds)


def quantize_graph(src: Path, dst: Path, method: str, calibration: list[dict[str, Any]] | None = None) -> dict:
    """Write ``src`` quantized with ``method`` to ``dst``; returns the settings used (recorded in ``msn.json``)."""
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in INT8_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {INT8_METHODS}")
    pre = dst.with_name(f".{dst.name}.pre.onnx")
    settings: dict[str, Any] = {"op_types": ["MatMul (constant weights)"], "per_channel": True, "weight_type": "QInt8"}
    try:
        quant_pre_process(str(src), str(pre))
        if method == "dynamic":
            quantize_dynamic(str(pre), str(dst), op_types_to_quantize=["MatMul"], per_channel=True,
                             weight_type=QuantType.QInt8)
            settings["activations"] = "uint8, quantized per batch at run time"
        else:
            if not calibration:
                raise ValueError(f"{method} quantization needs calibration images")
            fmt = QuantFormat.QOperator if method == "static" else QuantFormat.QDQ
            # Named nodes: the QDQ quantizer ignores MatMulConstBOnly and would quantize the attention's
            # activation x activation products too (then masked embeddings fail the accuracy guard's cosine).
            quantize_static(str(pre), str(dst), _Reader(calibration), quant_format=fmt,
                            op_types_to_quantize=["MatMul"], nodes_to_quantize=_weight_matmuls(pre),
                            per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax, extra_options={"MatMulConstBOnly": True})
            settings.update(format="QOperator" if method == "static" else "QDQ",
                            activations="uint8, MinMax calibration", calibration_batches=len(calibration))
    finally:
        pre.unlink(missing_ok=True)
        for leftover in dst.parent.glob("augmented_model*.onnx"):  # ORT's calibration scratch file
            leftover.unlink(missing_ok=True)
    return settings


def _weight_matmuls(path: Path) -> list[str]:
    """Names of the ``MatMul`` nodes whose second input is a constant weight (the ``Linear`` layers)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights | constants]


def measure_speed(paths: dict[str, Path], pixel_values: np.ndarray, num_patches: int, *, threads: int = 0,
                  seconds: float = 3.0) -> dict[str, float]:
    """Unmasked images/s of each graph at the batch given, run as the service runs it (:class:`OrtGraph`), measured
    interleaved (so a busy machine slows all alike)."""
    graphs = {name: OrtGraph(path, intra_op_threads=threads) for name, path in paths.items()}
    n = len(pixel_values)
    keep = np.tile(np.arange(num_patches, dtype=np.int64), (n, 1))
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for graph in graphs.values():
        graph.run(pixel_values, keep)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < 3:
        for name, graph in graphs.items():
            t0 = time.perf_counter()
            graph.run(pixel_values, keep)
            times[name].append(time.perf_counter() - t0)
    return {name: round(n / float(np.median(t)), 1) for name, t in times.items()}


def quantize_bundle(bundle_dir: Path, options: QuantizeOptions, training: dict | None) -> dict[str, Any]:
    """Add ``model.int8.onnx`` to the bundle directory being built; return ``msn.json``'s ``int8`` section.

    Raises :class:`QuantizationRefused` (and leaves no int8 file) when no candidate passes the guard.
    """
    if options.method not in METHODS:
        raise ValueError(f"unknown quantization method {options.method!r}; expected one of {METHODS}")
    info = load_bundle_info(bundle_dir)
    source, root, synthetic_size = data_source(options, training)
    data = guard_data(source, root, info.preprocessing.resize, calibration_images=options.calibration_images,
                      guard_images=options.guard_images, seed=options.seed, synthetic_size=synthetic_size)
    feeds = calibration_feeds(bundle_dir, data, seed=options.seed)
    methods = INT8_METHODS if options.method == "auto" else (options.method,)
    candidates: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] = {}  # the fp32 side of the guard, the same for every candidate: computed once
    for method in methods:
        path = bundle_dir / f".candidate-{method}.onnx"
        started = time.perf_counter()
        settings = quantize_graph(info.onnx_path, path, method, feeds)
        guard = run_guard(bundle_dir, path, data, info.preprocessing, thresholds=options.thresholds,
                          threads=options.threads, seed=options.seed, reference=reference)
        candidates[method] = {"path": path, "settings": settings, "guard": guard,
                              "seconds": round(time.perf_counter() - started, 1)}
    batch = np.concatenate([f["pixel_values"] for f in feeds])[:32]
    speed = measure_speed({"fp32": info.onnx_path, **{m: c["path"] for m, c in candidates.items()}}, batch,
                          info.num_patches, threads=options.threads, seconds=options.speed_seconds)
    passed = [m for m, c in candidates.items() if c["guard"]["passed"]]
    served = dict(speed)  # the fastest way each graph can be served: ORT, or OpenVINO for the QDQ graph
    openvino = None
    if "qdq" in passed:
        openvino = openvino_images_per_s(candidates["qdq"]["path"], batch, info.num_patches,
                                         threads=options.threads, seconds=options.speed_seconds)
        served["qdq"] = max(speed["qdq"], openvino or 0.0)
    comparison = {m: {"images_per_s": speed[m], "speedup": round(speed[m] / speed["fp32"], 2),
                      "passed": c["guard"]["passed"], "failures": c["guard"]["failures"],
                      "cosine_min": c["guard"]["cosine"]["min"], "seconds": c["seconds"],
                      **({"openvino_images_per_s": openvino} if m == "qdq" and openvino else {})}
                  for m, c in candidates.items()}
    try:
        if not passed:
            lines = [f"{m}: " + "; ".join(c["guard"]["failures"]) for m, c in candidates.items()]
            raise QuantizationRefused("int8 graph refused, the accuracy guard failed (" + " | ".join(lines) + ")")
        best = max(passed, key=lambda m: served[m])
        os.replace(candidates[best]["path"], bundle_dir / INT8_ONNX_FILE)
    finally:
        for c in candidates.values():
            c["path"].unlink(missing_ok=True)
    return {"file": INT8_ONNX_FILE, "method": best, "guard": candidates[best]["guard"],
            "settings": candidates[best]["settings"],
            "speed": {"batch": len(batch), "threads": options.threads or len(os.sched_getaffinity(0)),
                      "fp32_images_per_s": speed["fp32"], "candidates": comparison}}


def add_arguments(parser) -> None:
    """``msn-export``'s quantization flags."""
    group = parser.add_argument_group("int8 (--quantize int8)")
    group.add_argument("--quantize", choices=["int8"], help="also write model.int8.onnx, guarded against fp32")
    group.add_argument("--quantize-method", choices=METHODS, default="auto",
                       help="dynamic, static or qdq (calibrated), or auto: each, "
                            "keep the fastest that passes the guard")
    group.add_argument("--calibration-data", help="fashion-mnist, synthetic or an image folder (train/ + val/); "
                       "default: the training run's data")
    group.add_argument("--calibration-root", help="directory of the Fashion-MNIST idx files")
    group.add_argument("--calibration-images", type=int, default=256, help="training images to calibrate on")
    group.add_argument("--guard-images", type=int, default=10_000, help="held-out images for the guard")
    group.add_argument("--quantize-threads", type=int, default=0, help="ONNX Runtime threads (0: all cores)")
    group.add_argument("--quantize-speed-seconds", type=float, default=QuantizeOptions.speed_seconds,
                       help="how long each candidate is timed against fp32")


def options_from_args(args) -> QuantizeOptions | None:
    if args.quantize is None:
        return None
    if args.calibration_images < 1 or args.guard_images < 1:
        raise ValueError("--calibration-images and --guard-images must be positive")
    if not args.quantize_speed_seconds > 0:
        raise ValueError("--quantize-speed-seconds must be positive")
    return QuantizeOptions(method=args.quantize_method, data=args.calibration_data, data_root=args.calibration_root,
                           calibration_images=args.calibration_images, guard_images=args.guard_images,
                           threads=args.quantize_threads, speed_seconds=args.quantize_speed_seconds)
