"""Atomic checkpoints and the RNG state that makes ``--resume`` continue bit-for-bit.

A checkpoint is written with :func:`msn_core.durable.atomic_write` (temporary file, fsync, rename, fsync of the
directory), so a crash (or SIGKILL) at any moment leaves either the previous checkpoint or the new one.
Everything stored is plain tensors, numbers, strings, lists and dicts: it loads with ``weights_only=True``.

Restarts: :func:`launch_id` names one launch of a run (kept across torchrun's restarts of its workers), so a
restarted worker resumes only a checkpoint its own launch wrote; :func:`fault_point` is the test hook that kills a
process at a chosen step or inside a checkpoint write (``MSN_TEST_KILL_AT``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msn_core.durable import atomic_write, atomic_write_json

__all__ = ["capture_rng_state", "copy_checkpoint", "fault_point", "file_sha256", "launch_id", "load_checkpoint",
           "restore_rng_state", "save_checkpoint"]

CHECKPOINT_FORMAT = "msn-train-checkpoint"
CHECKPOINT_VERSION = 1


def save_checkpoint(
    path: str | Path, state: dict[str, Any], *, fmt: str = CHECKPOINT_FORMAT, version: int = CHECKPOINT_VERSION
) -> None:
    """Atomically ``torch.save`` ``state`` tagged with its format name and version (checked on load)."""
    state = {"format": fmt, "format_version": version, **state}

    def write(f) -> None:
        torch.save(state, f)
        fault_point("checkpoint-write", state.get("step"))  # test hook: a write killed before its rename

    atomic_write(path, write)


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


def launch_id(output_dir: str | Path, *, restarted: bool) -> str | None:
    """The id of this launch of the run in ``output_dir`` (rank 0 calls it; every checkpoint records it).

    A new launch (``restarted=False``) draws a new id and writes it to ``OUTPUT_DIR/launch.json``; workers that
    torchrun restarted read it back (None when it is missing or unreadable). A restart then resumes ``checkpoint.pt``
    only when it carries the same id: a checkpoint left by an earlier launch is continued only with ``--resume``.
    """
    path = Path(output_dir) / "launch.json"
    if restarted:
        try:
            return json.loads(path.read_text())["id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
    new_id = uuid.uuid4().hex
    atomic_write_json(path, {"id": new_id})
    return new_id


KILL_AT = "MSN_TEST_KILL_AT"
FAULT_POINTS = ("step", "checkpoint-write")


def fault_point(point: str, step: int | None) -> None:
    """Test hook, read here only: SIGKILL this process at ``point`` of ``step`` if ``MSN_TEST_KILL_AT`` says so.

    ``MSN_TEST_KILL_AT=<point>:<step>:<rank>``: ``step:5:1`` kills rank 1 right after its optimiser step 5 (before
    that step's log and checkpoint); ``checkpoint-write:6:0`` kills rank 0 (the writer) inside the write of step 6's
    checkpoint (its temporary file written, not yet flushed or renamed). It fires only on a first attempt
    (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted workers run past it; unset, it does nothing.
    Used by tests/training/test_elastic.py to make the failures of a torchrun restart deterministic.
    """
    spec = os.environ.get(KILL_AT)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at_point, _, rest = spec.partition(":")
    at_step, _, at_rank = rest.partition(":")
    if at_point not in FAULT_POINTS or not at_step.isdigit() or not at_rank.isdigit():
        raise ValueError(f"{KILL_AT}={spec!r}: expected <{'|'.join(FAULT_POINTS)}>:<step>:<rank>, e.g. step:5:1")
    if (point, step, int(os.environ.get("RANK", "0"))) == (at_point, int(at_step), int(at_rank)):
        os.kill(os.getpid(), signal.SIGKILL)


def file_sha256(path: str | Path, chunk_size: int = 1 << 20) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
