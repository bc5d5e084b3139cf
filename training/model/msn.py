"""The MSN networks: an online (anchor) encoder with its head and prototypes, and an EMA target copy.

Mirrors the official layout, where the projection head lives inside the encoder (`encoder.fc`) and the target
encoder is a deep copy of both, updated by EMA of the parameters only (BN buffers are not averaged).

BatchNorm buffers of the target (the head's and, with a conv stem, the stem's) belong to the target: it runs in
train mode, so its own no-grad forward passes on the unmasked target views update its running statistics, as in
the official code, where the target encoder is never put in eval mode and its buffers are never EMA'd. Those are
the statistics of the target weights on full target views, which is what the exported (eval-mode) target
encoder meets; the online statistics would mix in the 96 px focal crops and belong to other weights.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from training.config import ModelConfig
from training.model.heads import ProjectionHead, init_prototypes
from training.model.stem import resolve_conv_stem
from training.model.vit import ARCHS, CONV_STEM_ARCHS, VisionTransformer, build_encoder


class ProjectedEncoder(nn.Module):
    """ViT trunk followed by the projection head on the post-norm CLS token (official `forward_features`)."""

    def __init__(self, encoder: VisionTransformer, head: ProjectionHead):
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, images: Tensor, keep_idx: Tensor | None = None) -> Tensor:
        _, cls_post_norm = self.encoder(images, keep_idx)
        return self.head(cls_post_norm)


class MSNOnline(nn.Module):
    """The trained branch: embeds the masked anchor view and the focal views; owns the prototypes.

    Anchor and focal views run as separate forward passes (one per resolution), so the head's BatchNorm uses
    per-resolution statistics exactly as the official multi-crop forward does. The output is view-major:
    all images' anchor view, then all images' focal view 0, focal view 1, ...
    """

    def __init__(self, net: ProjectedEncoder, prototypes: nn.Parameter):
        super().__init__()
        self.net = net
        self.prototypes = prototypes

    def forward(
        self, anchor_views: Tensor, keep_idx: Tensor | None, focal_views: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        embeddings = [self.net(anchor_views, keep_idx)]
        if focal_views is not None and focal_views.shape[0] > 0:
            embeddings.append(self.net(focal_views))
        # Returning the prototypes through forward keeps DDP's gradient hooks on the module's own outputs.
        return torch.cat(embeddings), self.prototypes


def build_networks(cfg: ModelConfig) -> tuple[MSNOnline, ProjectedEncoder]:
    """Online network and its EMA target (a deep copy, no gradients, train mode: see the module docstring for
    its BatchNorm statistics). ``cfg.conv_stem`` swaps the patch projection for a conv stem."""
    overrides = {k: v for k in ("embed_dim", "depth", "num_heads") if (v := getattr(cfg, k)) is not None}
    if cfg.conv_stem or cfg.conv_stem_strides is not None or cfg.conv_stem_channels is not None:
        named = CONV_STEM_ARCHS.get(cfg.arch, {}).get("embed_dim") or ARCHS.get(cfg.arch, (None,))[0]
        embed_dim = overrides.get("embed_dim") or named
        if embed_dim is None:
            raise ValueError(f"unknown architecture {cfg.arch!r}; "
                             f"expected one of {', '.join([*ARCHS, *CONV_STEM_ARCHS])}")
        overrides["conv_stem_channels"], overrides["conv_stem_strides"] = resolve_conv_stem(
            embed_dim, cfg.patch_size, cfg.conv_stem_channels, cfg.conv_stem_strides)
    encoder = build_encoder(
        cfg.arch, cfg.patch_size, cfg.image_size, drop_path_rate=cfg.drop_path_rate, **overrides
    )
    head = ProjectionHead(encoder.embed_dim, cfg.head_hidden_dim, cfg.head_out_dim, use_bn=cfg.head_use_bn)
    online = MSNOnline(ProjectedEncoder(encoder, head), init_prototypes(cfg.num_prototypes, cfg.head_out_dim))
    target = copy.deepcopy(online.net)
    target.requires_grad_(False)
    return online, target


def parameter_groups(online: MSNOnline) -> list[dict]:
    """The official AdamW groups: decayed weights; biases/norm/BN/1-D params without decay; prototypes.

    Like the official code, ``cls_token`` and ``pos_embed`` (3-D) are weight-decayed. Groups flagged
    ``wd_exclude`` keep weight decay 0 when the schedule updates it.
    """
    decayed, not_decayed = [], []
    for name, param in online.net.named_parameters():
        if not param.requires_grad:
            continue
        if "bias" in name or ".bn" in name or param.ndim == 1:
            not_decayed.append(param)
        else:
            decayed.append(param)
    return [
        {"params": decayed, "wd_exclude": False},
        {"params": not_decayed, "wd_exclude": True, "weight_decay": 0.0},
        {"params": [online.prototypes], "wd_exclude": True, "weight_decay": 0.0},
    ]


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, momentum: float, *, copy_buffers: bool) -> None:
    """``ema = momentum * ema + (1 - momentum) * model`` over parameters; buffers by an explicit policy.

    ``copy_buffers=False`` leaves the EMA copy's buffers alone: MSN's target runs its BatchNorms in train mode
    (batch statistics), and the official code averages parameters only. A conv stem's running statistics are
    read once the target is exported (eval mode); they stay the target's own, kept by its forward passes on the
    full target views, rather than copies of the online ones, which also average the focal crops and belong to
    other weights. ``copy_buffers=True`` copies them from ``model``, for an EMA that is evaluated (the RCDM decoder).
    """
    ema_params = list(ema.parameters())
    model_params = [p.detach() for p in model.parameters()]
    if len(ema_params) != len(model_params):
        raise ValueError(f"EMA copy has {len(ema_params)} parameters, the model {len(model_params)}")
    torch._foreach_mul_(ema_params, momentum)
    torch._foreach_add_(ema_params, model_params, alpha=1.0 - momentum)
    if copy_buffers:
        for ema_buffer, buffer in zip(ema.buffers(), model.buffers(), strict=True):
            ema_buffer.copy_(buffer)
