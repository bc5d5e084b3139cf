"""Image decoding for the service: from uploaded bytes to the bundle's input, safely.

The transform itself (EXIF-upright image -> RGB or L -> shorter side to ``resize`` -> centre crop -> normalise) is
:mod:`msn_core.preprocessing`, the one definition training evaluates with too. What this module adds is what a
hostile upload needs: pixel limits (per image, and per request through a shared :class:`PixelBudget`) are checked
from the header *before* any decoding, so a 20000x20000 bomb costs a few bytes of I/O. A large image is shrunk
first, by an integer factor that keeps its shorter side at least twice ``resize`` (Pillow's ``reducing_gap=2``):
JPEGs in the decoder (``draft``, DCT scaling), others by box-averaging (``reduce``; numpy for 16-bit), and only then
converted, so converting 16-bit or float pixels costs in proportion to the output, not to the upload. Every failure
is a 4xx :class:`~msn_serve.errors.ApiError` naming the image.

Decoding may run in worker processes (``--preprocess-workers``, :mod:`msn_serve.embedding.decode_pool`): the header
checks and the request's pixel budget then run in the server (:func:`check_upload`, the same checks in the same
order as :func:`decode_image`), and the worker repeats the per-image ones before it decodes.
"""
from __future__ import annotations

import contextlib
import io
import math
import threading
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from msn_core.bundle import Preprocessing
from msn_core.preprocessing import normalise, resize_crop, to_mode
from msn_serve.errors import ApiError, too_large, unprocessable

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated upload is an error, not a grey half-image
Image.MAX_IMAGE_PIXELS = None  # we enforce our own (configurable) limit before decoding

_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}  # EXIF orientation -> the transpose that makes the image upright
_REDUCIBLE = {"L", "LA", "La", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "I", "F"}


class PixelBudget:
    """Decoded pixels one request may still spend; its images (decoded in parallel) share it."""

    def __init__(self, limit: int):
        self.limit, self.left = limit, limit
        self._lock = threading.Lock()

    def take(self, pixels: int, what: str) -> None:
        with self._lock:
            if pixels > self.left:
                raise too_large(f"{what}: its {pixels} pixels would pass this request's budget of {self.limit} "
                                "decoded pixels (max_request_pixels); send fewer or smaller images")
            self.left -= pixels


@contextlib.contextmanager
def _image_errors(what: str) -> Iterator[None]:
    """Pillow's many ways of failing on hostile bytes -> one 4xx :class:`ApiError` naming the image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except ApiError:
        raise
    except UnidentifiedImageError:
        raise unprocessable(f"{what}: not a recognised image format") from None
    except Image.DecompressionBombError as e:
        raise too_large(f"{what}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError) as e:
        # Pillow reports truncated/corrupt data as OSError/SyntaxError/ValueError depending on the codec.
        raise unprocessable(f"{what}: corrupt or truncated image ({e})") from None


def _open_checked(data: bytes, max_pixels: int, what: str, budget: PixelBudget | None) -> Image.Image:
    """The image's header, read and checked against the limits (nothing decoded yet)."""
    if not data:
        raise unprocessable(f"{what}: empty file")
    im = Image.open(io.BytesIO(data))
    w, h = im.size
    if w < 1 or h < 1:
        raise unprocessable(f"{what}: image has zero size {w}x{h}")
    if w * h > max_pixels:
        raise too_large(f"{what}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (max_image_pixels)")
    if budget is not None:
        budget.take(w * h, what)
    return im


def check_upload(data: bytes, *, max_pixels: int, what: str = "image", budget: PixelBudget | None = None) -> None:
    """:func:`decode_image`'s checks before decoding (format, size, limits, the request's budget), alone: what the
    server does for an image that a worker process decodes."""
    with _image_errors(what):
        _open_checked(data, max_pixels, what, budget)


def decode_image(data: bytes, *, max_pixels: int, what: str = "image", budget: PixelBudget | None = None,
                 short_side: int = 0) -> Image.Image:
    """Decode bytes into an upright PIL image, shrunk to no less than ``short_side`` on its shorter side if that
    is given, or raise a 4xx :class:`ApiError`."""
    with _image_errors(what):
        im = _open_checked(data, max_pixels, what, budget)
        w, h = im.size
        if getattr(im, "n_frames", 1) > 1:
            im.seek(0)  # animated GIF/APNG/TIFF: the first frame is the image
        if short_side and im.format == "JPEG" and min(w, h) >= 2 * short_side:
            scale = short_side / min(w, h)  # the decoder scales by 1/2, 1/4 or 1/8, never below this size
            im.draft(None, (math.ceil(w * scale), math.ceil(h * scale)))
        orientation = im.getexif().get(0x0112, 1)
        im.load()
        if short_side:
            im = shrink(im, short_side)
        if orientation in _TRANSPOSE:
            im = im.transpose(_TRANSPOSE[orientation])
    return im


def shrink(im: Image.Image, short_side: int) -> Image.Image:
    """Box-average by the largest integer factor that keeps the shorter side >= ``short_side``; small images and
    modes whose pixels cannot be averaged (palette, bilevel: converted first) are handled exactly as before."""
    factor = min(im.size) // short_side
    if factor < 2:
        return im
    if im.mode.startswith("I;16"):  # Pillow cannot reduce 16-bit modes: average in numpy, keep the 16-bit range
        arr = np.asarray(im)
        h, w = arr.shape[0] // factor, arr.shape[1] // factor
        mean = arr[: h * factor, : w * factor].reshape(h, factor, w, factor).mean(axis=(1, 3), dtype=np.float64)
        return Image.fromarray(np.rint(mean).astype(np.int32), mode="I")
    if im.mode not in _REDUCIBLE:
        im = im.convert("RGBA" if im.mode == "P" and "transparency" in im.info else
                        "L" if im.mode in ("1", "L") else "RGB")
    return im.reduce(factor)


def preprocess_bytes(data: bytes, pre: Preprocessing, *, max_pixels: int, what: str = "image",
                     budget: PixelBudget | None = None) -> np.ndarray:
    """The full pipeline for one uploaded file; raises 4xx :class:`ApiError` on bad input."""
    return normalise(resized_bytes(data, pre, max_pixels=max_pixels, what=what, budget=budget), pre.mean, pre.std)


def resized_bytes(data: bytes, pre: Preprocessing, *, max_pixels: int, what: str = "image",
                  budget: PixelBudget | None = None) -> Image.Image:
    """:func:`preprocess_bytes` up to the normalisation: the ``crop`` x ``crop`` RGB (or L) image."""
    im = decode_image(data, max_pixels=max_pixels, what=what, budget=budget, short_side=2 * pre.resize)
    try:
        im = to_mode(im, pre.channels)
        im = resize_crop(im, pre)
    except (OSError, ValueError) as e:
        raise unprocessable(f"{what}: cannot convert image ({e})") from None
    return im
