"""Reading a frozen feature out of the encoder, by name (:mod:`msn_core.features` says what each name means).

One function serves export (the ONNX graph), evaluation (the torch embedder) and the visualizer, so the feature a
bundle promises is computed the same way everywhere. Masked inputs come as ``keep_idx`` (B, K) with ``-1`` padding:
spatial features put each kept token back at its place on the patch grid; dropped and padded places stay zero.
"""
from __future__ import annotations

import torch
from torch import Tensor

from msn_core.features import FeatureSpec, check_feature
from training.model.vit import VisionTransformer


def feature_spec(encoder: VisionTransformer, name: str) -> FeatureSpec:
    """The spec of ``name``, checked against this encoder's depth and patch grid."""
    return check_feature(name, depth=encoder.depth, grid=encoder.grid_size)


def read_feature(encoder: VisionTransformer, spec: FeatureSpec, images: Tensor, keep_idx: Tensor | None = None,
                 keep_mask: Tensor | None = None) -> Tensor:
    """The feature ``spec`` of ``images`` (B, C, H, W): (B, feature_dim).

    ``keep_idx`` (B, K): kept patches, row-major (``-1``: padding); ``keep_mask`` (B, K): False marks padding.
    Without ``keep_idx`` every patch is kept.
    """
    return read_features(encoder, [spec], images, keep_idx, keep_mask)[0]


def read_features(encoder: VisionTransformer, specs: list[FeatureSpec], images: Tensor,
                  keep_idx: Tensor | None = None, keep_mask: Tensor | None = None) -> list[Tensor]:
    """Several features of the same ``images`` from one forward pass (``read_feature`` for each spec)."""
    last = max(spec.n if spec.kind == "cls_last" else 1 for spec in specs)
    gather_idx = None if keep_idx is None else keep_idx.clamp(min=0)
    blocks = encoder.forward_blocks(images, gather_idx, keep_mask, last=last)
    return [_from_blocks(encoder, spec, blocks[-(spec.n if spec.kind == "cls_last" else 1):], images, keep_idx)
            for spec in specs]


def _from_blocks(encoder: VisionTransformer, spec: FeatureSpec, blocks: list[Tensor], images: Tensor,
                 keep_idx: Tensor | None) -> Tensor:
    if spec.kind == "cls":
        cls = blocks[-1][:, 0]
        return cls if spec.pre_norm else encoder.norm(cls)
    if spec.kind == "cls_last":
        return torch.cat([encoder.norm(tokens[:, 0]) for tokens in blocks], dim=-1)
    grid_h, grid_w = encoder.patch_grid(images.shape[-2], images.shape[-1])
    token_map, seen = _token_map(encoder.norm(blocks[-1][:, 1:]), keep_idx, grid_h * grid_w)
    if spec.kind == "patch_tokens":
        return token_map.flatten(1)
    if spec.kind == "cls_patch_tokens":  # equal energy: one CLS token scaled to the size of the whole map
        cls = encoder.norm(blocks[-1][:, 0]) * float(grid_h * grid_w) ** 0.5
        return torch.cat([cls, token_map.flatten(1)], dim=-1)
    return _pool(token_map, seen, grid_h, grid_w, spec.n).flatten(1)


def _token_map(tokens: Tensor, keep_idx: Tensor | None, num_patches: int) -> tuple[Tensor, Tensor]:
    """(B, N, D) tokens on the full grid, zero where no token was kept, and (B, N, 1) 1/0 for kept places."""
    batch, _, dim = tokens.shape
    if keep_idx is None:
        return tokens, tokens.new_ones(batch, num_patches, 1)
    # padding goes to an extra slot N, cut off afterwards: one scatter, no data-dependent shapes (ONNX-friendly)
    slots = torch.where(keep_idx < 0, torch.full_like(keep_idx, num_patches), keep_idx).unsqueeze(-1)
    token_map = tokens.new_zeros(batch, num_patches + 1, dim).scatter(1, slots.expand(-1, -1, dim), tokens)
    seen = tokens.new_zeros(batch, num_patches + 1, 1).scatter(1, slots, tokens.new_ones(slots.shape))
    return token_map[:, :num_patches], seen[:, :num_patches]


def _pool(token_map: Tensor, seen: Tensor, grid_h: int, grid_w: int, side: int) -> Tensor:
    """Average of the kept tokens in each cell of a ``side x side`` grid: (B, side*side, D); empty cells are zero."""
    batch = token_map.shape[0]
    cell_h, cell_w = grid_h // side, grid_w // side

    def cells(x: Tensor) -> Tensor:
        x = x.reshape(batch, side, cell_h, side, cell_w, x.shape[-1])
        return x.sum(dim=(2, 4)).reshape(batch, side * side, x.shape[-1])

    return cells(token_map) / cells(seen).clamp(min=1.0)
