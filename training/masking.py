"""The torch side of masking: pretraining's random masks on a torch generator, and -1 padding -> key-padding mask.

A mask is ``keep_idx``, the sorted row-major indices of kept patches (the CLS token is always kept and not counted);
dropped patches are removed, as in the official MSN. Mask *specifications* (ratio + seed, focal block, explicit
indices, bitmap) and the kept-count rule live in :mod:`msn_core.masks`, shared with serving and the visualizer.
Pretraining draws its masks here from a ``torch.Generator`` instead, so that ``--resume`` restores the mask stream
with the rest of the RNG state. Masks are made outside the model, so an exported graph never freezes a ``randperm``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from msn_core.masks import MaskError, num_kept

__all__ = ["as_keep_tensor", "encoder_keep_args", "random_keep_idx", "split_padding"]


def random_keep_idx(batch_size: int, num_patches: int, mask_ratio: float, *, shared: bool = True,
                    generator: torch.Generator | None = None, device: torch.device | str | None = None) -> Tensor:
    """Random ``(B, K)`` kept-patch indices, sorted ascending, ``K = num_kept(num_patches, mask_ratio)``.

    ``shared=True`` draws one permutation for the whole batch, as the official MSN does (every image loses the same
    patches); ``shared=False`` draws an independent mask per sample. The indices are drawn on ``generator``'s
    device (CPU by default) and then moved to ``device``.
    """
    try:
        keep = num_kept(num_patches, mask_ratio)
    except MaskError as e:
        raise ValueError(f"mask_ratio must be in [0, 1) and num_patches positive ({e})") from None
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    draw_device = generator.device if generator is not None else torch.device("cpu")
    if keep == num_patches:
        idx = torch.arange(num_patches).expand(batch_size, -1)
    elif shared:
        drawn = torch.randperm(num_patches, generator=generator, device=draw_device)[:keep]
        idx = drawn.sort().values.expand(batch_size, -1)
    else:
        noise = torch.rand(batch_size, num_patches, generator=generator, device=draw_device)
        idx = noise.argsort(dim=1)[:, :keep].sort(dim=1).values
    return idx.to(device=device, dtype=torch.int64).contiguous()


def as_keep_tensor(keep_idx: Tensor | np.ndarray, batch_size: int) -> Tensor:
    """``(K,)`` or ``(B, K)`` kept indices (numpy or torch, ``-1`` padding allowed) as an int64 ``(B, K)`` tensor."""
    keep = torch.as_tensor(np.asarray(keep_idx) if not isinstance(keep_idx, Tensor) else keep_idx).to(torch.int64)
    if keep.dim() == 1:
        keep = keep.expand(batch_size, -1)
    if keep.dim() != 2 or keep.shape[0] != batch_size:
        raise ValueError(f"keep_idx must be (K,) or ({batch_size}, K), got {tuple(keep.shape)}")
    return keep


def split_padding(keep_idx: Tensor) -> tuple[Tensor, Tensor]:
    """``keep_idx`` with ``-1`` padding -> (gather indices, padding slots at patch 0; ``keep_mask``, False = pad).

    This is the bundle graph's first step (``msn_core.bundle``); the torch encoder takes the pair. Padded slots
    gather a real patch that no token attends to, so a padded row's CLS equals the unpadded row's.
    """
    keep_mask = keep_idx >= 0
    return keep_idx.clamp(min=0), keep_mask


def encoder_keep_args(keep_idx: Tensor) -> tuple[Tensor, Tensor | None]:
    """Eager :func:`split_padding` for the torch encoder: no key-padding mask when no slot is padded."""
    gather_idx, keep_mask = split_padding(keep_idx)
    return gather_idx, None if bool(keep_mask.all()) else keep_mask
