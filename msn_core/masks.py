"""Mask specifications -> kept-patch indices: the one definition every package resolves masks with.

MSN drops patch tokens instead of replacing them, so every mask becomes ``keep_idx``: the sorted, row-major indices
of the patches the encoder sees (the CLS token is always kept and never counted). Specifications (JSON-like, the
same in ``/embed``, OIP, the visualizer and ``msn-eval``):

* ``None``: all patches.
* ``{"ratio": r, "seed": s}``: :func:`num_kept` random patches, drawn by :func:`random_keep`.
* ``{"focal": {"size": [h, w] | s, "top": t, "left": l}}``: one block of the grid, centred without ``top``/``left``.
* ``{"keep_idx": [i, ...]}``: explicit indices (unique, in range).
* ``{"bitmap": [[1, 0, ...], ...]}``: grid x grid of 0/1, 1 = patch kept.

Rows of a batch that keep different numbers of patches are padded with :data:`PAD` (:func:`pad_keep`); that
padded ``(B, K)`` array is what the bundle's ONNX graph takes as ``keep_idx``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

__all__ = [
    "FORMS",
    "PAD",
    "MaskError",
    "check_keep",
    "focal_keep",
    "keep_from_bitmap",
    "num_kept",
    "pad_keep",
    "random_keep",
    "resolve_mask",
    "resolve_masks",
]

FORMS = ("ratio", "focal", "keep_idx", "bitmap")
PAD = -1  # keep_idx entry of a padding slot in a mixed-K batch

Seed = int | Sequence[int]


class MaskError(ValueError):
    """A mask that is malformed or does not fit the patch grid; the message names the offending field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def num_kept(num_patches: int, ratio: float) -> int:
    """Patches kept at masking ``ratio``: ``max(1, floor(N * (1 - ratio)))``, the official code's count."""
    if not isinstance(ratio, Real) or isinstance(ratio, bool) or not math.isfinite(ratio):
        raise MaskError(f"mask.ratio: expected a number in [0, 1), got {ratio!r}")
    if not 0.0 <= ratio < 1.0:
        raise MaskError(f"mask.ratio: {ratio} is outside [0, 1) (1.0 would drop every patch)")
    if not _is_int(num_patches) or num_patches < 1:
        raise MaskError(f"num_patches must be a positive integer, got {num_patches!r}")
    return max(1, int(num_patches * (1.0 - float(ratio))))


def _check_seed(seed: Any) -> None:
    ok = _is_int(seed) and seed >= 0
    if isinstance(seed, (list, tuple)):
        ok = bool(seed) and all(_is_int(s) and s >= 0 for s in seed)
    if seed is not None and not ok:
        raise MaskError(f"mask.seed: expected a non-negative integer or a list of them, got {seed!r}")


def random_keep(num_patches: int, ratio: float, seed: Seed | None = None) -> np.ndarray:
    """The seeded random mask: ``np.sort(np.random.default_rng(seed).permutation(N)[:num_kept(N, ratio)])``.

    ``seed`` is a non-negative integer or a list of them (numpy ``SeedSequence`` entropy; ``msn-eval`` masks dataset
    image ``i`` with ``[mask_seed, i]``), or ``None`` for fresh OS entropy. This expression is the whole definition,
    so any client can reproduce a mask with numpy alone; a test pins its output so a numpy stream change is caught.
    """
    keep = num_kept(num_patches, ratio)
    _check_seed(seed)
    rng = np.random.default_rng(None if seed is None else (list(seed) if isinstance(seed, tuple) else seed))
    return np.sort(rng.permutation(num_patches)[:keep]).astype(np.int64)


def focal_keep(grid_h: int, grid_w: int, block_h: int, block_w: int, top: int | None = None,
               left: int | None = None) -> np.ndarray:
    """Row-major indices of a ``block_h`` x ``block_w`` block of the patch grid, centred unless placed.

    The "focal mask" of evaluation and serving: encode one region of the image at its real position.
    """
    if not all(_is_int(v) for v in (block_h, block_w)) or not (1 <= block_h <= grid_h and 1 <= block_w <= grid_w):
        raise MaskError(f"mask.focal.size: {block_h}x{block_w} does not fit the {grid_h}x{grid_w} patch grid")
    top = (grid_h - block_h) // 2 if top is None else top
    left = (grid_w - block_w) // 2 if left is None else left
    for key, value, span, limit in (("top", top, block_h, grid_h), ("left", left, block_w, grid_w)):
        if not _is_int(value) or value < 0 or value + span > limit:
            raise MaskError(f"mask.focal.{key}: {value!r} puts the {block_h}x{block_w} block outside the "
                            f"{grid_h}x{grid_w} patch grid")
    rows, cols = np.meshgrid(np.arange(top, top + block_h), np.arange(left, left + block_w), indexing="ij")
    return (rows * grid_w + cols).ravel().astype(np.int64)


