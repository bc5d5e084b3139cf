"""Mask specifications -> sorted kept-patch indices on the model's patch grid.

MSN encodes a masked view by *dropping* patch tokens, so every mask form resolves to ``keep_idx``: the row-major
indices of the patches the encoder sees. Forms (JSON):

* ``null`` / absent: all patches.
* ``{"ratio": r, "seed": s}``: keep ``max(1, int(N*(1-r)))`` random patches (0 <= r < 1), the count the
  official code and training use; same seed -> same mask.
* ``{"focal": {"size": [h, w] | s, "top": t, "left": l}}``: keep one block (centred if top/left omitted).
* ``{"keep_idx": [i, ...]}``: explicit kept indices (unique, in range).
* ``{"bitmap": [[1, 0, ...], ...]}``: grid x grid of 0/1, 1 = patch kept (visible), 0 = dropped.

Every problem raises a 422 :class:`ApiError` that names the offending field and the grid size.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .errors import ApiError, unprocessable

_FORMS = ("ratio", "focal", "keep_idx", "bitmap")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_mask_field(text: str | None) -> Any:
    """Decode the multipart ``mask`` form field (JSON text); empty means no mask."""
    if text is None or not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise unprocessable(f"mask: not valid JSON ({e.msg} at position {e.pos})") from None


def resolve_mask(spec: Any, grid: int) -> np.ndarray:
    """Turn one mask spec into sorted int64 ``keep_idx`` for a ``grid`` x ``grid`` patch grid."""
    n = grid * grid
    if spec is None:
        return np.arange(n, dtype=np.int64)
    if not isinstance(spec, dict):
        raise unprocessable(f"mask: expected an object like {{\"ratio\": 0.5}}, got {type(spec).__name__}")
    forms = [k for k in _FORMS if k in spec]
    unknown = sorted(set(spec) - set(_FORMS) - {"seed"})
    if unknown:
        raise unprocessable(f"mask: unknown key(s) {unknown}; expected one of {list(_FORMS)}")
    if len(forms) != 1:
        raise unprocessable(f"mask: give exactly one of {list(_FORMS)}, got {forms or 'none'}")
    form = forms[0]
    if "seed" in spec and form != "ratio":
        raise unprocessable("mask: 'seed' only applies to 'ratio' masks")
    return {"ratio": _ratio, "focal": _focal, "keep_idx": _explicit, "bitmap": _bitmap}[form](spec, grid, n)


def _ratio(spec: dict, grid: int, n: int) -> np.ndarray:
    r = spec["ratio"]
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
        raise unprocessable(f"mask.ratio: expected a number in [0, 1), got {r!r}")
    if not 0.0 <= r < 1.0:
        raise unprocessable(f"mask.ratio: {r} is outside [0, 1) (1.0 would drop every patch)")
    seed = spec.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise unprocessable(f"mask.seed: expected a non-negative integer, got {seed!r}")
    keep = max(1, int(n * (1.0 - r)))  # as training.masking.num_kept (msn_serve cannot import training)
    rng = np.random.default_rng(seed)
    return np.sort(rng.permutation(n)[:keep]).astype(np.int64)


def _focal(spec: dict, grid: int, n: int) -> np.ndarray:
    f = spec["focal"]
    if not isinstance(f, dict):
        raise unprocessable("mask.focal: expected an object {\"size\": [h, w], \"top\": t, \"left\": l}")
    bad = sorted(set(f) - {"size", "top", "left"})
    if bad:
        raise unprocessable(f"mask.focal: unknown key(s) {bad}")
    size = f.get("size")
    if _is_int(size):
        h = w = size
    elif isinstance(size, list) and len(size) == 2 and all(_is_int(v) for v in size):
        h, w = size
    else:
        raise unprocessable(f"mask.focal.size: expected an integer or [h, w] in patches, got {size!r}")
    if not (1 <= h <= grid and 1 <= w <= grid):
        raise unprocessable(f"mask.focal.size: {h}x{w} does not fit the {grid}x{grid} patch grid")
    top, left = f.get("top", (grid - h) // 2), f.get("left", (grid - w) // 2)
    for key, val, span in (("top", top, h), ("left", left, w)):
        if not _is_int(val) or val < 0 or val + span > grid:
            raise unprocessable(f"mask.focal.{key}: {val!r} puts the {h}x{w} block outside the "
                                f"{grid}x{grid} patch grid")
    rows, cols = np.meshgrid(np.arange(top, top + h), np.arange(left, left + w), indexing="ij")
    return np.sort((rows * grid + cols).ravel()).astype(np.int64)


def _explicit(spec: dict, grid: int, n: int) -> np.ndarray:
    idx = spec["keep_idx"]
    if not isinstance(idx, list) or not idx or not all(_is_int(i) for i in idx):
        raise unprocessable("mask.keep_idx: expected a non-empty list of integer patch indices")
    arr = np.asarray(idx, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= n:
        raise unprocessable(f"mask.keep_idx: indices must be in [0, {n}) for the {grid}x{grid} patch grid; "
                            f"got min {int(arr.min())}, max {int(arr.max())}")
    uniq = np.unique(arr)
    if uniq.size != arr.size:
        raise unprocessable("mask.keep_idx: duplicate indices")
    return uniq


def _bitmap(spec: dict, grid: int, n: int) -> np.ndarray:
    bm = spec["bitmap"]
    if (not isinstance(bm, list) or len(bm) != grid
            or not all(isinstance(row, list) and len(row) == grid for row in bm)):
        shape = f"{len(bm)} rows" if isinstance(bm, list) else type(bm).__name__
        raise unprocessable(f"mask.bitmap: expected a {grid}x{grid} list of 0/1 rows (the patch grid), got {shape}")
    flat = [v for row in bm for v in row]
    if not all(v in (0, 1) and not isinstance(v, float) for v in flat):
        raise unprocessable("mask.bitmap: entries must be 0 (dropped) or 1 (kept)")
    keep = np.flatnonzero(np.asarray(flat, dtype=np.int64)).astype(np.int64)
    if keep.size == 0:
        raise unprocessable("mask.bitmap: keeps no patch (at least one 1 is required)")
    return keep


def resolve_masks(spec: Any, count: int, grid: int) -> list[np.ndarray]:
    """One spec for all images, or a list with one spec per image."""
    if isinstance(spec, list):
        if len(spec) != count:
            raise unprocessable(f"mask: a list of masks must have one entry per image ({count}), got {len(spec)}")
        out = []
        for i, s in enumerate(spec):
            try:
                out.append(resolve_mask(s, grid))
            except ApiError as e:
                raise unprocessable(f"image {i}: {e.message}") from None
        return out
    one = resolve_mask(spec, grid)
    return [one] * count
