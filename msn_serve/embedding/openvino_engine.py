"""OpenVINO session for an exported bundle: the same ONNX files, run on OpenVINO's CPU plugin.

OpenVINO reads ``model.onnx`` directly (no conversion step, nothing new in the bundle) and brings two things ONNX
Runtime's CPU provider lacks on the machines this project runs on: bf16 inference on CPUs with bf16 matrix units
(AMX-bf16, AVX512-BF16; fp32 accumulation, fp32 inputs and outputs) and int8 kernels for the bundle's QDQ int8
graph (``msn-export --quantize int8 --quantize-method qdq``). It is optional (``pip install openvino``, part of
the ``serve`` extra): :func:`openvino_status` says whether it can be used, and why not.

The engine has the interface of :class:`msn_serve.embedding.engine.Engine` (``run``, ``info``, ``precision``,
``device``, ``runtime``, ``model_path``), so the batcher does not know which runtime it feeds.
"""
from __future__ import annotations

import logging
import os
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import OUTPUT_NAME, BundleInfo, check_graph_inputs, onnx_feeds

log = logging.getLogger("msn_serve.embedding.openvino")

PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}  # int8: the graph's own Q/DQ, f32 around them


@cache  # one answer per process: plan() and the cache key both ask, each Core() costs a plugin scan
def openvino_status() -> tuple[bool, str]:
    """``(usable, why)``: OpenVINO importable with a CPU device, or the reason it is not."""
    try:
        import openvino as ov
    except ImportError:
        return False, "openvino is not installed (pip install openvino; it is part of the serve extra)"
    try:
        devices = ov.Core().available_devices
    except Exception as e:  # noqa: BLE001 - a broken plugin install must not stop the ONNX Runtime path
        return False, f"openvino {ov.get_version()} cannot start: {e}"
    if "CPU" not in devices:
        return False, f"openvino {ov.get_version()} sees no CPU device ({devices})"
    return True, f"openvino {ov.get_version()}"


@cache
def openvino_capabilities() -> frozenset[str]:
    """The CPU plugin's optimisation capabilities (``FP32``, ``BF16``, ``INT8``, ...); empty without OpenVINO."""
    try:
        import openvino as ov

        return frozenset(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    except Exception:  # noqa: BLE001 - not installed or not usable: no capabilities
        return frozenset()


class OpenVinoEngine:
    """One compiled OpenVINO model (CPU plugin) plus one infer request, serialised by a lock like the ORT engine."""

    runtime = "openvino"

    def __init__(self, info: BundleInfo, *, precision: str = "fp32", intra_op_threads: int = 0):
        import openvino as ov

        if precision not in PRECISION_HINTS:
            raise ValueError(f"OpenVINO serves precision fp32, bf16 or int8, not {precision!r}")
        self.info, self.precision, self.device = info, precision, "cpu"
        self._lock = threading.Lock()
        self.model_path: Path = info.graph_path("int8" if precision == "int8" else "fp32")
        threads = intra_op_threads or max(1, len(os.sched_getaffinity(0)))
        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],  # explicit: the plugin's default is bf16 on AMX
            "PERFORMANCE_HINT": "LATENCY",  # one stream: the batcher sends one batch at a time
            "NUM_STREAMS": 1,
            "INFERENCE_NUM_THREADS": threads,
            "ENABLE_CPU_PINNING": False,  # the cores are shared with uvicorn and the preprocessing pool
        }
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(self.model_path)), "CPU", config)
        self.input_names = {name for port in self.compiled.inputs for name in port.get_names()}
        check_graph_inputs({port.get_any_name() for port in self.compiled.inputs}, where=str(self.model_path))
        outputs = self.compiled.outputs
        self._output = next((o for o in outputs if OUTPUT_NAME in o.get_names()), outputs[0])
        self._request = self.compiled.create_infer_request()
        log.info("OpenVINO %s session on CPU, %s (hint %s, %d threads), graph %s", ov.get_version(), precision,
                 config["INFERENCE_PRECISION_HINT"], threads, self.model_path.name)

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding."""
        feeds = onnx_feeds(self.input_names, pixels, keep_idx)
        with self._lock:
            result = self._request.infer(feeds)
            # The output tensor belongs to the request and is overwritten by the next batch: copy it out.
            return np.array(result[self._output], dtype=np.float32, copy=True)
