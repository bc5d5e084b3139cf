"""Key mappings between our ViT, the official MSN checkpoints and HuggingFace ``ViTMSNModel`` weights.

Our trunk uses the official key names, so official <-> ours is prefix/head bookkeeping. HF splits the fused qkv
and renames everything; we target the *on-disk* legacy names that ``save_pretrained`` writes (still
``encoder.layer.N.attention.attention.query`` in transformers 5.x), not whatever the installed version uses in
memory. The mappings are pure (state dict in, state dict out) and raise :class:`KeyMismatchError` naming the
offending keys rather than letting ``load_state_dict`` fail later with a wall of text. ``encoder_from_*`` read
whole checkpoints (ours, official ``.pth.tar``, an HF directory) into a ready encoder plus provenance info.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from training.checkpoint import file_sha256
from training.run.state import target_encoder_weights
from training.model.vit import (
    ARCHS,
    VisionTransformer,
    build_encoder,
    encoder_kwargs,
    interpolate_patch_pos_embed,
    parse_official_arch,
)

__all__ = [
    "KeyMismatchError",
    "check_keys",
    "complete_preprocessing",
    "encoder_from_hf",
    "encoder_from_official",
    "encoder_from_training_checkpoint",
    "hf_config_to_kwargs",
    "hf_to_ours",
    "kwargs_to_hf_config",
    "load_trunk",
    "official_head",
    "official_to_ours",
    "ours_to_hf",
    "ours_to_official",
    "resize_encoder",
    "trunk_keys",
]

StateDict = dict[str, Tensor]

_OFFICIAL_HEAD_PREFIXES = ("fc.", "pred.")  # projection head and (unused) prediction head
# ViTMSNForImageClassification's head and a pooler never belong to the trunk.
_HF_IGNORED_PREFIXES = ("classifier.", "pooler.")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


class KeyMismatchError(ValueError):
    """A state dict does not have the keys or shapes the target model expects."""


def _preview(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_keys(state: Mapping[str, Tensor], expected: Iterable[str], source: str) -> None:
    """Raise naming the missing and unexpected keys if ``state`` does not hold exactly ``expected``."""
    expected = set(expected)
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        parts = [f"{source}: state dict does not match the ViT trunk"]
        if missing:
            parts.append(f"missing keys: {_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_preview(unexpected)}")
        raise KeyMismatchError("; ".join(parts))


def trunk_keys(depth: int) -> list[str]:
    """Every state-dict key of a ``depth``-block trunk, in our (= official) names."""
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    for i in range(depth):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            keys += [f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"]
    return keys + ["norm.weight", "norm.bias"]


def _depth_of(state: Mapping[str, Tensor]) -> int:
    indices = {int(m.group(1)) for key in state if (m := _BLOCK_KEY.match(key))}
    return max(indices) + 1 if indices else 0


def _strip_prefix(state: Mapping[str, Tensor], prefix: str) -> StateDict:
    return {key.removeprefix(prefix): value for key, value in state.items()}


# --- official ---------------------------------------------------------------------------------------------


def official_to_ours(state: Mapping[str, Tensor]) -> StateDict:
    """Official ``target_encoder`` state dict -> our trunk: strip ``module.`` (DDP), drop ``fc.*``/``pred.*``."""
    state = _strip_prefix(state, "module.")
    trunk = {key: value for key, value in state.items() if not key.startswith(_OFFICIAL_HEAD_PREFIXES)}
    check_keys(trunk, trunk_keys(_depth_of(trunk)), "official checkpoint")
    return trunk


def official_head(state: Mapping[str, Tensor]) -> StateDict:
    """The projection-head part (``fc.*``, prefix removed) of an official encoder state dict, for resuming."""
    state = _strip_prefix(state, "module.")
    return {key.removeprefix("fc."): value for key, value in state.items() if key.startswith("fc.")}


def ours_to_official(
    trunk: Mapping[str, Tensor], head_state: Mapping[str, Tensor] | None = None, *, ddp_prefix: bool = True
) -> StateDict:
    """Our trunk (+ optional ``ProjectionHead`` state) -> an official ``target_encoder`` state dict.

    ``ddp_prefix`` adds ``module.`` as multi-GPU official runs (and the released weights) have it.
    """
    check_keys(trunk, trunk_keys(_depth_of(trunk)), "our trunk")
    state = dict(trunk)
    state.update({f"fc.{key}": value for key, value in (head_state or {}).items()})
    prefix = "module." if ddp_prefix else ""
    return {prefix + key: value for key, value in state.items()}


# --- HuggingFace ViTMSN (on-disk legacy names) -------------------------------------------------------------

_HF_GLOBAL = {
    "cls_token": "embeddings.cls_token",
    "pos_embed": "embeddings.position_embeddings",
    "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias",
    "norm.weight": "layernorm.weight",
    "norm.bias": "layernorm.bias",
}
_HF_BLOCK = {  # ours (inside blocks.{i}.) -> HF (inside encoder.layer.{i}.)
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
_HF_QKV = ("query", "key", "value")


def _hf_expected_keys(depth: int) -> list[str]:
    keys = list(_HF_GLOBAL.values())
    for i in range(depth):
        layers = list(_HF_BLOCK.values()) + [f"attention.attention.{name}" for name in _HF_QKV]
        keys += [f"encoder.layer.{i}.{layer}.{p}" for layer in layers for p in ("weight", "bias")]
    return keys


def hf_to_ours(state: Mapping[str, Tensor]) -> StateDict:
    """HF ``ViTMSNModel`` weights (legacy names, optional ``vit.`` prefix) -> our trunk, fusing q, k, v."""
    state = {
        key: value
        for key, value in _strip_prefix(state, "vit.").items()
        if not key.startswith(_HF_IGNORED_PREFIXES)
    }
    layer_ids = {int(m.group(1)) for key in state if (m := re.match(r"^encoder\.layer\.(\d+)\.", key))}
    depth = max(layer_ids) + 1 if layer_ids else 0
    check_keys(state, _hf_expected_keys(depth), "HF ViTMSN weights")
    ours = {key: state[hf_key] for key, hf_key in _HF_GLOBAL.items()}
    for i in range(depth):
        hf = f"encoder.layer.{i}."
        for layer, hf_layer in _HF_BLOCK.items():
            for p in ("weight", "bias"):
                ours[f"blocks.{i}.{layer}.{p}"] = state[f"{hf}{hf_layer}.{p}"]
        for p in ("weight", "bias"):
            parts = [state[f"{hf}attention.attention.{name}.{p}"] for name in _HF_QKV]
            ours[f"blocks.{i}.attn.qkv.{p}"] = torch.cat(parts, dim=0)
    return ours


def ours_to_hf(trunk: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """Our trunk -> HF ``ViTMSNModel`` on-disk names; ``prefix="vit."`` for ``ViTMSNForImageClassification``."""
    depth = _depth_of(trunk)
    check_keys(trunk, trunk_keys(depth), "our trunk")
    hf = {hf_key: trunk[key] for key, hf_key in _HF_GLOBAL.items()}
    for i in range(depth):
        for layer, hf_layer in _HF_BLOCK.items():
            for p in ("weight", "bias"):
                hf[f"encoder.layer.{i}.{hf_layer}.{p}"] = trunk[f"blocks.{i}.{layer}.{p}"]
        for p in ("weight", "bias"):
            for name, part in zip(_HF_QKV, trunk[f"blocks.{i}.attn.qkv.{p}"].chunk(3, dim=0)):
                hf[f"encoder.layer.{i}.attention.attention.{name}.{p}"] = part.contiguous()
    return {prefix + key: value for key, value in hf.items()}


def hf_config_to_kwargs(config: Mapping) -> dict:
    """``VisionTransformer`` kwargs from an HF ``config.json``; rejects settings our trunk cannot reproduce."""
    hidden = int(config.get("hidden_size", 768))
    problems = []
    if config.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act={config['hidden_act']!r} (expected 'gelu')")
    if abs(float(config.get("layer_norm_eps", 1e-6)) - 1e-6) > 1e-12:
        problems.append(f"layer_norm_eps={config['layer_norm_eps']} (expected 1e-06)")
    if not config.get("qkv_bias", True):
        problems.append("qkv_bias=false (expected true)")
    if problems:
        raise ValueError("unsupported HF ViTMSN config: " + ", ".join(problems))
    return {
        "image_size": int(config.get("image_size", 224)),
        "patch_size": int(config.get("patch_size", 16)),
        "in_chans": int(config.get("num_channels", 3)),
        "embed_dim": hidden,
        "depth": int(config.get("num_hidden_layers", 12)),
        "num_heads": int(config.get("num_attention_heads", 12)),
        "mlp_ratio": int(config.get("intermediate_size", 4 * hidden)) / hidden,
    }


def kwargs_to_hf_config(kwargs: Mapping) -> dict:
    """An HF ``config.json`` dict for ``ViTMSNModel`` describing a trunk built with ``kwargs``."""
    return {
        "architectures": ["ViTMSNModel"],
        "model_type": "vit_msn",
        "hidden_size": kwargs["embed_dim"],
        "num_hidden_layers": kwargs["depth"],
        "num_attention_heads": kwargs["num_heads"],
        "intermediate_size": int(kwargs["embed_dim"] * kwargs.get("mlp_ratio", 4.0)),
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-6,
        "image_size": kwargs["image_size"],
        "patch_size": kwargs["patch_size"],
        "num_channels": kwargs.get("in_chans", 3),
        "qkv_bias": True,
    }


# --- loading into a model ---------------------------------------------------------------------------------


def load_trunk(encoder: VisionTransformer, trunk: Mapping[str, Tensor], source: str) -> VisionTransformer:
    """Load ``trunk`` into ``encoder`` strictly, with errors that say which key has which shape.

    A square ``pos_embed`` for a different grid (e.g. 224 px weights into a 448 px encoder) is resized the same
    way the forward pass would resize it, so features are unchanged.
    """
    depth = _depth_of(trunk)
    if depth != encoder.depth:
        raise KeyMismatchError(f"{source}: weights have {depth} blocks, the encoder expects {encoder.depth}")
    expected = encoder.state_dict()
    check_keys(trunk, expected.keys(), source)
    trunk = dict(trunk)
    pos = trunk["pos_embed"]
    if pos.shape != expected["pos_embed"].shape and pos.ndim == 3 and pos.shape[2] == encoder.embed_dim:
        stored = round((pos.shape[1] - 1) ** 0.5)
        if stored * stored == pos.shape[1] - 1:  # a square grid of another size: resize as forward would
            grid = (encoder.grid_size, encoder.grid_size)
            patches = interpolate_patch_pos_embed(pos[:, 1:], (stored, stored), grid)
            trunk["pos_embed"] = torch.cat((pos[:, :1], patches), dim=1)
    wrong = [
        f"{key}: got {tuple(value.shape)}, expected {tuple(expected[key].shape)}"
        for key, value in trunk.items()
        if value.shape != expected[key].shape
    ]
    if wrong:
        kw = {k: getattr(encoder, k) for k in ("embed_dim", "depth", "num_heads", "patch_size", "image_size")}
        raise KeyMismatchError(f"{source}: shapes do not match a ViT with {kw}: " + "; ".join(wrong[:8]))
    encoder.load_state_dict(trunk, strict=True)
    return encoder


# --- reading whole checkpoints ----------------------------------------------------------------------------

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
        raise ValueError(f"{path}: {error.args[0]} (has {_preview(checkpoint)}); "
                         "for facebookresearch/msn files use --from-official") from None
    encoder = VisionTransformer(**dict(kwargs))
    state = _strip_prefix(_strip_prefix(weights, "module."), "_orig_mod.")
    load_trunk(encoder, state, f"{path} target_encoder")
    training = {key: checkpoint.get(key) for key in ("step", "epoch", "config")}
    if checkpoint.get("total_steps") is not None:  # the schedule's length (budget and step-count runs)
        training["total_steps"] = checkpoint["total_steps"]
    info = {
        "kind": "training",
        "path": path.name,
        "sha256": file_sha256(path),
        "arch": checkpoint.get("arch") or _arch_name(encoder),
        "preprocessing": complete_preprocessing(checkpoint.get("preprocessing"), encoder.image_size),
        "training": training,
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
        raise ValueError(f"{path}: no 'target_encoder' or 'encoder' entry (has {_preview(checkpoint)})")
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