def keep_from_bitmap(bitmap: Any, grid: int | None = None) -> np.ndarray:
    """Row-major indices of the kept (1 / True) cells of a 2-D keep bitmap, ``grid`` x ``grid`` if given."""
    try:
        cells = np.asarray(bitmap)
    except ValueError:  # ragged rows
        cells = np.asarray(None)
    if cells.ndim != 2 or (grid is not None and cells.shape != (grid, grid)):
        want = f"a {grid}x{grid}" if grid is not None else "a 2-D"
        got = "x".join(map(str, cells.shape)) if cells.ndim else type(bitmap).__name__
        raise MaskError(f"mask.bitmap: expected {want} list of 0/1 rows (the patch grid), got {got}")
    if cells.dtype.kind not in "biu" or not np.isin(cells, (0, 1)).all():
        raise MaskError("mask.bitmap: entries must be 0 (dropped) or 1 (kept)")
    keep = np.flatnonzero(cells).astype(np.int64)
    if keep.size == 0:
        raise MaskError("mask.bitmap: keeps no patch (at least one 1 is required)")
    return keep


def check_keep(indices: Any, num_patches: int, field: str = "mask.keep_idx") -> np.ndarray:
    """Explicit kept indices, checked (non-empty, integer, in ``[0, N)``, unique) and returned sorted."""
    try:
        arr = np.asarray(indices)
    except (ValueError, TypeError, OverflowError):  # ragged or absurdly nested lists
        arr = np.asarray(None)
    if (isinstance(indices, list) and not all(_is_int(i) for i in indices)) or arr.ndim != 1 or arr.size == 0 \
            or arr.dtype.kind not in "iu":
        raise MaskError(f"{field}: expected a non-empty list of integer patch indices")
    lo, hi = int(arr.min()), int(arr.max())  # before the cast: uint64 values past 2**63 would wrap
    if lo < 0 or hi >= num_patches:
        raise MaskError(f"{field}: indices must be in [0, {num_patches}); got min {lo}, max {hi}")
    arr = arr.astype(np.int64)
    unique = np.unique(arr)
    if unique.size != arr.size:
        raise MaskError(f"{field}: duplicate indices")
    return unique


def _focal_spec(spec: Any, grid: int) -> np.ndarray:
    if not isinstance(spec, dict):
        raise MaskError('mask.focal: expected an object {"size": [h, w], "top": t, "left": l}')
    unknown = sorted(set(spec) - {"size", "top", "left"})
    if unknown:
        raise MaskError(f"mask.focal: unknown key(s) {unknown}")
    size = spec.get("size")
    if _is_int(size):
        h = w = size
    elif isinstance(size, (list, tuple)) and len(size) == 2 and all(_is_int(v) for v in size):
        h, w = size
    else:
        raise MaskError(f"mask.focal.size: expected an integer or [h, w] in patches, got {size!r}")
    return focal_keep(grid, grid, h, w, spec.get("top"), spec.get("left"))


def resolve_mask(spec: Any, grid: int) -> np.ndarray:
    """One specification -> sorted int64 ``keep_idx`` on a ``grid`` x ``grid`` patch grid."""
    n = grid * grid
    if spec is None:
        return np.arange(n, dtype=np.int64)
    if not isinstance(spec, dict):
        raise MaskError(f'mask: expected an object like {{"ratio": 0.5}}, got {type(spec).__name__}')
    unknown = sorted(set(spec) - set(FORMS) - {"seed"})
    if unknown:
        raise MaskError(f"mask: unknown key(s) {unknown}; expected one of {list(FORMS)}")
    forms = [k for k in FORMS if k in spec]
    if len(forms) != 1:
        raise MaskError(f"mask: give exactly one of {list(FORMS)}, got {forms or 'none'}")
    form = forms[0]
    if "seed" in spec and form != "ratio":
        raise MaskError("mask: 'seed' only applies to 'ratio' masks")
    if form == "ratio":
        return random_keep(n, spec["ratio"], spec.get("seed"))
    if form == "focal":
        return np.sort(_focal_spec(spec["focal"], grid))
    if form == "keep_idx":
        return check_keep(spec["keep_idx"], n)
    return keep_from_bitmap(spec["bitmap"], grid)


def resolve_masks(spec: Any, count: int, grid: int) -> list[np.ndarray]:
    """One specification for all ``count`` images (they share the mask), or a list with one per image."""
    if not isinstance(spec, list):
        return [resolve_mask(spec, grid)] * count
    if len(spec) != count:
        raise MaskError(f"mask: a list of masks must have one entry per image ({count}), got {len(spec)}")
    out = []
    for i, one in enumerate(spec):
        try:
            out.append(resolve_mask(one, grid))
        except MaskError as e:
            raise MaskError(f"image {i}: {e}") from None
    return out


def pad_keep(keeps: Sequence[np.ndarray], width: int | None = None) -> np.ndarray:
    """Stack kept-index rows into ``(B, K)`` int64, ``K`` the longest row (or ``width``), padding with :data:`PAD`."""
    longest = max((len(k) for k in keeps), default=0)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest row ({longest})")
    out = np.full((len(keeps), width), PAD, dtype=np.int64)
    for row, keep in enumerate(keeps):
        out[row, : len(keep)] = keep
    return out
