"""MSN multi-view augmentation, batched on the training device with kornia, and the evaluation preprocessing.

Every view follows the official (SimCLR) recipe by default: RandomResizedCrop (ratio 3/4-4/3), horizontal flip,
colour jitter (0.8s, 0.8s, 0.8s, 0.2s) with p=0.8, grayscale with p=0.2, Gaussian blur with p=0.5 and sigma
U[0.1, 2.0] pixels, normalisation; optionally solarisation. Every probability and range is a knob
(``training.config.AugmentConfig``): the official values are sized for 224 px views, where a 2 px blur is mild;
on 28 px images it erases most of the detail. Random parameters are independent per sample and per view.

Off by default and not in the official recipe (docs/results-notes.md, the rendered glyphs): stroke jitter and
redrawn grey levels (``random_stroke``, ``random_levels``, applied to the whole image before the crop), and a
random rotation and shear (after the crop).

Each view group is one kornia call over a repeated batch (2B for target+anchor, ``num_focal``*B for the focal views),
so the cost is a handful of batched kernels whatever the batch size. Crops use ``cropping_mode="resample"`` (one
batched ``grid_sample``) instead of kornia's default slicing, which loops over samples in Python and syncs with the
host. Kornia draws its random parameters from torch's default CPU generator, and so do the two functions here;
saving and restoring ``torch.get_rng_state()`` reproduces the views exactly on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import kornia.augmentation as K
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from msn_core.preprocessing import resize_plan


def blur_kernel_size(view_size: int) -> int:
    """Odd Gaussian kernel of about 10 % of the view (SimCLR), at least 3."""
    size = max(3, round(0.1 * view_size))
    return size if size % 2 == 1 else size + 1


def _view_pipeline(size: int, crop_scale: Sequence[float], *, color_jitter_strength: float, color_jitter_p: float,
                   grayscale_p: float, blur_p: float, blur_sigma: Sequence[float], flip_p: float, solarize_p: float,
                   affine: tuple[float, float, float], mean: Sequence[float],
                   std: Sequence[float]) -> K.AugmentationSequential:
    s = color_jitter_strength
    steps: list[nn.Module] = [
        K.RandomResizedCrop((size, size), scale=tuple(crop_scale), ratio=(3 / 4, 4 / 3), cropping_mode="resample")
    ]
    affine_p, degrees, shear = affine
    if affine_p > 0:  # edges extended, so a light or dark background stays one level
        steps.append(K.RandomAffine(degrees, shear=(-shear, shear), padding_mode="border", p=affine_p))
    if flip_p > 0:
        steps.append(K.RandomHorizontalFlip(p=flip_p))
    if color_jitter_p > 0 and s > 0:
        steps.append(K.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s, p=color_jitter_p))
    if grayscale_p > 0:
        steps.append(K.RandomGrayscale(p=grayscale_p))
    if blur_p > 0:
        steps.append(K.RandomGaussianBlur(blur_kernel_size(size), tuple(blur_sigma), p=blur_p))
    if solarize_p > 0:
        steps.append(K.RandomSolarize(thresholds=0.0, additions=0.0, p=solarize_p))  # invert pixels >= 0.5
    steps.append(K.Normalize(mean=torch.tensor(mean), std=torch.tensor(std)))
    return K.AugmentationSequential(*steps)


class MultiViewAugment(nn.Module):
    """uint8 images -> (target, anchor, focal) normalised float32 views for one MSN step.

    ``target`` and ``anchor`` are independent ``rand_size`` crops of each image; ``focal`` holds ``num_focal`` small
    ``focal_size`` crops per image in view-major order: focal view ``j`` of image ``b`` is row ``j * B + b``, so
    ``focal.view(num_focal, B, ...)`` separates the views.
    """

    def __init__(self, *, rand_size: int, focal_size: int, num_focal: int,
                 rand_crop_scale: Sequence[float] = (0.3, 1.0), focal_crop_scale: Sequence[float] = (0.05, 0.3),
                 color_jitter_strength: float = 0.5, color_jitter_p: float = 0.8, grayscale_p: float = 0.2,
                 blur_p: float = 0.5, blur_sigma: Sequence[float] = (0.1, 2.0), flip_p: float = 0.5,
                 solarize_p: float = 0.0, levels_p: float = 0.0,
                 affine: tuple[float, float, float] = (0.0, 0.0, 0.0), stroke_p: float = 0.0,
                 mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if num_focal < 0:
            raise ValueError(f"num_focal must be >= 0, got {num_focal}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("mean and std need one value per RGB channel")
        pipeline = partial(_view_pipeline, color_jitter_strength=color_jitter_strength,
                           color_jitter_p=color_jitter_p, grayscale_p=grayscale_p, blur_p=blur_p,
                           blur_sigma=blur_sigma, flip_p=flip_p, solarize_p=solarize_p,
                           affine=affine, mean=mean, std=std)
        self.stroke_p, self.levels_p = stroke_p, levels_p
        self.num_focal = num_focal
        self.focal_size = focal_size
        self.rand_views = pipeline(rand_size, rand_crop_scale)
        self.focal_views = pipeline(focal_size, focal_crop_scale)

    @torch.no_grad()
    def forward(self, images_uint8: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(target (B,3,R,R), anchor (B,3,R,R), focal (num_focal*B,3,F,F) view-major), float32.

        Move the uint8 batch to the training device before calling: the views are built where the input lives.
        """
        if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4 or images_uint8.shape[1] != 3:
            raise ValueError(f"expected uint8 (B, 3, H, W) images, "
                             f"got {images_uint8.dtype} {tuple(images_uint8.shape)}")
        batch = images_uint8.shape[0]
        images = images_uint8.float().div_(255.0)
        target, anchor = self.rand_views(self._shape_and_levels(images.repeat(2, 1, 1, 1))).split(batch)
        if self.num_focal > 0:
            focal = self.focal_views(self._shape_and_levels(images.repeat(self.num_focal, 1, 1, 1)))
        else:
            focal = images.new_empty(0, 3, self.focal_size, self.focal_size)
        return target, anchor, focal

    def _shape_and_levels(self, images: Tensor) -> Tensor:
        return random_levels(random_stroke(images, self.stroke_p), self.levels_p)


