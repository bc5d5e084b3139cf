"""What the planner reads off the data before planning: how many images, their size, colours, detail and
background levels.

Nothing here is random or timed: every process of a ``torchrun`` job surveys the same seeded sample and plans the
same run (``training/run/plan.py``).

**Detail** is the side the images' content needs, which can be far below their pixel size: scikit-learn's 8 x 8
digits resampled to 32 px are 32-px files holding 8 px of detail. How a file was made changes what shows, so each
sampled image is read three ways and its detail is the smallest reading; the folder's is the median over a few
sampled images (per image, so a folder mixing sizes reads as its typical image):

- **round trip**: the smallest side the image can be shrunk to (by a whole or half factor, bicubic) and grown back
  from while keeping all but ``DETAIL_TOLERANCE`` of its variance. Smoothly resampled digits read 9 px at 28 px;
  Fashion-MNIST 28 (it loses 7 % at the first step down, 28 -> 19 px).
- **pixel grid**: an image enlarged by pixel replication (nearest or box resampling) has sharp block edges no
  round trip keeps (the 8-px digits at 28 px read 28 that way), but it repeats rows and columns: its side times
  the share of its rows (or columns) with content that differ from the row before is the side it was enlarged
  from (8 for those digits).
- **strokes**: where the ink (pixels more than halfway from the border's grey to the brightest) covers at most
  ``SPARSE_INK`` of the image, the side at which its strokes would be ``STROKE_PX`` wide: side x ``STROKE_PX`` /
  stroke width, the width read as twice the ink's area over its perimeter. Sharp, near-binary strokes (MNIST's
  make-up: a binary digit anti-aliased into 28 px) read 28 px in the other two ways whatever the shape they draw;
  thick strokes say the shape is coarse. The handwritten 28-px form of the digits (strokes 3.0 px) reads 12 px,
  the rendered glyphs (2.2 px) 16; ``STROKE_PX`` sits between them (docs/results-notes.md, "Which 28-px digit
  folders read as low-detail").

Measured (``python -m benchmarks.training.digit_forms``): every 28-px form of the digits 8-12 px, Fashion-MNIST
28 px (round trip), the rendered glyphs (16/28/32 px mixed, read at 28) 16 (strokes; 19 by the round trip).

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
from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image

from msn_core.sources import FILE_SOURCES, list_images

__all__ = ["LOW_DETAIL", "DataSurvey", "background_spread", "detail_reading", "detail_side", "image_detail",
           "stroke_width", "survey_data"]

SAMPLED_FILES, STATS_FILES = 256, 64
DETAIL_FACTORS = (1.5, 2, 3, 4, 6, 8)  # the steps down tried, in order
DETAIL_TOLERANCE = 0.03  # share of the images' variance a round trip may lose and still count as holding the detail
DETAIL_MAX_SIDE = 128  # larger images are taken at their size: the rule it feeds only concerns small images
GRID_TOLERANCE = 1.0  # grey levels: neighbouring rows this close count as one replicated row
SPARSE_INK = 0.25  # strokes are read only where the ink covers at most this share of the image
STROKE_PX = 1.25  # the strokes reading: the side at which the ink's strokes would be this wide (module docstring)
READINGS = ("round trip", "pixel grid", "strokes")
LOW_DETAIL = 14  # px: small images holding at most this much detail get views that keep most of them (plan.py)
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
    detail_reading: str | None = None  # which of ``READINGS`` gave ``detail``

    @property
    def detail_side(self) -> int:
        return self.detail or self.side

    @property
    def low_detail(self) -> bool:
        """The images hold at most ``LOW_DETAIL`` px of detail: the plan's easy views, the stall warning's advice.
        False when not measured (in-memory sources, images over ``DETAIL_MAX_SIDE``)."""
        return self.detail_side <= LOW_DETAIL

    def describe_detail(self) -> str:
        """What the plan's reason says was measured: "the images hold 12 px of detail at 28 px (strokes about 2.9 px
        wide)"; nothing in brackets for the round trip."""
        text = f"the images hold {self.detail_side} px of detail"
        if self.detail_side < self.side:
            text += f" at {self.side} px"
        if self.detail_reading == "pixel grid":
            text += " (enlarged by pixel replication)"
        elif self.detail_reading == "strokes":
            text += f" (strokes about {STROKE_PX * self.side / self.detail_side:.1f} px wide)"
        return text


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
    detail, reading = detail_reading(grey) if grey and side <= DETAIL_MAX_SIDE else (None, None)
    return DataSurvey(listing.describe(), len(listing.files), side, False, mean, std, detail,
                      background_spread(grey), reading)


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
        ring = _ring(image)
        low, high = np.percentile(ring, [25, 75])
        if high - low <= FLAT_BORDER:
            levels.append(float(np.median(ring)))
    if not images or len(levels) < MIN_FLAT_SHARE * len(images):
        return None
    return round(float(np.std(levels)), 1)


