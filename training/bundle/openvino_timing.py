"""How fast OpenVINO runs a QDQ int8 graph, measured in a separate interpreter, for ``--quantize-method auto``.

The export keeps one int8 graph, and ``msn-serve`` can run a QDQ graph on OpenVINO's int8 kernels as well as on ONNX
Runtime; judging the candidates by ONNX Runtime alone would throw away what may be the fastest way to serve.
OpenVINO's CPU plugin must not load into a process that runs torch (a later torch.distributed test segfaulted; a
benchmark's bf16 results went wrong), so the timing runs in a fresh ``python`` that imports only numpy, ``msn_core``
and openvino. The graph is opened and run by :class:`msn_core.inference.OpenVinoGraph`, the class the service serves
it with, so the settings measured are the settings served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import msn_core
from msn_core.optional import available

_TIMING = """
import json, sys, time
import numpy as np
from msn_core.inference import OpenVinoGraph
path, inputs_file, threads, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
inputs = np.load(inputs_file)
pixels, keep = inputs["pixel_values"], inputs["keep_idx"]
graph = OpenVinoGraph(path, precision="int8", threads=threads)
for _ in range(2):
    graph.run(pixels, keep)
times, end = [], time.perf_counter() + seconds
while len(times) < 3 or time.perf_counter() < end:
    t0 = time.perf_counter()
    graph.run(pixels, keep)
    times.append(time.perf_counter() - t0)
print(json.dumps(len(pixels) / float(np.median(times))))
"""


def openvino_images_per_s(graph: Path, pixel_values: np.ndarray, num_patches: int, *, threads: int = 0,
                          seconds: float = 3.0) -> float | None:
    """Unmasked images/s of ``graph`` on OpenVINO's CPU plugin; None without OpenVINO or when it cannot run it."""
    if not available("openvino"):
        return None
    keep = np.tile(np.arange(num_patches, dtype=np.int64), (len(pixel_values), 1))
    root = str(Path(msn_core.__file__).resolve().parents[1])  # msn_core importable however this one was found
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="msn-ov-timing-") as tmp:
        inputs_file = Path(tmp) / "inputs.npz"
        np.savez(inputs_file, pixel_values=np.asarray(pixel_values, dtype=np.float32), keep_idx=keep)
        r = subprocess.run([sys.executable, "-c", _TIMING, str(graph), str(inputs_file), str(threads), str(seconds)],
                           capture_output=True, text=True, timeout=600, check=False, env=env)
    if r.returncode != 0:
        return None
    return round(float(json.loads(r.stdout.strip().splitlines()[-1])), 1)