def random_stroke(images: Tensor, p: float) -> Tensor:
    """Each image's strokes thickened (probability p/2) or thinned (p/2) by a random share of a 3 x 3 grey dilation
    or erosion: stroke width, which varies within a class of glyphs, stops being shared by two views."""
    if p <= 0:
        return images
    batch = images.shape[0]
    draw, amount = torch.rand(2, batch, 1, 1, 1).to(images.device)  # the CPU generator, as kornia's draws
    thick = F.max_pool2d(images, 3, stride=1, padding=1)
    thin = -F.max_pool2d(-images, 3, stride=1, padding=1)
    target = torch.where(draw < p / 2, thick, torch.where(draw < p, thin, images))
    return images + amount * (target - images)


LEVELS_BLACK, LEVELS_WHITE = (0.0, 0.25), (0.6, 1.0)  # where a view's darkest and lightest grey are redrawn


def random_levels(images: Tensor, p: float) -> Tensor:
    """With probability p, each image's darkest grey moved to a random level in ``LEVELS_BLACK`` and its lightest to
    one in ``LEVELS_WHITE`` (a linear map): a folder whose images differ in background and ink level (scans,
    renderings, exposures) then gives two views of one image unrelated levels, which colour jitter does not (its
    brightness multiplies, so a black background stays black and a grey one grey)."""
    if p <= 0:
        return images
    batch = images.shape[0]
    flat = images.reshape(batch, -1)
    low, high = flat.amin(1).view(-1, 1, 1, 1), flat.amax(1).view(-1, 1, 1, 1)

    def draw(lo_hi: tuple[float, float]) -> Tensor:  # the CPU generator, as kornia's draws
        return torch.empty(batch, 1, 1, 1).uniform_(*lo_hi).to(images.device)

    black, white = draw(LEVELS_BLACK), draw(LEVELS_WHITE)
    relevelled = black + (white - black) * (images - low) / (high - low).clamp(min=1e-3)
    apply = torch.rand(batch, 1, 1, 1).to(images.device) < p
    return torch.where(apply & (high > low), relevelled, images)


def eval_transform(images_uint8: Tensor, *, resize: int, crop: int, mean: Sequence[float],
                   std: Sequence[float]) -> Tensor:
    """Evaluation / export preprocessing (:mod:`msn_core.preprocessing`, the bundle's contract) on a batch of uint8
    images, on the device they are on: resize the shorter side, centre-crop, normalise.

    Matches the Pillow pipeline that serving runs (:func:`msn_core.preprocessing.transform_image`), to within one
    grey level before normalisation:

    1. the geometry is :func:`msn_core.preprocessing.resize_plan`'s (rounded new size, floored crop offset);
    2. torch's antialiased bicubic is Pillow's filter (a = -0.5 with support scaled on downsampling); the result is
       rounded to uint8 as Pillow does;
    3. ``(x / 255 - mean) / std``.
    """
    if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4:
        raise ValueError(f"expected uint8 (B, C, H, W) images, got {images_uint8.dtype} {tuple(images_uint8.shape)}")
    height, width = images_uint8.shape[-2:]
    plan = resize_plan(height, width, resize, crop)
    x = images_uint8.float()
    if (plan.height, plan.width) != (height, width):
        x = F.interpolate(x, size=(plan.height, plan.width), mode="bicubic", align_corners=False, antialias=True)
        x = x.round_().clamp_(0, 255)
    x = x[..., plan.top : plan.top + crop, plan.left : plan.left + crop].div_(255.0)
    mean_t = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return ((x - mean_t) / std_t).contiguous()
