"""The torch side of masking: pretraining's random masks and the -1 padding of the bundle contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from msn_core.masks import num_kept
from training.masking import as_keep_tensor, encoder_keep_args, random_keep_idx, split_padding


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


def test_padding_splits_into_gather_indices_and_key_mask() -> None:
    keep = torch.tensor([[3, 5, 7], [2, -1, -1]])
    gather_idx, keep_mask = split_padding(keep)
    assert gather_idx.tolist() == [[3, 5, 7], [2, 0, 0]]
    assert keep_mask.tolist() == [[True, True, True], [True, False, False]]
    assert encoder_keep_args(keep[:1])[1] is None  # nothing padded: the encoder's unmasked attention
    assert torch.equal(encoder_keep_args(keep)[1], keep_mask)
    assert as_keep_tensor(np.array([1, 4]), 3).tolist() == [[1, 4]] * 3
    with pytest.raises(ValueError, match=r"\(2, K\)"):
        as_keep_tensor(torch.zeros(3, 2, dtype=torch.int64), 2)
