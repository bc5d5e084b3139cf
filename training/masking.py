"""Patch masks as kept-patch indices, generated outside the model.

A mask is the ``keep_idx`` the encoder and the exported ONNX graph take: int64 indices of the kept patches in
row-major patch order, sorted ascending (the CLS token is always kept and is not counted). Dropped patches are
removed rather than replaced by a mask token, as in the official MSN. Masks are made here, not inside the model,
so that an exported graph does not freeze one ``randperm`` and so that training controls the RNG.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def num_kept(num_patches: int, mask_ratio: float) -> int:
    """Patches kept at ``mask_ratio``: ``floor(N * (1 - ratio))`` as in the official code, and at least one."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    if num_patches < 1:
        raise ValueError(f"num_patches must be positive, got {num_patches}")
    return max(1, int(num_patches * (1.0 - mask_ratio)))


def random_keep_idx(batch_size: int, num_patches: int, mask_ratio: float, *, shared: bool = True,
                    generator: torch.Generator | None = None, device: torch.device | str | None = None) -> Tensor:
    """Random ``(B, K)`` kept-patch indices, sorted ascending.

    ``shared=True`` draws one permutation for the whole batch, as the official MSN does (every image loses the same
    patches); ``shared=False`` draws an independent mask per sample. The indices are drawn on ``generator``'s
    device (CPU by default) and then moved to ``device``.
    """
    keep = num_kept(num_patches, mask_ratio)
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    draw_device = generator.device if generator is not None else torch.device("cpu")
    if keep == num_patches:
        idx = torch.arange(num_patches).expand(batch_size, -1)
    elif shared:
        idx = torch.randperm(num_patches, generator=generator, device=draw_device)[:keep].sort().values.expand(batch_size, -1)
    else:
        noise = torch.rand(batch_size, num_patches, generator=generator, device=draw_device)
        idx = noise.argsort(dim=1)[:, :keep].sort(dim=1).values
    return idx.to(device=device, dtype=torch.int64).contiguous()


def focal_keep_idx(grid_h: int, grid_w: int, block_h: int, block_w: int, top: int | None = None,
                   left: int | None = None) -> Tensor:
    """``(block_h * block_w,)`` indices of a rectangular block of the patch grid, centred unless placed.

    This is the "focal mask" for evaluation and serving: encode only a region of the image at its real position.
    """
    if not (1 <= block_h <= grid_h and 1 <= block_w <= grid_w):
        raise ValueError(f"block {block_h}x{block_w} does not fit in the {grid_h}x{grid_w} patch grid")
    top = (grid_h - block_h) // 2 if top is None else top
    left = (grid_w - block_w) // 2 if left is None else left
    if not (0 <= top <= grid_h - block_h and 0 <= left <= grid_w - block_w):
        raise ValueError(f"block {block_h}x{block_w} at ({top}, {left}) leaves the {grid_h}x{grid_w} patch grid")
    rows = torch.arange(top, top + block_h)
    cols = torch.arange(left, left + block_w)
    return (rows[:, None] * grid_w + cols[None, :]).flatten()


def keep_idx_from_bitmap(bitmap: Tensor | np.ndarray) -> Tensor:
    """``(K,)`` row-major indices of the True cells of a ``(grid_h, grid_w)`` keep bitmap."""
    keep = torch.as_tensor(np.asarray(bitmap) if not isinstance(bitmap, Tensor) else bitmap)
    if keep.dim() != 2:
        raise ValueError(f"bitmap must be 2-D (grid_h, grid_w), got shape {tuple(keep.shape)}")
    if keep.dtype != torch.bool:
        if not ((keep == 0) | (keep == 1)).all():
            raise ValueError("bitmap must be boolean or hold only 0 and 1")
        keep = keep.bool()
    idx = keep.flatten().nonzero().flatten()
    if idx.numel() == 0:
        raise ValueError("bitmap keeps no patch; at least one is needed")
    return idx.to(torch.int64)
