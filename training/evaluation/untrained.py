"""``msn-eval --untrained [SEED]``: where the untrained twin of a bundle lives, and getting it written.

The twin is a bundle of its own (:mod:`training.bundle.untrained` writes it: the bundle's architecture,
preprocessing and feature, weights a random init under ``torch.manual_seed(SEED)``), kept under
``CACHE_DIR/untrained/<key>``, the key changing with everything that decides its weights and output. Evaluation reads
bundles and never imports the code that writes them (docs/architecture.md), so a missing twin is exported by
``python -m training.bundle.untrained`` in a process of its own, as ``msn-embed`` hands over to
``training.bundle.embed``. Being another directory, the twin has another :func:`bundle_fingerprint`, so the
embedding cache never mixes its features with the trained bundle's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from msn_core.bundle import FORMAT_VERSION, META_FILE, BundleInfo, load_bundle_info

__all__ = ["TWIN_VERSION", "twin_key", "untrained_twin"]

TWIN_VERSION = 1  # part of the key: bump when training.bundle.untrained builds twins differently
EXPORTER = "training.bundle.untrained"


def twin_key(info: BundleInfo, seed: int) -> str:
    """The directory name of ``info``'s untrained twin: it changes with the architecture, the preprocessing, the
    feature, the seed and the torch version (whose initialisers draw the weights)."""
    key = {"version": TWIN_VERSION, "format": FORMAT_VERSION, "architecture": info.architecture.to_dict(),
           "preprocessing": info.preprocessing.to_dict(), "feature": info.feature, "seed": int(seed),
           "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{info.architecture.name}-seed{int(seed)}-{digest}"


def untrained_twin(reference: str | os.PathLike, seed: int, cache_dir: str | os.PathLike) -> Path:
    """The untrained twin of the bundle ``reference`` under ``cache_dir/untrained/``, exported when missing."""
    out = Path(cache_dir) / "untrained" / twin_key(load_bundle_info(reference), seed)
    if not (out / META_FILE).is_file():
        command = [sys.executable, "-m", EXPORTER, "--bundle", str(reference), "--seed", str(int(seed)),
                   "--out", str(out)]
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode or not (out / META_FILE).is_file():
            raise RuntimeError(f"exporting the untrained twin failed ({' '.join(command)}): "
                               f"{done.stderr.strip()[-2000:] or f'exit status {done.returncode}'}")
    return out