def detail_side(images: list[np.ndarray]) -> int:
    """The median over ``images`` (grey 2-D arrays of one size) of each image's detail (``image_detail``). Per
    image, so a folder that mixes sizes is read by its typical image rather than by a blend of them."""
    return int(statistics.median(image_detail(image)[0] for image in images))


def detail_reading(images: list[np.ndarray]) -> tuple[int, str]:
    """``detail_side`` and the reading (one of ``READINGS``) that gave it on most of the images at or under the
    median: what the plan's reason names."""
    readings = [image_detail(image) for image in images]
    side = int(statistics.median(value for value, _ in readings))
    named = Counter(name for value, name in readings if value <= side)
    return side, max(READINGS, key=lambda name: named[name])  # ties: the first of READINGS


def image_detail(image: np.ndarray) -> tuple[int, str]:
    """The smallest of the three readings of one image's detail, and its name (module docstring)."""
    readings = [(_round_trip_detail(image), "round trip"), (_grid_detail(image), "pixel grid")]
    width = stroke_width(image)
    if width is not None:
        readings.append((min(image.shape[0], max(2, round(image.shape[0] * STROKE_PX / width))), "strokes"))
    return min(readings, key=lambda reading: reading[0])  # min keeps the first of equals: the round trip


def _round_trip_detail(image: np.ndarray) -> int:
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


def _grid_detail(image: np.ndarray) -> int:
    """The side the image was enlarged from by pixel replication (nearest or box resampling): its side times the
    share of its rows with content (or columns, whichever is larger) that differ from the row before (plain
    background rows repeat in any image: not counted)."""
    side, shares = image.shape[0], []
    for lines in (image, image.T):
        plain = np.ptp(lines, axis=1) <= GRID_TOLERANCE
        step = np.abs(np.diff(lines, axis=0)).max(axis=1) > GRID_TOLERANCE
        content = ~plain
        repeats = content[1:] & content[:-1] & ~step  # a content row equal to the one before it
        if content.any():
            shares.append(1.0 - float(repeats.sum()) / float(content.sum()))
    return side if not shares else min(side, max(2, round(side * max(shares))))


def stroke_width(image: np.ndarray) -> float | None:
    """The ink's typical stroke width in pixels (twice its area over its perimeter: a long stroke of width w has
    area w x length and perimeter about 2 x length), or None when the ink is not strokes: more than
    ``SPARSE_INK`` of the image (filled shapes: Fashion-MNIST's garments) or none at all. Ink: the pixels more
    than halfway from the border's grey (the background) to the image's 99th-percentile grey."""
    background = float(np.median(_ring(image)))
    top = float(np.percentile(image, 99))
    if abs(top - background) <= FLAT_BORDER:  # ink as dark as the background, or dark ink: not read
        return None
    ink = image > background + 0.5 * (top - background)
    if not ink.any() or ink.mean() > SPARSE_INK:
        return None
    padded = np.pad(ink, 1)
    perimeter = int((padded[1:] != padded[:-1]).sum() + (padded[:, 1:] != padded[:, :-1]).sum())
    return 2.0 * float(ink.sum()) / perimeter


def _ring(image: np.ndarray) -> np.ndarray:
    """The outer ``BORDER_PX`` pixels of an image: where a plain background shows."""
    return np.concatenate([image[:BORDER_PX].ravel(), image[-BORDER_PX:].ravel(),
                           image[BORDER_PX:-BORDER_PX, :BORDER_PX].ravel(),
                           image[BORDER_PX:-BORDER_PX, -BORDER_PX:].ravel()])
