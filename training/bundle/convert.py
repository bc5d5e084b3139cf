"""Key mappings between our ViT trunk, the official MSN checkpoints and HuggingFace ``ViTMSNModel`` weights.

Our trunk uses the official key names, so official <-> ours is prefix/head bookkeeping. HF splits the fused qkv
and renames everything; we target the *on-disk* legacy names that ``save_pretrained`` writes (still
``encoder.layer.N.attention.attention.query`` in transformers 5.x), not whatever the installed version uses in
memory. The mappings are pure (state dict in, state dict out) and raise :class:`KeyMismatchError` naming the
offending keys rather than letting ``load_state_dict`` fail later with a wall of text. Reading whole checkpoint
files is :mod:`training.bundle.sources`'s job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from training.model.load import KeyMismatchError, check_keys, trunk_depth, trunk_keys
from training.model.stem import conv_stem_layers

__all__ = [
    "KeyMismatchError",
    "StateDict",
    "checkpoint_to_official",
    "hf_config_to_kwargs",
    "hf_to_ours",
    "kwargs_to_hf_config",
    "official_head",
    "official_to_ours",
    "ours_to_hf",
    "ours_to_official",
    "strip_prefix",
]

StateDict = dict[str, Tensor]

_OFFICIAL_HEAD_PREFIXES = ("fc.", "pred.")  # projection head and (unused) prediction head
# ViTMSNForImageClassification's head and a pooler never belong to the trunk.
_HF_IGNORED_PREFIXES = ("classifier.", "pooler.")


def strip_prefix(state: Mapping[str, Tensor], prefix: str) -> StateDict:
    """``state`` with ``prefix`` removed from the keys that have it (``module.`` of DDP, ``vit.`` of HF heads)."""
    return {key.removeprefix(prefix): value for key, value in state.items()}


# --- official ---------------------------------------------------------------------------------------------


def _expected_trunk_keys(trunk: Mapping[str, Tensor]) -> list[str]:
    """The keys a trunk of this depth and patch embedding (projection, or conv stem of this many stages) has."""
    return trunk_keys(trunk_depth(trunk), conv_stem_layers(trunk.keys()))


def official_to_ours(state: Mapping[str, Tensor]) -> StateDict:
    """Official ``target_encoder`` state dict -> our trunk: strip ``module.`` (DDP), drop ``fc.*``/``pred.*``.

    The conv-stem models (``ConvEmbed``: ``patch_embed.stem.N`` convs and BatchNorms, running statistics and
    ``num_batches_tracked`` included) keep their names too: our :class:`training.model.stem.ConvStem` has the
    official module order. Every key must be there; the running statistics are what the exported (eval-mode)
    stem normalises with.
    """
    state = strip_prefix(state, "module.")
    trunk = {key: value for key, value in state.items() if not key.startswith(_OFFICIAL_HEAD_PREFIXES)}
    check_keys(trunk, _expected_trunk_keys(trunk), "official checkpoint")
    return trunk


def official_head(state: Mapping[str, Tensor]) -> StateDict:
    """The projection-head part (``fc.*``, prefix removed) of an official encoder state dict, for resuming."""
    state = strip_prefix(state, "module.")
    return {key.removeprefix("fc."): value for key, value in state.items() if key.startswith("fc.")}


def ours_to_official(
    trunk: Mapping[str, Tensor], head_state: Mapping[str, Tensor] | None = None, *, ddp_prefix: bool = True
) -> StateDict:
    """Our trunk (+ optional ``ProjectionHead`` state) -> an official ``target_encoder`` state dict.

    ``ddp_prefix`` adds ``module.`` as multi-GPU official runs (and the released weights) have it.
    """
    check_keys(trunk, _expected_trunk_keys(trunk), "our trunk")
    state = dict(trunk)
    state.update({f"fc.{key}": value for key, value in (head_state or {}).items()})
    prefix = "module." if ddp_prefix else ""
    return {prefix + key: value for key, value in state.items()}


def checkpoint_to_official(checkpoint: Mapping, *, ddp_prefix: bool = True) -> dict:
    """One of our training checkpoints -> the layout of the released facebookresearch/msn weights.

    Exactly what those files hold (and ``torch.load(...)["target_encoder"]`` users read): ``target_encoder``, the
    target trunk with its projection head under ``fc.*`` (fused ``attn.qkv``, ``module.`` keys as a multi-GPU run
    saves them unless ``ddp_prefix=False``), and ``prototypes`` (K x D). Optimiser state and the online encoder
    are not part of the released layout.
    """
    missing = [key for key in ("target_encoder", "target_head", "prototypes") if key not in checkpoint]
    if missing:
        raise KeyError(f"not an MSN pretraining checkpoint: no {', '.join(missing)}")
    trunk = strip_prefix(strip_prefix(checkpoint["target_encoder"], "module."), "_orig_mod.")
    return {"target_encoder": ours_to_official(trunk, checkpoint["target_head"], ddp_prefix=ddp_prefix),
            "prototypes": checkpoint["prototypes"].detach().clone()}


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
        for key, value in strip_prefix(state, "vit.").items()
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
    depth = trunk_depth(trunk)
    if conv_stem_layers(trunk.keys()) is not None:
        raise ValueError("HF ViTMSN has no conv stem: a conv-stem trunk cannot be written in its format")
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
    if kwargs.get("conv_stem_strides") is not None or kwargs.get("conv_stem_channels") is not None:
        raise ValueError("HF ViTMSN has no conv stem: a conv-stem trunk cannot be written in its format")
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
