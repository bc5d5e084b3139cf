"""How fast OpenVINO runs a QDQ int8 graph, measured in a separate interpreter, for ``--quantize-method auto``.

The export keeps one int8 graph, and ``msn-serve`` can run a QDQ graph on OpenVINO's int8 kernels as well as on ONNX
Runtime; judging the candidates by ONNX Runtime alone would throw away the fastest way to serve (on the Zen 4
development CPU, ViT-S/16 int8: ONNX Runtime dynamic 36.7 images/s, OpenVINO on the QDQ graph 49.0). OpenVINO's CPU
plugin must not load into a process that runs torch (a later torch.distributed test segfaulted; a benchmark's
bf16 results went wrong), so the timing runs in a fresh ``python`` that imports only numpy and openvino. The
settings mirror ``msn_serve.embedding.openvino_engine`` (training does not import msn_serve).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from msn_core.bundle import GRAPH_INPUTS, onnx_feeds

_TIMING = """
import json, sys, time
import numpy as np
import openvino as ov
path, feeds_file, threads, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
feeds = dict(np.load(feeds_file))
core = ov.Core()
config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1,
          "ENABLE_CPU_PINNING": False, **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
request = core.compile_model(core.read_model(path), "CPU", config).create_infer_request()
for _ in range(2):
    request.infer(feeds)
times, end = [], time.perf_counter() + seconds
while len(times) < 3 or time.perf_counter() < end:
    t0 = time.perf_counter()
    request.infer(feeds)
    times.append(time.perf_counter() - t0)
print(json.dumps(len(feeds["pixel_values"]) / float(np.median(times))))
"""


def openvino_images_per_s(graph: Path, pixel_values: np.ndarray, num_patches: int, *, threads: int = 0,
                          seconds: float = 3.0) -> float | None:
    """Unmasked images/s of ``graph`` on OpenVINO's CPU plugin; None without OpenVINO or when it cannot run it."""
    if importlib.util.find_spec("openvino") is None:
        return None
    keep = np.tile(np.arange(num_patches, dtype=np.int64), (len(pixel_values), 1))
    with tempfile.TemporaryDirectory(prefix="msn-ov-timing-") as tmp:
        feeds_file = Path(tmp) / "feeds.npz"
        np.savez(feeds_file, **onnx_feeds(GRAPH_INPUTS, pixel_values, keep))
        r = subprocess.run([sys.executable, "-c", _TIMING, str(graph), str(feeds_file), str(threads), str(seconds)],
                           capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 0:
        return None
    return round(float(json.loads(r.stdout.strip().splitlines()[-1])), 1)
