"""Batched multi-view augmentation and the evaluation preprocessing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from training.data import IMAGENET_MEAN, IMAGENET_STD, SyntheticDataset
from training.views import (
    LEVELS_BLACK,
    LEVELS_WHITE,
    MultiViewAugment,
    blur_kernel_size,
    eval_transform,
    random_levels,
    random_stroke,
)

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def _augment(**overrides) -> MultiViewAugment:
    kwargs = {"rand_size": 24, "focal_size": 12, "num_focal": 3, "mean": MEAN, "std": STD}
    return MultiViewAugment(**(kwargs | overrides))


def _constant_images(values: list[tuple[int, int, int]], size: int = 32) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)[:, :, None, None].expand(-1, -1, size, size).contiguous()


def _synthetic_batch(n: int = 8, size: int = 32) -> torch.Tensor:
    ds = SyntheticDataset(n, num_classes=4, load_size=size)
    return torch.stack([ds[i].image for i in range(n)])


def test_shapes_and_dtype() -> None:
    target, anchor, focal = _augment()(_synthetic_batch(5))
    assert target.shape == anchor.shape == (5, 3, 24, 24)
    assert focal.shape == (15, 3, 12, 12)
    assert target.dtype == anchor.dtype == focal.dtype == torch.float32
    _, _, none = _augment(num_focal=0)(_synthetic_batch(2))
    assert none.shape == (0, 3, 12, 12)


def test_plain_views_are_exactly_normalised_and_focal_is_view_major() -> None:
    """Without colour changes a crop of a constant image is that constant, so every view reveals its source."""
    values = [(0, 0, 0), (255, 255, 255), (51, 102, 204), (200, 10, 90)]
    plain = _augment(color_jitter_strength=0.0, grayscale_p=0.0, blur_p=0.0)
    target, anchor, focal = plain(_constant_images(values))
    mean, std = torch.tensor(MEAN)[:, None], torch.tensor(STD)[:, None]
    expected = (torch.tensor(values, dtype=torch.float32).T / 255 - mean) / std  # (3, B)
    for views, repeats in ((target, 1), (anchor, 1), (focal, 3)):
        per_view = views.flatten(2)  # (repeats*B, 3, pixels)
        assert torch.allclose(per_view, expected.T.repeat(repeats, 1)[:, :, None].expand_as(per_view), atol=1e-5)


def test_default_views_have_roughly_standard_statistics() -> None:
    images = _synthetic_batch(16)
    pixels = images.float().div(255).transpose(0, 1).flatten(1)
    augment = _augment(rand_size=32, mean=tuple(pixels.mean(1).tolist()), std=tuple(pixels.std(1).tolist()))
    torch.manual_seed(0)
    target, _, _ = augment(images)
    assert target.mean().abs() < 0.5
    assert 0.5 < target.std() < 1.5


def test_same_rng_state_gives_the_same_views() -> None:
    augment, images = _augment(), _synthetic_batch(4)
    torch.manual_seed(123)
    first = augment(images)
    state = torch.get_rng_state()
    after = augment(images)
    torch.set_rng_state(state)
    replayed = augment(images)
    torch.manual_seed(123)
    again = augment(images)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(after, replayed))
    assert not torch.equal(first[0], after[0])


def test_views_are_independent_per_sample_and_per_view() -> None:
    images = _synthetic_batch(1).expand(6, -1, -1, -1).contiguous()  # six copies of one image
    torch.manual_seed(0)
    target, anchor, focal = _augment()(images)
    assert not torch.equal(target, anchor)
    assert all(not torch.equal(target[0], target[i]) for i in range(1, 6))
    assert all(not torch.allclose(target[i], anchor[i]) for i in range(6))
    assert not torch.equal(focal[:6], focal[6:12])


def _glyphs(background: float, ink: float, n: int = 64) -> torch.Tensor:
    """n copies of a plus sign of grey ``ink`` on ``background``, floats in [0, 1]."""
    images = torch.full((n, 3, 16, 16), background)
    images[:, :, 7:9, 3:13] = ink
    images[:, :, 3:13, 7:9] = ink
    return images


def test_levels_redraw_the_darkest_and_lightest_grey_whatever_they_were() -> None:
    torch.manual_seed(0)
    dark, grey = random_levels(_glyphs(0.0, 1.0), 1.0), random_levels(_glyphs(0.15, 0.7), 1.0)
    for out in (dark, grey):
        low, high = out.amin(dim=(1, 2, 3)), out.amax(dim=(1, 2, 3))
        assert ((low >= LEVELS_BLACK[0]) & (low <= LEVELS_BLACK[1])).all()
        assert ((high >= LEVELS_WHITE[0]) & (high <= LEVELS_WHITE[1])).all()
        assert low.std() > 0.05  # drawn per image
    # the source's levels no longer tell two folders' images apart: both background distributions are the same
    assert abs(dark.amin(dim=(1, 2, 3)).mean() - grey.amin(dim=(1, 2, 3)).mean()) < 0.04
    shape = _glyphs(0.0, 1.0)[0, 0] > 0.5
    assert torch.equal(dark[0, 0] > dark[0, 0].mean(), shape)  # a linear map: the glyph is untouched
    flat = torch.full((2, 3, 8, 8), 0.3)
    assert torch.equal(random_levels(flat, 1.0), flat) and torch.equal(random_levels(_glyphs(0.1, 0.9), 0.0),
                                                                        _glyphs(0.1, 0.9))


def test_stroke_jitter_thickens_or_thins_and_keeps_the_glyph_centred() -> None:
    torch.manual_seed(0)
    images = _glyphs(0.0, 1.0, 200)
    ink = random_stroke(images, 1.0).sum(dim=(1, 2, 3))
    base = images[0].sum()
    assert (ink > base * 1.05).sum() > 40 and (ink < base * 0.95).sum() > 40  # about half each way
    assert torch.equal(random_stroke(images, 0.0), images)
    out = random_stroke(images, 1.0)
    assert out.min() >= 0 and out.max() <= 1
    grid = torch.arange(16.0)
    weight = out[:, 0].sum(dim=(1, 2))
    centre_y = (out[:, 0].sum(2) * grid).sum(1) / weight
    centre_x = (out[:, 0].sum(1) * grid).sum(1) / weight
    assert torch.allclose(centre_y, torch.full((200,), 7.5)) and torch.allclose(centre_x, torch.full((200,), 7.5))


def test_shape_and_level_knobs_run_in_the_views() -> None:
    images = _synthetic_batch(4)
    torch.manual_seed(0)
    augment = _augment(levels_p=1.0, affine=(1.0, 15.0, 15.0), stroke_p=1.0)
    target, anchor, focal = augment(images)
    assert target.shape == (4, 3, 24, 24) and focal.shape == (12, 3, 12, 12)
    assert torch.isfinite(target).all() and not torch.allclose(target, anchor)
    torch.manual_seed(0)  # every draw from the CPU generator: a restored state replays the views (resume)
    assert all(torch.equal(a, b) for a, b in zip(augment(images), (target, anchor, focal)))


def test_blur_kernel_is_odd_and_scales_with_the_view() -> None:
    assert [blur_kernel_size(s) for s in (16, 28, 96, 224)] == [3, 3, 11, 23]


def test_rejects_float_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        _augment()(torch.zeros(2, 3, 32, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_views_match_shapes_and_stay_on_device() -> None:
    target, _, focal = _augment()(_synthetic_batch(4).cuda())
    assert target.is_cuda and focal.is_cuda and focal.shape == (12, 3, 12, 12)


def test_eval_transform_matches_pillow() -> None:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, size=(9, 13, 3), dtype=np.uint8)
    photo = np.array(Image.fromarray(small).resize((70, 50), Image.Resampling.BILINEAR))  # smooth 70x50 RGB
    resize, crop = 40, 32
    reference = Image.fromarray(photo).resize((56, 40), Image.Resampling.BICUBIC)  # round(70 * 40 / 50) = 56
    left, top = (56 - crop) // 2, (40 - crop) // 2
    reference = np.asarray(reference.crop((left, top, left + crop, top + crop)), dtype=np.float32) / 255
    expected = (torch.from_numpy(reference).permute(2, 0, 1) - torch.tensor(IMAGENET_MEAN)[:, None, None]) / (
        torch.tensor(IMAGENET_STD)[:, None, None])
    batch = torch.from_numpy(photo).permute(2, 0, 1)[None]
    out = eval_transform(batch, resize=resize, crop=crop, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    assert out.shape == (1, 3, crop, crop)
    grey_levels = ((out[0] - expected) * torch.tensor(IMAGENET_STD)[:, None, None] * 255).abs()
    assert grey_levels.max() <= 1.0 + 1e-4
    with pytest.raises(ValueError, match="larger than"):
        eval_transform(batch, resize=24, crop=32, mean=IMAGENET_MEAN, std=IMAGENET_STD)
