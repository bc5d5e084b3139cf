"""Vision Transformer trunk for MSN, faithful to the official ``src/deit.py``.

Same numerics and state-dict key names as the official model, so released checkpoints load after stripping
``module.``. Two things the official code lacks:

* patch dropping by *gather indices* (``keep_idx``) computed outside the model, so masking is random at train time
  and the graph exports to ONNX with a dynamic number of kept patches;
* a key-padding mask (``keep_mask``) so one batch can mix samples that keep different numbers of patches.

The official conv-stem models (``deit_small_convstem``, ``vitc_4gf``) are built with ``conv_stem_channels`` and
``conv_stem_strides`` (:mod:`training.model.stem`): the stem replaces the patchify convolution, the effective
patch size is the product of its strides, and everything after it (positions, patch dropping) is unchanged.

Positional embeddings are resized bicubically to any patch grid (96 px focal views through a 224 px model,
non-square inputs), with ``size=`` rather than the official ``scale_factor=`` so the grid is exact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.model.stem import ConvStem, resolve_conv_stem

__all__ = [
    "ARCHS",
    "CONV_STEM_ARCHS",
    "CPU_ATTENTION_KERNELS",
    "VisionTransformer",
    "build_encoder",
    "encoder_kwargs",
    "interpolate_patch_pos_embed",
    "parse_official_arch",
    "use_cpu_attention",
]

# name -> (embed_dim, depth, num_heads); the official deit_{tiny,small,base,large,huge} trunks.
ARCHS: dict[str, tuple[int, int, int]] = {
    "vit_tiny": (192, 12, 3),
    "vit_small": (384, 12, 6),
    "vit_base": (768, 12, 12),
    "vit_large": (1024, 24, 16),
    "vit_huge": (1280, 32, 16),
}

# The official conv-stem factories (src/deit.py): 384 wide, 11 blocks, 6 heads, stem channels 48-96-192-384 (3x3,
# stride 2, BN + ReLU) then a 1x1 projection to 384 (stride 1): patch 16. They differ only in mlp_ratio.
_OFFICIAL_STEM = {"conv_stem_channels": (48, 96, 192, 384, 384), "conv_stem_strides": (2, 2, 2, 2, 1)}
CONV_STEM_ARCHS: dict[str, dict] = {
    "deit_small_convstem": {"embed_dim": 384, "depth": 11, "num_heads": 6, "mlp_ratio": 6.0, **_OFFICIAL_STEM},
    "vitc_4gf": {"embed_dim": 384, "depth": 11, "num_heads": 6, "mlp_ratio": 3.0, **_OFFICIAL_STEM},
}

# Factory names in the official src/deit.py.
OFFICIAL_ARCHS: tuple[str, ...] = (
    "deit_tiny",
    "deit_small", "deit_small_p8", "deit_small_p7",
    "deit_base", "deit_base_p8", "deit_base_p7", "deit_base_p4",
    "deit_large", "deit_large_p8", "deit_large_p7",
    "deit_huge", "deit_huge_p8", "deit_huge_p7", "deit_huge_p10",
    *CONV_STEM_ARCHS,
)  # fmt: skip

_ARCH_NAME = re.compile(r"^(?:deit|vit)_(tiny|small|base|large|huge)(?:_p(\d+))?$")
_LAYER_NORM_EPS = 1e-6
_INIT_STD = 0.02


def parse_official_arch(name: str) -> tuple[str, int]:
    """Map an official model name (``deit_base_p4``) to ``(arch, patch_size)`` (``("vit_base", 4)``).

    Our own spelling (``vit_base``, ``vit_base_p8``) is accepted too; no suffix means patch 16. The conv-stem
    models keep their official names (``("vitc_4gf", 16)``): :func:`build_encoder` knows them.
    """
    key = name.strip().lower()
    if key in CONV_STEM_ARCHS:
        return key, math.prod(CONV_STEM_ARCHS[key]["conv_stem_strides"])
    match = _ARCH_NAME.match(key)
    if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
        raise ValueError(
            f"unknown architecture {name!r}; expected one of {', '.join(OFFICIAL_ARCHS)} "
            f"(or vit_{{tiny,small,base,large,huge}}[_pN])"
        )
    size, patch = match.groups()
    return f"vit_{size}", int(patch) if patch else 16


def interpolate_patch_pos_embed(
    patch_pos: Tensor, stored_grid: tuple[int, int], grid: tuple[int, int]
) -> Tensor:
    """Resize patch positional embeddings (1, rows*cols, D) from ``stored_grid`` to ``grid`` (bicubic).

    ``size=`` (not the official ``scale_factor=``) keeps the output grid exact; an unchanged grid is returned
    as is, so the common full-resolution case is bit-exact and exports without a resize op.
    """
    if tuple(stored_grid) == tuple(grid):
        return patch_pos
    dim = patch_pos.shape[-1]
    image = patch_pos.reshape(1, stored_grid[0], stored_grid[1], dim).permute(0, 3, 1, 2)
    image = F.interpolate(image, size=grid, mode="bicubic", align_corners=False)
    return image.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], dim)


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample, rescale survivors by 1/keep_prob."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        return x * keep.div_(keep_prob)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


class PatchEmbed(nn.Module):
    """Non-overlapping p×p patches -> tokens, via a strided convolution (key ``patch_embed.proj``)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, images: Tensor) -> Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # (B, H/p * W/p, D), row-major


