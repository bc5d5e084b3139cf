"""A bundle's files on disk: whether a path may be replaced by one, and its safetensors weights.

:mod:`training.bundle.export` builds a bundle in :func:`msn_core.durable.replace_dir`'s staging directory and swaps
it in only after every check passed, so a crash or a failed check never leaves a half-written or silently wrong
bundle behind; :func:`check_replaceable` keeps that swap from replacing a directory that is not a bundle.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from msn_core.bundle import META_FILE, WEIGHTS_FILE
from training.checkpoint import file_sha256
from training.model.vit import VisionTransformer, encoder_kwargs

__all__ = ["ExportError", "check_replaceable", "save_weights", "weights_digest"]


class ExportError(RuntimeError):
    """The bundle could not be written or failed verification; nothing was written to the target."""


def check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise ExportError(f"{out_dir} exists and is not an MSN bundle (no {META_FILE}); refusing to replace it")


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
