"""The bundle's evaluation preprocessing: the one definition of what ``msn.json``'s ``preprocessing`` section means.

Shorter side to ``resize`` (aspect kept, the new size rounded), the central ``crop`` x ``crop`` window (offset
floored), ``x / 255``, then ``(x - mean) / std`` per channel on ``channels`` (1 = grey, 3 = RGB). Two executors run
it, and both take it from here:

* :func:`transform_image` / :func:`preprocess_uint8`: Pillow + numpy, one image at a time. The service runs it on
  every decoded upload (``msn_serve.embedding.preprocess`` adds the decoding and the limits a hostile upload needs).
* ``training.views.eval_transform``: batched uint8 tensors on the training device, with torch's antialiased bicubic
  (Pillow's filter). It takes its geometry from :func:`resize_plan`; evaluation, ``msn-embed`` and the visualizer use
  it. A test holds the two executors within one grey level of each other before normalisation.

Pillow is imported inside the functions that take or make images, never at module level: importing ``msn_core``
stays numpy + the standard library.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from msn_core.bundle import Preprocessing

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["ResizeCrop", "normalise", "normalise_into", "preprocess_uint8", "resize_crop", "resize_plan", "to_mode",
           "transform_image"]

INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")  # Pillow's Resampling names
# Filters whose weights are continuous in the sample position: resampling only the crop window gives resize-then-crop
# to within one grey level (float rounding of the window's position). ``nearest`` and ``box`` jump at a position, so
# the same rounding can pick another source pixel: they resize the whole image and crop, as written.
_CONTINUOUS = ("bicubic", "bilinear", "lanczos", "hamming")


@dataclass(frozen=True)
class ResizeCrop:
    """Where an image of a given size goes: resized to ``height`` x ``width``, then cropped at ``(top, left)``."""

    height: int
    width: int
    top: int
    left: int
    crop: int


def resize_plan(height: int, width: int, resize: int, crop: int) -> ResizeCrop:
    """The geometry of the transform for a ``height`` x ``width`` image (the arithmetic both executors use)."""
    if crop > resize:
        raise ValueError(f"crop {crop} is larger than the resized shorter side {resize}")
    scale = resize / min(height, width)
    new_h, new_w = max(resize, round(height * scale)), max(resize, round(width * scale))
    return ResizeCrop(new_h, new_w, (new_h - crop) // 2, (new_w - crop) // 2, crop)


@lru_cache(maxsize=32)
def _lut(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``(C, 256)`` float32: the normalised value of every uint8 level, computed with the very float32 operations
    of the array path, so a lookup returns the same bits (a test checks all 256 levels)."""
    levels = np.arange(256, dtype=np.float32)[:, None] / 255.0
    table = (levels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    table.flags.writeable = False
    return np.ascontiguousarray(table.T)


def normalise(image: Any, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 HWC (or HW) image or array -> float32 CHW array, ``(x / 255 - mean) / std`` per channel.

    uint8 input (every decoded upload) is looked up in a 256-entry table per channel, written straight into the
    CHW output: one pass instead of convert, divide, subtract, divide and transpose (about half the time)."""
    arr = np.asarray(image)
    if arr.dtype == np.uint8 and arr.ndim in (2, 3):
        n_img = 1 if arr.ndim == 2 else arr.shape[2]
        n_lut = len(mean)
        out = np.empty((max(n_lut, n_img), arr.shape[0], arr.shape[1]), dtype=np.float32)
        return normalise_into(out, arr, mean, std)
    arr = arr.astype(np.float32) / 255.0
    if arr.ndim == 2:
        arr = arr[:, :, None]
    mean_a, std_a = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(((arr - mean_a) / std_a).transpose(2, 0, 1), dtype=np.float32)


def normalise_into(out: np.ndarray, image: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """:func:`normalise` of a uint8 HWC (or HW) ``image`` written into ``out`` (float32 CHW, e.g. a row of a batch):
    the same table, so the same bits, without an intermediate array. The service's engine process normalises the
    crops its HTTP processes hand over in shared memory with it (``msn_serve.embedding.batcher``)."""
    hwc = image[:, :, None] if image.ndim == 2 else image
    lut = _lut(tuple(map(float, mean)), tuple(map(float, std)))
    n_lut, n_img = lut.shape[0], hwc.shape[2]
    if 1 not in (n_lut, n_img) and n_lut != n_img:  # the array path's broadcasting rule, and its error
        raise ValueError(f"{n_lut} mean/std values for an image of {n_img} channels")
    for c in range(out.shape[0]):
        np.take(lut[min(c, n_lut - 1)], hwc[:, :, min(c, n_img - 1)], out=out[c])
    return out


def to_mode(im: Image.Image, channels: int) -> Image.Image:
    """Convert any Pillow mode to RGB (or L) with correct value scaling for 16-bit and float images."""
    from PIL import Image

    target = "RGB" if channels == 3 else "L"
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        if im.mode.startswith("I;16"):
            arr = arr / 257.0
        elif im.mode == "I":
            # 16-bit PNGs may decode to mode I (0..65535); wider integer ranges are squeezed by their maximum.
            arr = arr * (255.0 / max(65535.0, float(arr.max(initial=0))))
        else:  # float images: assume [0, 1] if they look like it
            arr = arr * 255.0 if arr.max(initial=0) <= 1.0 else arr
        im = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")  # palette transparency must go through RGBA to convert cleanly
    if im.mode != target:
        im = im.convert(target)  # drops alpha like the training loaders' ``convert("RGB")``
    return im


def resize_crop(im: Image.Image, pre: Preprocessing) -> Image.Image:
    """Shorter side to ``resize`` (aspect kept), then the central ``crop`` x ``crop`` window."""
    from PIL import Image

    name = pre.interpolation.lower()
    if name not in INTERPOLATIONS:
        raise ValueError(f"unsupported interpolation {pre.interpolation!r}")
    resample = Image.Resampling[name.upper()]
    w, h = im.size
    plan = resize_plan(h, w, pre.resize, pre.crop)
    nw, nh, top, left = plan.width, plan.height, plan.top, plan.left
    if (nw, nh) != (w, h) and (name in _CONTINUOUS or nw * nh > 16 * pre.crop * pre.crop):
        # Pillow's ``box`` resamples just the crop window in one call, still reading neighbours outside it for
        # filter support: the result equals resize-then-crop to within float rounding (one grey level, on a few
        # pixels in a thousand; none for 224 -> 256 -> 224), at the cost of the window alone (a 224-px upload:
        # 224x224 outputs instead of 256x256, and no crop copy). Extreme aspect ratios (say 1x40000) take this
        # path with every filter: they would resize to a huge strip only to throw most of it away.
        sx, sy = nw / w, nh / h
        box = (left / sx, top / sy, (left + pre.crop) / sx, (top + pre.crop) / sy)
        return im.resize((pre.crop, pre.crop), resample=resample, box=box)
    if (nw, nh) != (w, h):
        im = im.resize((nw, nh), resample=resample)
    return im.crop((left, top, left + pre.crop, top + pre.crop))


def transform_image(im: Image.Image, pre: Preprocessing) -> np.ndarray:
    """A decoded Pillow image (any mode) -> the graph's float32 ``(channels, crop, crop)`` input."""
    return normalise(resize_crop(to_mode(im, pre.channels), pre), pre.mean, pre.std)


def preprocess_uint8(chw: np.ndarray, pre: Preprocessing) -> np.ndarray:
    """:func:`transform_image` of an in-memory uint8 ``(C, H, W)`` array (tests and benchmarks)."""
    from PIL import Image

    hwc = np.ascontiguousarray(np.asarray(chw, dtype=np.uint8).transpose(1, 2, 0))
    return transform_image(Image.fromarray(hwc[:, :, 0] if hwc.shape[2] == 1 else hwc), pre)
