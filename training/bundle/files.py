"""A bundle's files on disk: the atomic staging directory it is built in, and its safetensors weights.

A bundle is built in a temporary sibling directory and renamed into place only after every check passed, so a
crash or a failed check never leaves a half-written or silently wrong bundle behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from msn_core.bundle import META_FILE, WEIGHTS_FILE
from msn_core.durable import fsync_path
from training.checkpoint import file_sha256
from training.model.vit import VisionTransformer, encoder_kwargs

__all__ = ["ExportError", "check_replaceable", "save_weights", "staging_dir", "weights_digest"]


class ExportError(RuntimeError):
    """The bundle could not be written or failed verification; nothing was written to the target."""


def check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise ExportError(f"{out_dir} exists and is not an MSN bundle (no {META_FILE}); refusing to replace it")


@contextlib.contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success fsync it and swap it into place, else delete it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield staging
        for path in staging.iterdir():  # mkdtemp makes a 0700 dir: bundles are read by other users (serving)
            path.chmod(0o644)
            fsync_path(path)
        staging.chmod(0o755)
        fsync_path(staging)
        if out_dir.exists():  # a directory cannot be os.replace'd over a non-empty one: park the old bundle
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, retired / "bundle")
            try:
                os.replace(staging, out_dir)
            except BaseException:
                os.replace(retired / "bundle", out_dir)
                raise
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
        fsync_path(out_dir.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def weights_digest(state: dict[str, Tensor]) -> str:
    """SHA-256 of the tensors themselves (sorted names, dtypes, shapes, bytes).

    The model id is built from this and not from the file's hash: safetensors writes its metadata in a hash-map
    order that changes from process to process, so re-exporting the same weights gives a different file."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}:{state[key].dtype}:{tuple(state[key].shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def save_weights(encoder: VisionTransformer, path: Path) -> dict:
    state = {key: value.detach().contiguous() for key, value in encoder.state_dict().items()}
    save_file(
        state, str(path), metadata={"format": "pt", "encoder_kwargs": json.dumps(encoder_kwargs(encoder))}
    )
    return {"file": WEIGHTS_FILE, "sha256": file_sha256(path), "content_sha256": weights_digest(state)}
