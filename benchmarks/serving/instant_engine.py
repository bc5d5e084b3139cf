"""``msn-serve`` with an INSTANT ENGINE: a benchmark instrument, never a way to serve.

``python -m benchmarks.serving.instant_engine --bundle DIR ...`` is ``msn-serve`` (the same CLI, app, uvicorn,
batcher and decoding) except that the engine is :class:`InstantEngine`, a graph runner that returns zeros of the
right shape at once. What is left to measure is the front end alone: HTTP, multipart parsing, decoding and
preprocessing, batching and the response, i.e. what bounds a server whose engine is a fast GPU. The swap
happens in this launcher only (``msn_serve.embedding.models.build_engine`` is replaced before ``main`` runs), so the
service itself carries no switch for it; the bundle needs ``msn.json`` and a ``model.onnx`` file that is never read.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from msn_core.bundle import BundleInfo
from msn_core.hardware import cpu_info
from msn_serve.config import Settings
from msn_serve.embedding import models
from msn_serve.embedding.choice import RuntimeChoice

RUNTIME = "instant-engine (benchmark instrument: zeros, no model)"


class InstantEngine:
    """A graph runner that does no work: ``(B, D)`` zeros for any batch, at once."""

    runtime, precision, device = RUNTIME, "none", "cpu"

    def __init__(self, info: BundleInfo):
        self.info, self.model_path = info, info.onnx_path

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        return np.zeros((pixels.shape[0], self.info.embed_dim), dtype=np.float32)


def build_instant_engine(settings: Settings, info: BundleInfo, cache_dir: Path) -> tuple[InstantEngine, RuntimeChoice]:
    return InstantEngine(info), RuntimeChoice(RUNTIME, "none", "instant-engine benchmark", cpu_info().describe())


if __name__ == "__main__":
    models.build_engine = build_instant_engine  # the one seam: see the module docstring
    from msn_serve.cli import main

    raise SystemExit(main())
