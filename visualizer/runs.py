"""Which decoder runs a ``--decoder PATH`` names, and which of them draws the paper's view.

Gradio-free, so the app and the scripts that render its figure offline (``benchmarks/evaluation/paper_figure.py``)
read runs the same way without importing the UI.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["decoder_runs", "paper_view"]


def decoder_runs(path: str | os.PathLike, wait_s: float = 0.0) -> list[Path]:
    """The decoder runs ``--decoder PATH`` names: a checkpoint file, or a run directory (one holding
    ``checkpoint.pt`` or ``config.yaml``), and each sub-directory of ``PATH`` that is a run: a directory holding
    several runs (``runs/demo-rcdm28/{cls,tokenmap}``) shows them all. Where there is none yet (``make demo`` starts
    the app while its decoder's run is being created), they are waited for up to ``wait_s``; then ``PATH`` itself
    stands for a run still to be written."""
    path = Path(path)
    if path.is_file():
        return [path]

    def is_run(run: Path) -> bool:
        return (run / "checkpoint.pt").is_file() or (run / "config.yaml").is_file()

    deadline = time.monotonic() + wait_s
    while True:
        subs = sorted(p for p in path.iterdir() if p.is_dir() and is_run(p)) if path.is_dir() else []
        found = ([path] if is_run(path) else []) + subs
        if found or time.monotonic() >= deadline:
            return found or [path]
        time.sleep(0.5)


def paper_view(decoder: Any) -> bool:
    """Whether a decoder (an ``RCDMPipeline`` or the app's live one) shows what the paper's figure shows: an RCDM
    decoder on a vector, not on a token map."""
    return decoder.config.model.kind == "rcdm" and decoder.encoder.layout.side == 0
