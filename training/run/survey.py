"""What the planner reads off the data before planning: how many images, their size, colours, detail and
background levels.

Nothing here is random or timed: every process of a ``torchrun`` job surveys the same seeded sample and plans the
same run (``training/run/plan.py``).

**Detail** is the side the images' content needs, which can be far below their pixel size: scikit-learn's 8 x 8
digits resampled to 32 px are 32-px files holding 8 px of detail. It is measured as the smallest side a sampled
image can be shrunk to (by a whole or half factor, bicubic) and grown back from while keeping all but
``DETAIL_TOLERANCE`` of its variance, and the median over a few sampled images is kept (per image, so a folder
mixing sizes reads as its typical image). Measured: the 32-px digits 8 px (they keep 97.8 % of their variance
through 8 px), Fashion-MNIST 28 px (it loses 7 % at the first step down, 28 -> 19 px), the rendered glyphs, a third
of them 16-px glyphs resized to 28 px, 19 or 28 px depending on the files sampled.

**Background levels**: the grey of each sampled image's border (its outer ``BORDER_PX`` ring), kept when the ring
is flat (a plain background, not a photograph's edge), and their spread over the folder: the standard deviation
of those levels in grey levels (0-255). Fashion-MNIST: 0 (always black); the rendered glyphs 11 (backgrounds drawn
from 0-40); scikit-learn's digits: not read (their ink reaches the border). A folder whose plain backgrounds
differ from image to image hands the encoder a feature that two views of one image share and that says nothing of
what the image shows; on the glyphs the trained CLS token sorted images by it (docs/results-notes.md).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import numpy as np
from PIL import Image

from msn_core.sources import FILE_SOURCES, list_images

__all__ = ["DataSurvey", "background_spread", "detail_side", "survey_data"]

SAMPLED_FILES, STATS_FILES = 256, 64
DETAIL_FACTORS = (1.5, 2, 3, 4, 6, 8)  # the steps down tried, in order
DETAIL_TOLERANCE = 0.03  # share of the images' variance a round trip may lose and still count as holding the detail
DETAIL_MAX_SIDE = 128  # larger images are taken at their size: the rule it feeds only concerns small images
BORDER_PX = 2  # the ring read as an image's background
FLAT_BORDER = 6.0  # grey levels: a ring whose interquartile range is at most this is a plain background
MIN_FLAT_SHARE = 0.5  # the levels' spread is only read when at least this share of the sampled images has one


@dataclass(frozen=True)
class DataSurvey:
    """What the planner knows of the data: how many images, their typical size, and (for files) their colours and
    the side their detail needs."""

    description: str
    num_images: int
    side: int  # median shorter side, pixels
    in_memory: bool
    mean: list[float] | None = None  # per-channel statistics of a sample, in [0, 1]; None: the source's own
    std: list[float] | None = None
    detail: int | None = None  # the side the content needs (``detail_side``); None: not measured, ``side``
    background_spread: float | None = None  # std of plain backgrounds' grey levels (0-255); None: not measured

    @property
    def detail_side(self) -> int:
        return self.detail or self.side


def survey_data(source: str, root: str | None, *, image_root: str | None = None, subset: str | None = None,
                synthetic_size: int = 512, synthetic_side: int = 32) -> DataSurvey:
    """Count the images and read the sizes of a seeded sample of them (headers only) and the colours and detail of
    a few."""
    if source == "fashion-mnist":
        from training.data import FashionMNIST

        images = FashionMNIST(root).images
        return DataSurvey(f"Fashion-MNIST ({len(images):,} images)", len(images), int(images.shape[-1]), True)
    if source == "synthetic":
        return DataSurvey(f"synthetic ({synthetic_size} images)", synthetic_size, synthetic_side, True)
    if source not in FILE_SOURCES or root is None:
        raise ValueError(f"cannot plan for data.source={source!r} without data.root")
    listing = list_images(source, root, split="train", image_root=image_root, subset=subset)
    rng = random.Random(0)
    sample = sorted(rng.sample(range(len(listing.files)), min(SAMPLED_FILES, len(listing.files))))
    sides = []
    for i in sample:
        try:
            with Image.open(listing.files[i]) as image:
                sides.append(min(image.size))
        except (OSError, ValueError):  # unreadable files are skipped in training too
            continue
    if not sides:
        raise ValueError(f"none of the {len(sample)} sampled files under {listing.base} could be opened as an image")
    few = [listing.files[i] for i in sample[:: max(1, len(sample) // STATS_FILES)]]
    mean, std = _colour_statistics(few)
    side = int(statistics.median(sides))
    grey = _grey_images(few, side)
    return DataSurvey(listing.describe(), len(listing.files), side, False, mean, std,
                      detail_side(grey) if grey and side <= DETAIL_MAX_SIDE else None, background_spread(grey))


def _colour_statistics(files: list[str]) -> tuple[list[float] | None, list[float] | None]:
    """Per-channel mean and std over a few images, decoded small (as training decodes them: RGB, composited)."""
    from training.data import load_image

    pixels = []
    for path in files:
        try:
            pixels.append(np.asarray(load_image(path, 32), dtype=np.float64).reshape(-1, 3) / 255.0)
        except Exception:  # noqa: BLE001, S112 - an unreadable file is skipped, as the loader does
            continue
    if not pixels:
        return None, None
    stacked = np.concatenate(pixels)
    return ([round(float(v), 4) for v in stacked.mean(0)],
            [round(max(float(v), 1e-3), 4) for v in stacked.std(0)])


def _grey_images(files: list[str], side: int) -> list[np.ndarray]:
    """A few files decoded as training decodes them (resized and centre-cropped to the side, at most
    ``DETAIL_MAX_SIDE``), in grey; unreadable ones skipped, as the loader does."""
    from training.data import load_image

    grey = []
    for path in files:
        try:
            grey.append(np.asarray(load_image(path, min(side, DETAIL_MAX_SIDE)).convert("L"), dtype=np.float32))
        except Exception:  # noqa: BLE001, S112 - an unreadable file is skipped, as the loader does
            continue
    return grey


def background_spread(images: list[np.ndarray]) -> float | None:
    """The standard deviation, in grey levels, of the border grey of the ``images`` whose border is flat; None
    when fewer than ``MIN_FLAT_SHARE`` of them have one (photographs: their edges are content)."""
    levels = []
    for image in images:
        ring = np.concatenate([image[:BORDER_PX].ravel(), image[-BORDER_PX:].ravel(),
                               image[BORDER_PX:-BORDER_PX, :BORDER_PX].ravel(),
                               image[BORDER_PX:-BORDER_PX, -BORDER_PX:].ravel()])
        low, high = np.percentile(ring, [25, 75])
        if high - low <= FLAT_BORDER:
            levels.append(float(np.median(ring)))
    if not images or len(levels) < MIN_FLAT_SHARE * len(images):
        return None
    return round(float(np.std(levels)), 1)


def detail_side(images: list[np.ndarray]) -> int:
    """The median over ``images`` (grey 2-D arrays of one size) of the smallest side (theirs divided by one of
    ``DETAIL_FACTORS``) that a bicubic shrink and regrow keeps all but ``DETAIL_TOLERANCE`` of an image's variance
    through; an image none does, or a flat one, keeps its side. Per image, so a folder that mixes sizes is read by
    its typical image rather than by a blend of them."""
    return int(statistics.median(_image_detail(image) for image in images))


def _image_detail(image: np.ndarray) -> int:
    side = image.shape[0]
    variance = float(((image - image.mean()) ** 2).sum())
    best = side
    for factor in DETAIL_FACTORS:
        small = max(2, round(side / factor))
        if small >= best or variance <= 0:
            continue
        if _round_trip_error(image, small) > DETAIL_TOLERANCE * variance:
            break  # coarser steps lose more
        best = small
    return best


def _round_trip_error(image: np.ndarray, small: int) -> float:
    h, w = image.shape
    pil = Image.fromarray(image.astype(np.float32), mode="F")
    back = np.asarray(pil.resize((small, small), Image.BICUBIC).resize((w, h), Image.BICUBIC), dtype=np.float64)
    return float(((image - back) ** 2).sum())
