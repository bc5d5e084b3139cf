"""Atomic checkpoints and the RNG state that makes ``--resume`` continue bit-for-bit.

A checkpoint is written with :func:`msn_core.durable.atomic_write` (temporary file, fsync, rename, fsync of the
directory), so a crash (or SIGKILL) at any moment leaves either the previous checkpoint or the new one.
Everything stored is plain tensors, numbers, strings, lists and dicts: it loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msn_core.durable import atomic_write

__all__ = ["capture_rng_state", "copy_checkpoint", "file_sha256", "load_checkpoint", "restore_rng_state",
           "save_checkpoint"]

CHECKPOINT_FORMAT = "msn-train-checkpoint"
CHECKPOINT_VERSION = 1


def save_checkpoint(
    path: str | Path, state: dict[str, Any], *, fmt: str = CHECKPOINT_FORMAT, version: int = CHECKPOINT_VERSION
) -> None:
    """Atomically ``torch.save`` ``state`` tagged with its format name and version (checked on load)."""
    state = {"format": fmt, "format_version": version, **state}
    atomic_write(path, lambda f: torch.save(state, f))


def copy_checkpoint(source: str | Path, destination: str | Path) -> None:
    """Atomic copy, e.g. to keep the checkpoint of an epoch beside the rolling ``checkpoint.pt``."""

    def write(f) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f, length=16 << 20)

    atomic_write(destination, write)


def load_checkpoint(
    path: str | Path, *, fmt: str = CHECKPOINT_FORMAT, version: int = CHECKPOINT_VERSION
) -> dict[str, Any]:
    """Load (``weights_only``) a checkpoint written by ``save_checkpoint`` with the same format name."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise ValueError(f"{path} is not a {fmt} file (no format={fmt!r} field)")
    if state.get("format_version", 0) > version:
        raise ValueError(f"{path} was written by a newer version (format_version={state['format_version']})")
    return state


def capture_rng_state(mask_generator: torch.Generator | None = None) -> dict[str, Any]:
    """This process's RNG streams: Python, NumPy, torch CPU, every CUDA device, and the mask generator."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if mask_generator is not None:
        state["mask"] = mask_generator.get_state()
    return state


def restore_rng_state(state: dict[str, Any], mask_generator: torch.Generator | None = None) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, np_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if mask_generator is not None and "mask" in state:
        mask_generator.set_state(state["mask"])


def file_sha256(path: str | Path, chunk_size: int = 1 << 20) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
