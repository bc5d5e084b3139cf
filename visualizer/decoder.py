"""The RCDM decoder: a diffusers ``UNet2DModel`` conditioned on a frozen MSN embedding.

As in facebookresearch/RCDM, the representation enters through one learned linear projection that is *added to the
timestep embedding* (``class_embed_type="identity"``: the UNet adds whatever it is given); that sum drives the
scale-shift GroupNorm (AdaGN, ``resnet_time_scale_shift="scale_shift"``) of every ResNet block. There is no
cross-attention. Two optional additions: a LayerNorm on the raw feature (MSN's pre-norm CLS has a large, model-
dependent scale) and a learned null embedding that replaces the feature for classifier-free guidance.
"""

from __future__ import annotations

import torch
from diffusers import UNet2DModel
from torch import Tensor, nn

from visualizer.config import ModelConfig

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

    def __init__(self, cfg: ModelConfig, cond_dim: int) -> None:
        super().__init__()
        down, up = _block_types(cfg)
        updown = "resnet" if cfg.resblock_updown else "conv"
        self.image_size, self.channels, self.cond_dim = cfg.image_size, cfg.channels, cond_dim
        self.learn_sigma = cfg.learn_sigma
        self.unet = UNet2DModel(
            sample_size=cfg.image_size, in_channels=cfg.channels,
            out_channels=cfg.channels * (2 if cfg.learn_sigma else 1),
            down_block_types=down, up_block_types=up, block_out_channels=tuple(cfg.block_out_channels),
            layers_per_block=cfg.layers_per_block, attention_head_dim=cfg.attention_head_dim,
            norm_num_groups=cfg.norm_num_groups, dropout=cfg.dropout, downsample_type=updown,
            upsample_type=updown, resnet_time_scale_shift="scale_shift", class_embed_type="identity",
            flip_sin_to_cos=True, freq_shift=0,  # ADM's cat[cos, sin] timestep features
        )  # fmt: skip
        time_embed_dim = cfg.block_out_channels[0] * 4
        self.feat_norm = nn.LayerNorm(cond_dim, elementwise_affine=False) if cfg.cond_norm else nn.Identity()
        self.cond_proj = nn.Linear(cond_dim, time_embed_dim)  # RCDM's `ssl_emb`
        self.null_feat = nn.Parameter(torch.zeros(cond_dim))  # classifier-free guidance's "no condition"

    def condition(self, feat: Tensor, drop: Tensor | None = None) -> Tensor:
        """The vector added to the time embedding; rows where ``drop`` is True use the null embedding."""
        feat = self.feat_norm(feat.float())
        if drop is not None:
            feat = torch.where(drop[:, None], self.null_feat.to(feat.dtype).expand_as(feat), feat)
        return self.cond_proj(feat)

    def forward(self, x_t: Tensor, t: Tensor, feat: Tensor, drop: Tensor | None = None) -> Tensor:
        cond = self.condition(feat, drop)
        if drop is None:  # keep the null embedding in the graph so DDP sees a gradient for every parameter
            cond = cond + 0.0 * self.null_feat.sum()
        return self.unet(x_t, t, class_labels=cond.to(x_t.dtype)).sample


def build_decoder(cfg: ModelConfig, cond_dim: int) -> RCDMDecoder:
    return RCDMDecoder(cfg, cond_dim)
