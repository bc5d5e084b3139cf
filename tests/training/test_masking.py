"""Kept-patch index generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.masking import focal_keep_idx, keep_idx_from_bitmap, num_kept, random_keep_idx


@pytest.mark.parametrize(("patches", "ratio", "kept"), [(196, 0.15, 166), (196, 0.0, 196), (100, 0.7, 30),
                                                         (16, 0.99, 1), (49, 0.5, 24)])
def test_num_kept_matches_the_official_floor(patches: int, ratio: float, kept: int) -> None:
    assert num_kept(patches, ratio) == kept
    assert random_keep_idx(2, patches, ratio).shape == (2, kept)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_invalid_ratio_is_rejected(ratio: float) -> None:
    with pytest.raises(ValueError, match="mask_ratio"):
        random_keep_idx(2, 16, ratio)


def test_shared_mask_is_one_permutation_for_the_batch() -> None:
    idx = random_keep_idx(5, 64, 0.6, generator=torch.Generator().manual_seed(0))
    assert idx.dtype == torch.int64 and idx.is_contiguous()
    assert (idx == idx[0]).all()
    assert torch.equal(idx[0], idx[0].sort().values) and idx[0].unique().numel() == idx.shape[1]
    assert idx.min() >= 0 and idx.max() < 64


def test_per_sample_masks_differ_and_are_sorted_and_unique() -> None:
    idx = random_keep_idx(8, 64, 0.6, shared=False, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (8, 25)
    assert torch.equal(idx, idx.sort(dim=1).values)
    assert all(row.unique().numel() == 25 for row in idx)
    assert len({tuple(row.tolist()) for row in idx}) == 8


def test_generator_makes_masks_reproducible() -> None:
    first = random_keep_idx(3, 49, 0.3, shared=False, generator=torch.Generator().manual_seed(4))
    again = random_keep_idx(3, 49, 0.3, shared=False, generator=torch.Generator().manual_seed(4))
    other = random_keep_idx(3, 49, 0.3, shared=False, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_zero_ratio_keeps_every_patch_in_order() -> None:
    assert torch.equal(random_keep_idx(2, 9, 0.0, shared=False), torch.arange(9).expand(2, 9))


def test_focal_block_indices() -> None:
    assert focal_keep_idx(4, 4, 2, 2).tolist() == [5, 6, 9, 10]  # centred
    assert focal_keep_idx(3, 5, 2, 3, top=1, left=0).tolist() == [5, 6, 7, 10, 11, 12]
    assert focal_keep_idx(3, 3, 3, 3).tolist() == list(range(9))
    with pytest.raises(ValueError, match="does not fit"):
        focal_keep_idx(3, 3, 4, 1)
    with pytest.raises(ValueError, match="leaves"):
        focal_keep_idx(4, 4, 2, 2, top=3)


def test_bitmap_round_trips_with_focal_block() -> None:
    bitmap = np.zeros((4, 5), dtype=bool)
    bitmap[1:3, 1:4] = True
    assert torch.equal(keep_idx_from_bitmap(bitmap), focal_keep_idx(4, 5, 2, 3, top=1, left=1))
    assert keep_idx_from_bitmap(torch.tensor([[0, 1], [1, 0]])).tolist() == [1, 2]
    with pytest.raises(ValueError, match="no patch"):
        keep_idx_from_bitmap(np.zeros((2, 2), dtype=bool))
    with pytest.raises(ValueError, match="2-D"):
        keep_idx_from_bitmap(np.ones(4, dtype=bool))