CPU_ATTENTION_KERNELS = ("explicit", "sdpa")  # what ``run.cpu_attention`` resolves to (``auto``: timed, or explicit)


def _cpu_bf16(x: Tensor) -> bool:
    """True where attention runs in bf16 on a CPU (bf16 tensors, or inside a bf16 CPU autocast)."""
    if x.device.type != "cpu":
        return False
    return x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
    """softmax(q kᵀ / √d) v as the official ``deit.py`` writes it, the logits and softmax in fp32.

    The default for bf16 on CPUs (``Attention.cpu_bf16_kernel``), where PyTorch's fused CPU attention kernel was
    ~2.5x slower forward + backward at MSN's token counts (197 and 37) on a Zen 4 (docs/benchmarks.md, "The same
    pairing on a CPU"); on an AMX Xeon the fused kernel may win, so ``run.cpu_attention: auto`` times both
    (``training/run/speed_timing.py``). CUDA and fp32 keep ``F.scaled_dot_product_attention``. The logits stay
    fp32 as in the fused kernel (bf16 logits were faster still, but moved a step's loss by 0.2 %); only
    ``probs @ v`` runs in bf16. ``attn_mask``: bool, True where a key may be attended to.
    """
    with torch.autocast(q.device.type, enabled=False):  # fp32 logits (autocast would recast the matmul to bf16)
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        probs = scores.softmax(dim=-1)
    return probs.to(v.dtype) @ v


