"""Loading trunk weights into a ``VisionTransformer``: strict key checks with readable errors, and bundle encoders.

This is the one place torch code turns stored weights back into a module. Evaluation and the visualizer read a
bundle's ``encoder.safetensors`` through :func:`load_encoder`; the checkpoint converters in ``training.bundle``
load their mapped state dicts through :func:`load_trunk`. It lives with the model, not with export, so that
reading a bundle never depends on the code that writes one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from msn_core.bundle import WEIGHTS_FILE, BundleInfo, load_bundle_info
from training.model.stem import conv_stem_keys, conv_stem_layers
from training.model.vit import VisionTransformer, interpolate_patch_pos_embed

__all__ = [
    "KeyMismatchError",
    "check_keys",
    "describe_trunk",
    "load_encoder",
    "load_trunk",
    "preview_keys",
    "trunk_depth",
    "trunk_keys",
]

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


class KeyMismatchError(ValueError):
    """A state dict does not have the keys or shapes the target model expects."""


def preview_keys(keys: Iterable[str], limit: int = 8) -> str:
    """The first ``limit`` sorted keys, for error messages that name keys without a wall of text."""
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
            parts.append(f"missing keys: {preview_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {preview_keys(unexpected)}")
        raise KeyMismatchError("; ".join(parts))


def trunk_keys(depth: int, stem_layers: int | None = None) -> list[str]:
    """Every state-dict key of a ``depth``-block trunk, in our (= official) names.

    ``stem_layers``: the trunk has a conv stem with that many conv-BN-ReLU stages (``len(strides) - 1``; the
    official models have 4) instead of the patch projection; BatchNorm buffers included.
    """
    keys = ["cls_token", "pos_embed"]
    if stem_layers is None:
        keys += ["patch_embed.proj.weight", "patch_embed.proj.bias"]
    else:
        keys += conv_stem_keys(stem_layers)
    for i in range(depth):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            keys += [f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"]
    return keys + ["norm.weight", "norm.bias"]


def trunk_depth(state: Mapping[str, Tensor]) -> int:
    """Number of transformer blocks a trunk state dict holds (0 when it has none)."""
    indices = {int(m.group(1)) for key in state if (m := _BLOCK_KEY.match(key))}
    return max(indices) + 1 if indices else 0


def describe_trunk(trunk: Mapping[str, Tensor]) -> dict:
    """What a trunk state dict itself says about its architecture, in ``VisionTransformer`` kwarg names.

    ``embed_dim``, ``depth``, ``in_chans``, ``mlp_ratio`` and ``grid`` (patches per side of the stored position
    embeddings) always; ``patch_size`` only for a patch projection (a conv stem's strides are not in its weights).
    The number of heads is not stored anywhere in the weights. Used to explain a mismatch before loading.
    """
    embed_dim = int(trunk["cls_token"].shape[-1])
    shape = {"embed_dim": embed_dim, "depth": trunk_depth(trunk),
             "grid": round((trunk["pos_embed"].shape[1] - 1) ** 0.5)}
    if "blocks.0.mlp.fc1.weight" in trunk:
        shape["mlp_ratio"] = trunk["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim
    projection = trunk.get("patch_embed.proj.weight")
    if projection is not None:
        shape["patch_size"], shape["in_chans"] = int(projection.shape[-1]), int(projection.shape[1])
    elif "patch_embed.stem.0.weight" in trunk:
        shape["in_chans"] = int(trunk["patch_embed.stem.0.weight"].shape[1])
    return shape


def load_trunk(encoder: VisionTransformer, trunk: Mapping[str, Tensor], source: str) -> VisionTransformer:
    """Load ``trunk`` into ``encoder`` strictly, with errors that say which key has which shape.

    A square ``pos_embed`` for a different grid (e.g. 224 px weights into a 448 px encoder) is resized the same
    way the forward pass would resize it, so features are unchanged.
    """
    depth = trunk_depth(trunk)
    if depth != encoder.depth:
        raise KeyMismatchError(f"{source}: weights have {depth} blocks, the encoder expects {encoder.depth}")
    has_stem, wants_stem = conv_stem_layers(trunk.keys()) is not None, encoder.conv_stem_strides is not None
    if has_stem != wants_stem:
        kinds = {True: "a conv stem (patch_embed.stem.*)", False: "a patch projection (patch_embed.proj)"}
        raise KeyMismatchError(f"{source}: weights have {kinds[has_stem]}, the encoder {kinds[wants_stem]}; "
                               "the conv-stem models are deit_small_convstem and vitc_4gf")
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
        if wants_stem:
            kw.update(conv_stem_channels=encoder.conv_stem_channels, conv_stem_strides=encoder.conv_stem_strides)
        raise KeyMismatchError(f"{source}: shapes do not match a ViT with {kw}: " + "; ".join(wrong[:8]))
    encoder.load_state_dict(trunk, strict=True)
    return encoder


def load_encoder(bundle_dir: str | Path) -> tuple[VisionTransformer, BundleInfo]:
    """The torch encoder of an exported bundle (eval mode) and its ``msn.json``."""
    info = load_bundle_info(bundle_dir, need=(WEIGHTS_FILE,))
    encoder = VisionTransformer(**info.architecture.encoder_kwargs())
    weights = str(Path(bundle_dir) / WEIGHTS_FILE)
    load_trunk(encoder, load_file(weights), weights)
    return encoder.eval(), info
