"""Running an exported graph: ONNX Runtime and OpenVINO sessions, with one set of settings for every caller.

The service (:mod:`msn_serve.embedding.engine`), evaluation and the int8 guard
(``training.evaluation.features.OnnxEmbedder``), ``msn-embed`` and the export's speed measurements
(``training.bundle.quantize``, ``training.bundle.openvino_timing``) all open a graph here. So a graph is evaluated,
measured and served with the same threads, optimisation level, CUDA provider options and OpenVINO precision hints,
and its inputs are checked against the bundle contract (:func:`msn_core.bundle.check_graph_inputs`) when it is
opened, wherever that is.

``onnxruntime`` and ``openvino`` are imported inside the functions that need them, never at module level: importing
``msn_core`` stays numpy + the standard library, and each runtime is needed only where a graph runs on it.
"""
from __future__ import annotations

import logging
import os
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import OUTPUT_NAME, check_graph_inputs, onnx_feeds
from msn_core.gpu import CudaUnavailable, cuda_driver_problem, ort_cuda_problem
from msn_core.optional import GPU_INSTALL, MissingDependency, require

__all__ = [
    "OPENVINO_PRECISION_HINTS",
    "OpenVinoGraph",
    "OrtGraph",
    "available_cpus",
    "openvino_capabilities",
    "openvino_config",
    "openvino_status",
    "ort_device",
    "ort_session_options",
]

log = logging.getLogger("msn_core.inference")

# OpenVINO's INFERENCE_PRECISION_HINT per precision; int8 runs the graph's own Q/DQ with f32 around them.
ORT_PURPOSE = "running a bundle's graph on ONNX Runtime"
OPENVINO_PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}
CUDA_PROVIDER_OPTIONS = {"arena_extend_strategy": "kSameAsRequested", "cudnn_conv_algo_search": "HEURISTIC",
                         "do_copy_in_default_stream": True}


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask): the thread count of every runtime here unless one is set."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------------- ONNX Runtime


def ort_session_options(intra_op_threads: int = 0) -> Any:
    """``onnxruntime.SessionOptions`` for a bundle graph; ``intra_op_threads`` 0 = :func:`available_cpus`."""
    ort = require("onnxruntime", ORT_PURPOSE)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # a ViT is a chain: parallel mode only adds overhead
    so.inter_op_num_threads = 1
    so.intra_op_num_threads = intra_op_threads or available_cpus()
    # Spinning threads would steal the cores a server's event loop and preprocessing (or a data loader) need
    # between batches.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_cpu_mem_arena = True
    return so


def ort_device(device: str) -> str:
    """The device ONNX Runtime will run on for ``device`` (``cpu``, ``cuda`` or ``cuda:N``); :class:`CudaUnavailable`
    when CUDA is asked for and onnxruntime has no CUDA provider (the CPU build) or no GPU is visible: an explicit
    GPU request never quietly runs on the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    ort_why, driver_why = ort_cuda_problem(), cuda_driver_problem()
    why = [f"{ort_why}: {GPU_INSTALL}"] if ort_why else []
    if driver_why:
        why.append(driver_why)
    if why:
        raise CudaUnavailable(f"--device {device} " + ("needs " if ort_why else "") + "; and ".join(why))
    return device


@cache
def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu needs from the ``nvidia-*`` wheels (or torch's, when torch
    is imported) before the first CUDA session: without it the provider finds them only on LD_LIBRARY_PATH."""
    ort = require("onnxruntime", ORT_PURPOSE)

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21
    if preload is not None:
        try:
            preload()
        except Exception as e:  # noqa: BLE001 - the session's own error then says what is missing
            log.warning("onnxruntime.preload_dlls failed: %s", e)


