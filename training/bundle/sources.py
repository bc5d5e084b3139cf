"""Read a whole source checkpoint into a ready encoder plus its provenance: ours, official ``.pth.tar``, HF dir.

What ``msn-export`` hands to :func:`training.bundle.export.export_bundle`: the target encoder (eval mode) and an
info dict (kind, file name, sha256, architecture name, evaluation preprocessing, training summary). Key mappings
are :mod:`training.bundle.convert`'s; strict loading is :func:`training.model.load.load_trunk`'s.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from training.bundle.convert import StateDict, hf_config_to_kwargs, hf_to_ours, official_to_ours, strip_prefix
from training.checkpoint import file_sha256
from training.data import IMAGENET_MEAN, IMAGENET_STD
from training.model.load import load_trunk, preview_keys
from training.model.vit import (
    ARCHS,
    CONV_STEM_ARCHS,
    VisionTransformer,
    build_encoder,
    encoder_kwargs,
    parse_official_arch,
)
from training.run.state import target_encoder_weights

__all__ = [
    "complete_preprocessing",
    "encoder_from_hf",
    "encoder_from_official",
    "encoder_from_training_checkpoint",
    "resize_encoder",
]


def complete_preprocessing(preprocessing: Mapping | None, image_size: int) -> dict:
    """Preprocessing with ImageNet defaults for missing keys: resize 256 -> crop 224, scaled to ``image_size``."""
    defaults = {
        "resize": round(image_size * 256 / 224),
        "crop": image_size,
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "channels": 3,
        "interpolation": "bicubic",
    }
    return {**defaults, **dict(preprocessing or {})}


def resize_encoder(
    encoder: VisionTransformer, preprocessing: Mapping, image_size: int
) -> tuple[VisionTransformer, dict]:
    """Rebuild ``encoder`` for another input size (positional grid resized) and rescale its preprocessing."""
    resized = VisionTransformer(**{**encoder_kwargs(encoder), "image_size": image_size})
    load_trunk(resized, encoder.state_dict(), "encoder")
    crop = preprocessing.get("crop") or encoder.image_size
    resize = preprocessing.get("resize") or crop
    return resized, {**preprocessing, "resize": round(image_size * resize / crop), "crop": image_size}


def _arch_name(encoder: VisionTransformer) -> str:
    kwargs = encoder_kwargs(encoder)
    if encoder.conv_stem_strides is not None:
        official = (name for name, spec in CONV_STEM_ARCHS.items()
                    if all(list(v) == kwargs[k] if isinstance(v, tuple) else v == kwargs[k] for k, v in spec.items()))
        return next(official, "vit_convstem_custom")
    shape = (encoder.embed_dim, encoder.depth, encoder.num_heads)
    return next((name for name, dims in ARCHS.items() if dims == shape), "vit_custom")


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _torch_load(path: Path) -> dict:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # keep the cause, drop torch's essay
        detail = str(exc).split("WeightsUnpickler error:")[-1].split("Check the documentation")[0]
        detail = " ".join(detail.split())[:300] or type(exc).__name__
        raise ValueError(f"{path} is not a readable torch checkpoint: {detail}") from exc
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{path}: expected a checkpoint dict, got {type(checkpoint).__name__}")
    return checkpoint


def encoder_from_training_checkpoint(path: str | Path) -> tuple[VisionTransformer, dict]:
    """Target encoder of one of our training checkpoints, plus info (arch, preprocessing, config, sha256, ...)."""
    path = _require_file(Path(path), "checkpoint")
    checkpoint = _torch_load(path)
    try:
        weights, kwargs = target_encoder_weights(checkpoint)
    except KeyError as error:
        raise ValueError(f"{path}: {error.args[0]} (has {preview_keys(checkpoint)}); "
                         "for facebookresearch/msn files use --from-official") from None
    encoder = VisionTransformer(**dict(kwargs))
    state = strip_prefix(strip_prefix(weights, "module."), "_orig_mod.")
    load_trunk(encoder, state, f"{path} target_encoder")
    training = {key: checkpoint.get(key) for key in ("step", "epoch", "config")}
    for key in ("total_steps", "precision"):  # the schedule's length (budget and step-count runs); bf16 or fp32
        if checkpoint.get(key) is not None:
            training[key] = checkpoint[key]
    info = {
        "kind": "training",
        "path": path.name,
        "sha256": file_sha256(path),
        "arch": checkpoint.get("arch") or _arch_name(encoder),
        "preprocessing": complete_preprocessing(checkpoint.get("preprocessing"), encoder.image_size),
        "training": training,
        "feature": ((checkpoint.get("config") or {}).get("model") or {}).get("feature"),  # the config's choice
        **training,
    }
    return encoder.eval(), info


def encoder_from_official(
    path: str | Path, arch: str, image_size: int = 224
) -> tuple[VisionTransformer, dict]:
    """Target encoder of a facebookresearch/msn ``.pth.tar`` (released weights or a full training save)."""
    arch, patch_size = parse_official_arch(arch)
    path = _require_file(Path(path), "official checkpoint")
    checkpoint = _torch_load(path)
    key = next((k for k in ("target_encoder", "encoder") if k in checkpoint), None)
    if key is None:
        raise ValueError(f"{path}: no 'target_encoder' or 'encoder' entry (has {preview_keys(checkpoint)})")
    encoder = build_encoder(arch, patch_size, image_size)
    load_trunk(encoder, official_to_ours(checkpoint[key]), f"{path} {key} (--arch {arch} p{patch_size})")
    info = {
        "kind": "official",
        "path": path.name,
        "sha256": file_sha256(path),
        "arch": arch,
        "preprocessing": complete_preprocessing(None, image_size),
        "training": {"epoch": checkpoint.get("epoch")} if "epoch" in checkpoint else None,
    }
    return encoder.eval(), info


def _load_hf_weights(directory: Path) -> tuple[StateDict, list[Path]]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # sharded save_pretrained output
        shards = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        state: StateDict = {}
        for shard in shards:
            state.update(load_file(str(_require_file(shard, "weight shard"))))
        return state, shards
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            file = directory / name
            state = load_file(str(file)) if name.endswith(".safetensors") else _torch_load(file)
            return state, [file]
    raise FileNotFoundError(
        f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def encoder_from_hf(directory: str | Path) -> tuple[VisionTransformer, dict]:
    """Encoder from a transformers ``ViTMSNModel`` directory (``config.json`` + weights, legacy key names)."""
    directory = Path(directory)
    config = json.loads(_require_file(directory / "config.json", "HF config").read_text())
    encoder = VisionTransformer(**hf_config_to_kwargs(config))
    state, files = _load_hf_weights(directory)
    load_trunk(encoder, hf_to_ours(state), f"{directory} weights")
    digest = file_sha256(files[0]) if len(files) == 1 else hashlib.sha256(
        "".join(file_sha256(f) for f in files).encode()).hexdigest()  # fmt: skip
    preprocessing = complete_preprocessing(None, encoder.image_size)
    processor = directory / "preprocessor_config.json"
    if processor.is_file():
        settings = json.loads(processor.read_text())
        preprocessing.update(
            {k: list(settings[f"image_{k}"]) for k in ("mean", "std") if f"image_{k}" in settings}
        )
    info = {
        "kind": "hf",
        "path": directory.name,
        "sha256": digest,
        "arch": _arch_name(encoder),
        "preprocessing": preprocessing,
        "training": None,
    }
    return encoder.eval(), info