def use_cpu_attention(modules: nn.Module | Sequence[nn.Module], kernel: str) -> None:
    """Run bf16 attention on CPUs in every :class:`Attention` under ``modules`` with ``kernel`` (explicit | sdpa).

    Per model rather than per process, so a run's choice never leaks into another model in the same process (an
    evaluation encoder, a test); the ONNX export builds its own fp32 model, where the setting does not apply."""
    if kernel not in CPU_ATTENTION_KERNELS:
        raise ValueError(f"CPU attention kernel {kernel!r}: expected one of {', '.join(CPU_ATTENTION_KERNELS)}")
    for root in [modules] if isinstance(modules, nn.Module) else modules:
        for module in root.modules():
            if isinstance(module, Attention):
                module.cpu_bf16_kernel = kernel


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (official key layout: q, k, v stacked)."""

    cpu_bf16_kernel: str = "explicit"  # bf16 on a CPU: explicit_attention or sdpa (use_cpu_attention)

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, N, head_dim)
        if self.cpu_bf16_kernel == "explicit" and _cpu_bf16(q):
            x = explicit_attention(q, k, v, attn_mask)
        else:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(x.transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), attn_mask))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """ViT trunk returning the CLS token before and after the final LayerNorm.

    ``image_size`` fixes the size of the stored positional-embedding grid; inputs may be any multiple of
    ``patch_size`` (the embeddings are interpolated). The projection head lives outside (``training.model.heads``).

    With ``conv_stem_channels``/``conv_stem_strides`` (either may be omitted: :func:`resolve_conv_stem` fills it
    in) the patchify convolution becomes the official conv stem (:class:`training.model.stem.ConvStem`, keys
    ``patch_embed.stem.*``) and ``patch_size`` is the product of the strides (``None``: derived; 16 without a stem).
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int | None = None,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        drop_path_rate: float = 0.0,
        conv_stem_channels: Sequence[int] | None = None,
        conv_stem_strides: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.conv_stem_channels: tuple[int, ...] | None = None
        self.conv_stem_strides: tuple[int, ...] | None = None
        if conv_stem_channels is not None or conv_stem_strides is not None:
            self.conv_stem_channels, self.conv_stem_strides = resolve_conv_stem(
                embed_dim, patch_size, conv_stem_channels, conv_stem_strides)
            patch_size = math.prod(self.conv_stem_strides)
        elif patch_size is None:
            patch_size = 16
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        self.image_size = image_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid_size = image_size // patch_size
        self.num_patches = self.grid_size**2
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.drop_path_rate = drop_path_rate

        self.patch_embed: nn.Module
        if self.conv_stem_strides is not None:
            self.patch_embed = ConvStem(in_chans, self.conv_stem_channels, self.conv_stem_strides)
        else:
            self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches + 1, embed_dim))
        drop_rates = torch.linspace(0, drop_path_rate, depth).tolist()  # linear decay rule, as official
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, rate) for rate in drop_rates)
        self.norm = nn.LayerNorm(embed_dim, eps=_LAYER_NORM_EPS)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Official init. Note the patch projection (and every conv of a conv stem) gets Kaiming (fan_in, relu),
        unlike DINO/MAE; stem BatchNorms start at weight 1, bias 0 and fresh running statistics."""
        nn.init.trunc_normal_(self.pos_embed, std=_INIT_STD)
        nn.init.trunc_normal_(self.cls_token, std=_INIT_STD)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=_INIT_STD)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()
        if isinstance(self.patch_embed, ConvStem):  # official: conv biases start at 0 (the stem's 1x1 projection)
            for module in self.patch_embed.modules():
                if isinstance(module, nn.Conv2d) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def patch_grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid (rows, cols) of an image; ``keep_idx`` indexes it in row-major order."""
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"image size {height}x{width} is not a multiple of patch_size {self.patch_size}")
        return height // self.patch_size, width // self.patch_size

    def patch_pos_embed(self, grid_h: int, grid_w: int) -> Tensor:
        """Positional embeddings of the patch tokens for a grid, (1, grid_h*grid_w, D); CLS slot excluded."""
        stored = (self.grid_size, self.grid_size)
        return interpolate_patch_pos_embed(self.pos_embed[:, 1:], stored, (grid_h, grid_w))

    def prepare_tokens(self, images: Tensor, keep_idx: Tensor | None = None) -> Tensor:
        """Tokens entering the first block: CLS then the kept patches, positions added before dropping."""
        grid_h, grid_w = self.patch_grid(images.shape[-2], images.shape[-1])
        patches = self.patch_embed(images) + self.patch_pos_embed(grid_h, grid_w)
        if keep_idx is not None:
            index = keep_idx.unsqueeze(-1).expand(-1, -1, self.embed_dim)
            patches = torch.gather(patches, 1, index)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(patches.shape[0], -1, -1)
        return torch.cat((cls, patches), dim=1)

    def forward_tokens(
        self, images: Tensor, keep_idx: Tensor | None = None, keep_mask: Tensor | None = None
    ) -> Tensor:
        """All output tokens of the last block, before the final norm: (B, 1 + K, D), CLS first.

        ``keep_idx`` (B, K) int64: kept patches, row-major in the grid of ``images``.
        ``keep_mask`` (B, K) bool: False marks padding, which no token attends to.
        """
        return self.forward_blocks(images, keep_idx, keep_mask, last=1)[-1]

    def forward_blocks(
        self, images: Tensor, keep_idx: Tensor | None = None, keep_mask: Tensor | None = None, *, last: int = 1
    ) -> list[Tensor]:
        """The output tokens of the last ``last`` blocks, oldest first, each (B, 1 + K, D) before the final norm."""
        tokens = self.prepare_tokens(images, keep_idx)
        attn_mask = None
        if keep_mask is not None:
            if keep_mask.shape != tokens.shape[:1] + (tokens.shape[1] - 1,):
                raise ValueError(
                    f"keep_mask has shape {tuple(keep_mask.shape)}, expected {(tokens.shape[0], tokens.shape[1] - 1)}"
                )
            cls_visible = keep_mask.new_ones(keep_mask.shape[0], 1)
            # (B, 1, 1, 1+K): broadcast over heads and queries, masks keys only.
            attn_mask = torch.cat((cls_visible, keep_mask), dim=1)[:, None, None, :]
        outputs = []
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, attn_mask)
            if i >= len(self.blocks) - last:
                outputs.append(tokens)
        return outputs

    def forward(
        self, images: Tensor, keep_idx: Tensor | None = None, keep_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Returns ``(cls_pre_norm, cls_post_norm)``, each (B, D).

        The pre-norm CLS is the official low-shot feature (``forward_blocks``); the post-norm CLS feeds the
        projection head during training (``forward_features``).
        """
        cls_pre_norm = self.forward_tokens(images, keep_idx, keep_mask)[:, 0]
        return cls_pre_norm, self.norm(cls_pre_norm)


def build_encoder(arch: str, patch_size: int, image_size: int, **overrides) -> VisionTransformer:
    """Encoder of a named size; ``overrides`` may set embed_dim, depth, num_heads, mlp_ratio, drop_path_rate and
    a conv stem (``conv_stem_channels``/``conv_stem_strides``). ``arch`` is one of :data:`ARCHS` or an official
    conv-stem model (:data:`CONV_STEM_ARCHS`, whose stem fixes ``patch_size`` at 16)."""
    if arch not in ARCHS and arch not in CONV_STEM_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join([*ARCHS, *CONV_STEM_ARCHS])}")
    allowed = {"embed_dim", "depth", "num_heads", "mlp_ratio", "drop_path_rate", "conv_stem_channels",
               "conv_stem_strides"}
    unknown = set(overrides) - allowed
    if unknown:
        raise TypeError(f"unexpected encoder overrides {sorted(unknown)}; allowed: {sorted(allowed)}")
    if arch in CONV_STEM_ARCHS:
        base = dict(CONV_STEM_ARCHS[arch])
    else:
        embed_dim, depth, num_heads = ARCHS[arch]
        base = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads}
    kwargs = {**base, **overrides}
    return VisionTransformer(image_size=image_size, patch_size=patch_size, **kwargs)


def encoder_kwargs(encoder: VisionTransformer) -> dict:
    """Constructor kwargs of ``encoder``: store them next to weights, rebuild with ``VisionTransformer(**kw)``.

    The conv stem's ``conv_stem_channels``/``conv_stem_strides`` (lists) appear only when it has one, so plain
    trunks keep the kwargs they always had."""
    stem = {}
    if encoder.conv_stem_strides is not None:
        stem = {"conv_stem_channels": list(encoder.conv_stem_channels),
                "conv_stem_strides": list(encoder.conv_stem_strides)}
    return {
        "image_size": encoder.image_size,
        "patch_size": encoder.patch_size,
        "in_chans": encoder.in_chans,
        "embed_dim": encoder.embed_dim,
        "depth": encoder.depth,
        "num_heads": encoder.num_heads,
        "mlp_ratio": encoder.mlp_ratio,
        "drop_path_rate": encoder.drop_path_rate,
        **stem,
    }
