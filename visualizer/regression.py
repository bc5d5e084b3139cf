"""A plain regression decoder: the same feature to one image by MSE, the decoder harness's faithful, blurry reference.

``model.kind: regression`` trains it with everything else of a decoder run unchanged (data, masked conditioning,
EMA, checkpoints, the quality figure, the app), so it sees exactly what the diffusion decoder sees. The network: a
LayerNorm on the feature (``model.cond_norm``), one linear layer to the coarsest level of ``model.block_out_channels``
(``image_size / 2**(levels - 1)`` px), then per level ``model.layers_per_block`` residual blocks of two 3 x 3
convolutions and a nearest-neighbour upsampling, and a 3 x 3 convolution to the image's channels. The loss is the MSE
to the decoder's target; "sampling" returns that one output whatever the seed or the guidance, so its seed spread is
0 and its samples are the conditional mean of the images that share the feature: all the feature pins down, and
nothing invented.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from visualizer.config import DiffusionConfig, ModelConfig

__all__ = ["Regression", "RegressionDecoder"]


class _Block(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, groups: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, ch_in), nn.Conv2d(ch_in, ch_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, ch_out), nn.Conv2d(ch_out, ch_out, 3, padding=1)
        self.skip = nn.Conv2d(ch_in, ch_out, 1) if ch_in != ch_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class RegressionDecoder(nn.Module):
    """``forward(feat) -> (B, channels, S, S)``: the image the feature regresses to (targets are in [-1, 1])."""

    def __init__(self, cfg: ModelConfig, cond_dim: int) -> None:
        super().__init__()
        self.image_size, self.channels, self.cond_dim = cfg.image_size, cfg.channels, cond_dim
        widths = list(reversed(cfg.block_out_channels))  # the coarsest level first
        self.base = cfg.image_size // 2 ** (len(widths) - 1)
        self.feat_norm = nn.LayerNorm(cond_dim, elementwise_affine=False) if cfg.cond_norm else nn.Identity()
        self.proj = nn.Linear(cond_dim, widths[0] * self.base * self.base)
        self.levels = nn.ModuleList()
        for i, width in enumerate(widths):
            out = widths[min(i + 1, len(widths) - 1)]
            blocks = [_Block(width, width, cfg.norm_num_groups) for _ in range(cfg.layers_per_block - 1)]
            self.levels.append(nn.Sequential(*blocks, _Block(width, out, cfg.norm_num_groups)))
        self.out = nn.Sequential(nn.GroupNorm(cfg.norm_num_groups, widths[-1]), nn.SiLU(),
                                 nn.Conv2d(widths[-1], cfg.channels, 3, padding=1))

    def forward(self, feat: Tensor) -> Tensor:
        x = self.proj(self.feat_norm(feat.float())).reshape(feat.shape[0], -1, self.base, self.base)
        for i, level in enumerate(self.levels):
            x = level(x)
            if i < len(self.levels) - 1:
                x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.out(x)


class Regression:
    """The regression decoder's objective, with :class:`visualizer.diffusion.Diffusion`'s ``loss`` and ``sample``
    signatures so that training, the pipeline and the harness take either."""

    learn_sigma = False

    def __init__(self, cfg: DiffusionConfig) -> None:
        self.cfg = cfg

    def loss(self, model: nn.Module, x0: Tensor, feat: Tensor, drop: Tensor | None = None) -> tuple[Tensor, dict]:
        if drop is not None and bool(drop.any()):
            raise ValueError("a regression decoder has no unconditional branch: train it with cond_drop_prob 0")
        mse = F.mse_loss(model(feat).float(), x0)
        return mse, {"mse": mse.item()}

    @torch.no_grad()
    def sample(self, model: nn.Module, feat: Tensor, *, image_size: int, steps: int | None = None,
               sampler: str | None = None, guidance_scale: float | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        """The one output per row of ``feat``, in [-1, 1], as (B, 3, S, S) (grey repeated); the seed, the sampler
        and the step count change nothing, guidance other than 1 is refused."""
        if guidance_scale not in (None, 1.0):
            raise ValueError(f"guidance scale {guidance_scale:g}: a regression decoder has one output; use 1")
        out = model(feat).float().clamp(-1.0, 1.0)
        if out.shape[-1] != image_size:
            out = F.interpolate(out, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return out.expand(-1, 3, -1, -1)