class OrtGraph:
    """One ONNX Runtime session on a graph with the bundle's inputs; :meth:`run` embeds a batch.

    Runs are serialised by a lock: callers send one batch at a time anyway, and one CUDA session has one stream;
    the lock makes concurrent callers safe too.
    """

    runtime = "onnxruntime"

    def __init__(self, model_path: str | os.PathLike, *, device: str = "cpu", intra_op_threads: int = 0) -> None:
        ort = require("onnxruntime", ORT_PURPOSE)

        self.model_path = Path(model_path)
        self.device = ort_device(device)
        self.device_id = int(self.device.partition(":")[2] or 0)
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.device != "cpu":
            _preload_cuda_libraries()
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": self.device_id, **CUDA_PROVIDER_OPTIONS}))
        self.session = ort.InferenceSession(str(self.model_path), sess_options=ort_session_options(intra_op_threads),
                                            providers=providers)
        if self.device != "cpu" and self.provider != "CUDAExecutionProvider":
            # The provider is listed but could not start (CUDA/cuDNN libraries missing or mismatched): ORT would
            # run the session on the CPU. A GPU was asked for, so stop instead.
            raise CudaUnavailable(f"--device {self.device}: onnxruntime {ort.__version__} could not start its CUDA "
                                  f"provider for {self.model_path.name} (CUDA/cuDNN libraries missing or not "
                                  "matching its CUDA version; its own error is logged above)")
        self.input_names = {i.name for i in self.session.get_inputs()}
        check_graph_inputs(self.input_names, where=str(self.model_path))
        outputs = [o.name for o in self.session.get_outputs()]
        self.output_name = OUTPUT_NAME if OUTPUT_NAME in outputs else outputs[0]
        self.version = ort.__version__
        self._lock = threading.Lock()

    @property
    def provider(self) -> str:
        """The execution provider that runs the graph (the first one the session uses)."""
        return self.session.get_providers()[0]

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding -> (B,D).

        On CUDA too a plain ``session.run``: binding fresh device copies of the inputs (IOBinding) was no faster
        on an H100 (docs/benchmarks.md, "The GPU run").
        """
        feeds = onnx_feeds(self.input_names, pixels, keep_idx)
        with self._lock:
            out = self.session.run([self.output_name], feeds)[0]
        return np.asarray(out, dtype=np.float32)


# -------------------------------------------------------------------------------------------------------- OpenVINO


@cache  # one answer per process: each Core() costs a plugin scan
def openvino_status() -> tuple[bool, str]:
    """``(usable, why)``: OpenVINO importable with a CPU device, or the reason it is not."""
    try:
        ov = require("openvino", "the OpenVINO runtime")
    except MissingDependency as e:
        return False, str(e)
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


def openvino_config(precision: str, threads: int = 0) -> dict[str, Any]:
    """The CPU plugin's settings for ``precision`` (fp32, bf16 or int8); ``threads`` 0 = :func:`available_cpus`."""
    if precision not in OPENVINO_PRECISION_HINTS:
        raise ValueError(f"OpenVINO serves precision fp32, bf16 or int8, not {precision!r}")
    return {
        "INFERENCE_PRECISION_HINT": OPENVINO_PRECISION_HINTS[precision],  # explicit: the default is bf16 on AMX
        "PERFORMANCE_HINT": "LATENCY",  # one stream: callers send one batch at a time
        "NUM_STREAMS": 1,
        "INFERENCE_NUM_THREADS": threads or available_cpus(),
        "ENABLE_CPU_PINNING": False,  # the cores are shared with a server's event loop and preprocessing
    }


class OpenVinoGraph:
    """One graph compiled for OpenVINO's CPU plugin, plus one infer request serialised by a lock.

    OpenVINO reads the ONNX file directly (no conversion step) and runs bf16 on CPUs with bf16 matrix units and the
    QDQ int8 graph on its int8 kernels. Its CPU plugin must not load into a process that runs torch (seen: a later
    ``torch.distributed`` segfault, wrong bf16 results), which is why training measures it in a separate interpreter.
    """

    runtime = "openvino"

    def __init__(self, model_path: str | os.PathLike, *, precision: str = "fp32", threads: int = 0) -> None:
        self.config = openvino_config(precision, threads)  # ValueError on an unknown precision, before the import
        ov = require("openvino", "the OpenVINO runtime")

        self.model_path, self.precision, self.device = Path(model_path), precision, "cpu"
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(self.model_path)), "CPU", self.config)
        self.input_names = {name for port in self.compiled.inputs for name in port.get_names()}
        check_graph_inputs({port.get_any_name() for port in self.compiled.inputs}, where=str(self.model_path))
        outputs = self.compiled.outputs
        self._output = next((o for o in outputs if OUTPUT_NAME in o.get_names()), outputs[0])
        self._request = self.compiled.create_infer_request()
        self.version = ov.get_version()
        self._lock = threading.Lock()

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64 with ``-1`` padding -> (B,D)."""
        feeds = onnx_feeds(self.input_names, pixels, keep_idx)
        with self._lock:
            result = self._request.infer(feeds)
            # The output tensor belongs to the request and is overwritten by the next batch: copy it out.
            return np.array(result[self._output], dtype=np.float32, copy=True)
