"""msn_core.masks: every mask form, the kept-count rule, the pinned seeded RNG, padding, and readable errors."""

from __future__ import annotations

import numpy as np
import pytest

from msn_core.masks import (
    PAD,
    MaskError,
    check_keep,
    focal_keep,
    keep_from_bitmap,
    num_kept,
    pad_keep,
    random_keep,
    resolve_mask,
    resolve_masks,
)


def test_the_seeded_rng_is_pinned():
    """The definition documented in docs/serving.md; a numpy release that changed its stream would fail here."""
    assert resolve_mask({"ratio": 0.7, "seed": 1}, 7).tolist() == [3, 6, 9, 15, 16, 23, 24, 25, 27, 28, 30, 33, 37,
                                                                    48]
    assert random_keep(64, 0.7, 1).tolist() == np.sort(np.random.default_rng(1).permutation(64)[:19]).tolist()
    assert random_keep(16, 0.5, [1, 3]).tolist() == [0, 2, 3, 4, 8, 10, 13, 14]  # msn-eval's per-image seeds
    assert random_keep(16, 0.5, (1, 3)).tolist() == random_keep(16, 0.5, [1, 3]).tolist()
    assert random_keep(16, 0.0, 5).tolist() == list(range(16))
    unseeded = random_keep(64, 0.5)
    assert unseeded.size == 32 and np.all(np.diff(unseeded) > 0)


@pytest.mark.parametrize(("patches", "ratio", "kept"), [(196, 0.15, 166), (196, 0.0, 196), (100, 0.7, 30),
                                                         (16, 0.99, 1), (49, 0.5, 24)])
def test_num_kept_is_the_official_floor(patches: int, ratio: float, kept: int):
    assert num_kept(patches, ratio) == kept == random_keep(patches, ratio, 0).size


def test_mask_forms():
    g = 8
    assert np.array_equal(resolve_mask(None, g), np.arange(64))
    r1, r2 = resolve_mask({"ratio": 0.75, "seed": 3}, g), resolve_mask({"ratio": 0.75, "seed": 3}, g)
    assert r1.size == 16 and np.array_equal(r1, r2) and np.all(np.diff(r1) > 0) and r1.dtype == np.int64
    assert not np.array_equal(r1, resolve_mask({"ratio": 0.75, "seed": 4}, g))
    assert resolve_mask({"focal": {"size": 2}}, g).tolist() == [27, 28, 35, 36]
    assert resolve_mask({"focal": {"size": [1, 3], "top": 0, "left": 5}}, g).tolist() == [5, 6, 7]
    assert resolve_mask({"keep_idx": [9, 3, 5]}, g).tolist() == [3, 5, 9]
    bm = [[0] * 8 for _ in range(8)]
    bm[0][1] = bm[7][7] = 1
    assert resolve_mask({"bitmap": bm}, g).tolist() == [1, 63]
    masks = resolve_masks([None, {"ratio": 0.5}], 2, g)
    assert [m.size for m in masks] == [64, 32]
    assert [m.size for m in resolve_masks({"focal": {"size": 3}}, 3, g)] == [9, 9, 9]


def test_focal_and_bitmap_helpers_on_rectangular_grids():
    assert focal_keep(4, 4, 2, 2).tolist() == [5, 6, 9, 10]  # centred
    assert focal_keep(3, 5, 2, 3, top=1, left=0).tolist() == [5, 6, 7, 10, 11, 12]
    assert focal_keep(3, 3, 3, 3).tolist() == list(range(9))
    bitmap = np.zeros((4, 5), dtype=bool)
    bitmap[1:3, 1:4] = True
    assert keep_from_bitmap(bitmap).tolist() == focal_keep(4, 5, 2, 3, top=1, left=1).tolist()
    assert keep_from_bitmap(np.array([[0, 1], [1, 0]])).tolist() == [1, 2]
    assert check_keep(np.array([7, 2], dtype=np.int32), 8).tolist() == [2, 7]


@pytest.mark.parametrize("spec, needle", [
    ({"ratio": 1.0}, "ratio"), ({"ratio": -0.1}, "ratio"), ({"ratio": "x"}, "ratio"), ({"ratio": True}, "ratio"),
    ({"ratio": float("nan")}, "ratio"), ({"ratio": 0.5, "seed": -1}, "seed"), ({"ratio": 0.5, "seed": []}, "seed"),
    ({"ratio": 0.5, "seed": [1, "a"]}, "seed"), ({"focal": {"size": 9}}, "8x8"),
    ({"focal": {"size": 2, "top": 7}}, "top"), ({"focal": {"size": 2, "left": -1}}, "left"),
    ({"focal": {"size": "big"}}, "focal.size"),
    ({"focal": {"size": 2, "x": 1}}, "unknown"), ({"focal": 3}, "focal"), ({"keep_idx": [64]}, "[0, 64)"),
    ({"keep_idx": [1, 1]}, "duplicate"), ({"keep_idx": []}, "keep_idx"), ({"keep_idx": [1.5]}, "keep_idx"),
    ({"keep_idx": [True]}, "keep_idx"), ({"bitmap": [[1] * 7] * 7}, "8x8"), ({"bitmap": [[1] * 8] * 7 + [[1]]}, "8x8"),
    ({"bitmap": [[0] * 8] * 8}, "keeps no"), ({"bitmap": [[2] * 8] * 8}, "0 (dropped)"),
    ({"bitmap": [[1.0] * 8] * 8}, "0 (dropped)"), ({"ratio": 0.5, "focal": {}}, "exactly one"), ({}, "exactly one"),
    ({"nope": 1}, "unknown"), ({"focal": {"size": 2}, "seed": 1}, "seed"), ([1], "object"), ("0.5", "object"),
])
def test_bad_masks_name_the_problem(spec, needle):
    with pytest.raises(MaskError) as e:
        resolve_mask(spec, 8)
    assert needle in str(e.value) and isinstance(e.value, ValueError)


def test_a_list_of_masks_needs_one_per_image_and_names_the_bad_one():
    with pytest.raises(MaskError, match="one entry per image"):
        resolve_masks([None], 2, 8)
    with pytest.raises(MaskError, match="image 1: mask.ratio"):
        resolve_masks([None, {"ratio": 2}], 2, 8)


def test_pad_keep_pads_with_minus_one():
    out = pad_keep([np.array([1, 2, 3]), np.array([5])])
    assert out.tolist() == [[1, 2, 3], [5, PAD, PAD]] and out.dtype == np.int64
    assert pad_keep([np.array([4])], width=3).tolist() == [[4, -1, -1]]
    with pytest.raises(ValueError, match="shorter"):
        pad_keep([np.arange(4)], width=2)
