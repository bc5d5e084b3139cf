"""The RCDM decoder: a diffusers ``UNet2DModel`` conditioned on a frozen MSN embedding.

As in facebookresearch/RCDM, the representation (``cond.feature``; by default the [CLS] output, as the paper's figure
conditions) enters through one learned linear projection, or a small MLP with ``model.global_mlp``, that is *added to
the timestep embedding* (``class_embed_type="identity"``: the UNet adds whatever it is given); that sum drives the
scale-shift GroupNorm (AdaGN, ``resnet_time_scale_shift="scale_shift"``) of every ResNet block. There is no
cross-attention. Two optional additions: a LayerNorm on the raw feature (MSN's pre-norm CLS has a large, model-
dependent scale) and a learned null embedding that replaces the feature for classifier-free guidance.

An inpainting view, when asked (``model.map_channels`` with a spatial feature, ``cond.feature: token_map``): the CLS +
the patch tokens' map (:class:`msn_core.features.FeatureLayout`) keeps its layout. The map is normalised per place,
projected to ``map_channels`` channels by a 1 x 1 convolution, upsampled to the image and concatenated to ``x_t`` as
extra input channels, so what the encoder saw at a place conditions the pixels at that place; the global path then
carries the CLS part alone. Such a decoder reproduces its source image (measured: docs/visualizer.md), so it shows how
kept patches fill in the rest, not what the representation discards. ``build_decoder`` also builds the plain
regression decoder (``model.kind: regression``, :mod:`visualizer.regression`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import UNet2DModel
from torch import Tensor, nn

from msn_core.features import FeatureLayout
from visualizer.config import ModelConfig
from visualizer.regression import RegressionDecoder

__all__ = ["RCDMDecoder", "build_decoder"]


def _block_types(cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    down, up = [], []
    for attn in cfg.attention:
        if attn:
            down.append("AttnDownBlock2D")
            up.append("AttnUpBlock2D")
        elif cfg.resblock_updown:
            down.append("ResnetDownsampleBlock2D")
            up.append("ResnetUpsampleBlock2D")
        else:
            down.append("DownBlock2D")
            up.append("UpBlock2D")
    return tuple(down), tuple(reversed(up))


class RCDMDecoder(nn.Module):
    """``forward(x_t, t, feat, drop=None) -> model output`` (B, C or 2C, H, W): epsilon [+ variance logits]."""

    def __init__(self, cfg: ModelConfig, cond_dim: int, layout: FeatureLayout | None = None) -> None:
        super().__init__()
        down, up = _block_types(cfg)
        updown = "resnet" if cfg.resblock_updown else "conv"
        self.image_size, self.channels, self.cond_dim = cfg.image_size, cfg.channels, cond_dim
        self.learn_sigma = cfg.learn_sigma
        spatial = cfg.map_channels > 0 and layout is not None and layout.side > 0
        if cfg.map_channels > 0 and not spatial:
            raise ValueError("model.map_channels needs a bundle whose feature has a token map (patch_tokens, "
                             "cls_patch_tokens, patch_gridN); this one's is flat: set model.map_channels=0")
        if spatial and layout.global_dim + layout.map_dim != cond_dim:
            raise ValueError(f"feature layout {layout} does not add up to the {cond_dim}-d feature")
        self.layout = layout if spatial else None
        self.unet = UNet2DModel(
            sample_size=cfg.image_size, in_channels=cfg.channels + (cfg.map_channels if spatial else 0),
            out_channels=cfg.channels * (2 if cfg.learn_sigma else 1),
            down_block_types=down, up_block_types=up, block_out_channels=tuple(cfg.block_out_channels),
            layers_per_block=cfg.layers_per_block, attention_head_dim=cfg.attention_head_dim,
            norm_num_groups=cfg.norm_num_groups, dropout=cfg.dropout, downsample_type=updown,
            upsample_type=updown, resnet_time_scale_shift="scale_shift", class_embed_type="identity",
            flip_sin_to_cos=True, freq_shift=0,  # ADM's cat[cos, sin] timestep features
        )  # fmt: skip
        time_embed_dim = cfg.block_out_channels[0] * 4
        global_dim = cond_dim if self.layout is None else self.layout.global_dim or self.layout.token_dim
        self.feat_norm = nn.LayerNorm(global_dim, elementwise_affine=False) if cfg.cond_norm else nn.Identity()
        self.cond_proj: nn.Module = nn.Linear(global_dim, time_embed_dim)  # RCDM's `ssl_emb`
        if cfg.global_mlp:
            self.cond_proj = nn.Sequential(nn.Linear(global_dim, time_embed_dim), nn.SiLU(),
                                           nn.Linear(time_embed_dim, time_embed_dim))
        if self.layout is not None:
            self.map_norm = nn.LayerNorm(self.layout.token_dim, elementwise_affine=False)
            self.map_proj = nn.Conv2d(self.layout.token_dim, cfg.map_channels, kernel_size=1)
        self.null_feat = nn.Parameter(torch.zeros(cond_dim))  # classifier-free guidance's "no condition"

    def _split(self, feat: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(global part, token map (B, D, side, side) or None)``; a map without a global part gives its mean."""
        if self.layout is None:
            return self.feat_norm(feat), None
        lay, batch = self.layout, feat.shape[0]
        tokens = self.map_norm(feat[:, lay.global_dim:].reshape(batch, lay.side * lay.side, lay.token_dim))
        head = feat[:, : lay.global_dim] if lay.global_dim else tokens.mean(dim=1)
        return self.feat_norm(head), tokens.transpose(1, 2).reshape(batch, lay.token_dim, lay.side, lay.side)

    def condition(self, feat: Tensor, drop: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The vector added to the time embedding and the map's input channels (None without one); rows where
        ``drop`` is True use the null embedding."""
        feat = feat.float()
        if drop is not None:
            feat = torch.where(drop[:, None], self.null_feat.expand_as(feat), feat)
        head, tokens = self._split(feat)
        if tokens is None:
            return self.cond_proj(head), None
        channels = F.interpolate(self.map_proj(tokens), size=(self.image_size, self.image_size), mode="bilinear",
                                 align_corners=False)
        return self.cond_proj(head), channels

    def forward(self, x_t: Tensor, t: Tensor, feat: Tensor, drop: Tensor | None = None) -> Tensor:
        cond, channels = self.condition(feat, drop)
        if drop is None:  # keep the null embedding in the graph so DDP sees a gradient for every parameter
            cond = cond + 0.0 * self.null_feat.sum()
        x_in = x_t if channels is None else torch.cat([x_t, channels.to(x_t.dtype)], dim=1)
        return self.unet(x_in, t, class_labels=cond.to(x_t.dtype)).sample


def build_decoder(cfg: ModelConfig, cond_dim: int, layout: FeatureLayout | None = None) -> nn.Module:
    """The network ``model.kind`` names: the RCDM UNet, or the plain regression decoder (a flat feature vector)."""
    if cfg.kind == "regression":
        return RegressionDecoder(cfg, cond_dim)
    return RCDMDecoder(cfg, cond_dim, layout)
