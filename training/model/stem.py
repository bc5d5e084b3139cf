"""Convolutional stem for the official ``*_convstem`` ViTs (``deit_small_convstem``, ``vitc_4gf``).

The official ``src/deit.py`` (``ConvEmbed``, after Xiao et al. 2021, "Early convolutions help transformers see
better") replaces the p×p patchify convolution by a stack of 3×3 convolutions (padding 1, no bias) each followed by
BatchNorm and ReLU, then one 1×1 convolution (with bias) projecting to the embedding width. ``channels`` lists every
convolution's output width (the last one is ``embed_dim``) and ``strides`` their strides; the token grid is the
image divided by the product of the strides, which is the model's effective patch size. The official models use
channels ``(48, 96, 192, 384, 384)`` and strides ``(2, 2, 2, 2, 1)``: patch 16 for embed_dim 384.

The modules sit in ``stem`` (an ``nn.Sequential``) in the official order, so the state-dict keys are the official
ones: ``patch_embed.stem.{3i}`` conv, ``.{3i+1}`` BatchNorm (weight, bias, running_mean, running_var,
num_batches_tracked), ``.{3i+2}`` ReLU, and ``patch_embed.stem.{3n}`` the final 1×1 convolution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["ConvStem", "conv_stem_keys", "conv_stem_layers", "default_conv_stem", "resolve_conv_stem"]


def default_conv_stem(embed_dim: int, patch_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ViTC recipe for any power-of-two patch: log2(p) stride-2 3×3 convs doubling up to ``embed_dim``, then
    a stride-1 1×1 projection. ``(384, 16)`` gives the official ``(48, 96, 192, 384, 384), (2, 2, 2, 2, 1)``;
    ``(192, 4)`` gives ``(96, 192, 192), (2, 2, 1)`` (28 px images -> a 7×7 grid)."""
    n = round(math.log2(patch_size)) if patch_size >= 2 else 0
    if n < 1 or 2**n != patch_size:
        raise ValueError(f"a default conv stem needs a power-of-two patch_size >= 2, got {patch_size}; "
                         "give the channels and strides explicitly")
    if embed_dim % 2 ** (n - 1):
        raise ValueError(f"embed_dim {embed_dim} is not divisible by {2 ** (n - 1)} (default conv-stem widths "
                         f"embed_dim / 2^k for patch {patch_size}); give the channels explicitly")
    channels = tuple(embed_dim // 2 ** (n - 1 - i) for i in range(n)) + (embed_dim,)
    return channels, (2,) * n + (1,)


def resolve_conv_stem(
    embed_dim: int, patch_size: int | None, channels: Sequence[int] | None, strides: Sequence[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Complete and check a stem spec: missing strides follow ``patch_size`` (:func:`default_conv_stem`), missing
    channels follow the strides; the last width must be ``embed_dim`` and the strides' product ``patch_size``."""
    if strides is None:
        if patch_size is None:
            raise ValueError("a conv stem needs its strides or a patch_size")
        default_channels, strides = default_conv_stem(embed_dim, patch_size)
        channels = default_channels if channels is None else channels
    strides = tuple(int(s) for s in strides)
    if channels is None:
        n = len(strides) - 1
        channels = tuple(max(1, embed_dim // 2 ** (n - 1 - i)) for i in range(n)) + (embed_dim,)
    channels = tuple(int(c) for c in channels)
    if not strides or len(channels) != len(strides):
        raise ValueError(f"conv stem: {len(channels)} channels and {len(strides)} strides; give one width and "
                         "one stride per convolution (the last is the 1x1 projection)")
    if min(strides) < 1 or min(channels) < 1:
        raise ValueError(f"conv stem channels {list(channels)} and strides {list(strides)} must be positive")
    if channels[-1] != embed_dim:
        raise ValueError(f"conv stem: the last width {channels[-1]} must equal embed_dim {embed_dim}")
    product = math.prod(strides)
    if patch_size is not None and patch_size != product:
        raise ValueError(f"conv stem strides {list(strides)} give patch size {product}, not {patch_size}")
    return channels, strides


class ConvStem(nn.Module):
    """3×3 conv (no bias) + BatchNorm + ReLU per stride but the last, then a 1×1 conv to ``channels[-1]``.

    Output: tokens (B, H/P * W/P, channels[-1]), row-major over the grid, P = prod(strides), exactly like
    :class:`training.model.vit.PatchEmbed`; patch dropping (``keep_idx``) happens after it, on that grid.
    """

    def __init__(self, in_chans: int, channels: Sequence[int], strides: Sequence[int]) -> None:
        super().__init__()
        widths = [in_chans, *channels]
        layers: list[nn.Module] = []
        for i in range(len(channels) - 1):
            layers += [
                nn.Conv2d(widths[i], widths[i + 1], kernel_size=3, stride=strides[i], padding=1, bias=False),
                nn.BatchNorm2d(widths[i + 1]),
                nn.ReLU(),
            ]
        layers.append(nn.Conv2d(widths[-2], widths[-1], kernel_size=1, stride=strides[-1]))
        self.stem = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.stem(images).flatten(2).transpose(1, 2)


def conv_stem_keys(layers: int) -> list[str]:
    """State-dict keys of a stem with ``layers`` conv-BN-ReLU stages (``len(strides) - 1``), official names."""
    keys = []
    for i in range(layers):
        keys.append(f"patch_embed.stem.{3 * i}.weight")
        keys += [f"patch_embed.stem.{3 * i + 1}.{name}"
                 for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
    return keys + [f"patch_embed.stem.{3 * layers}.weight", f"patch_embed.stem.{3 * layers}.bias"]


def conv_stem_layers(keys: Sequence[str] | set[str]) -> int | None:
    """The number of conv-BN-ReLU stages a state dict's stem keys describe; ``None`` when it has no conv stem."""
    indices = {int(k.split(".")[2]) for k in keys if k.startswith("patch_embed.stem.") and k.split(".")[2].isdigit()}
    if not indices:
        return None
    return max(indices) // 3
