"""The visualizer's masks (random ratio + seed, focal block, clicked patches) as ``/embed`` mask specifications.

The app and ``msn-visualize sample`` turn their controls into a specification and resolve it with
:mod:`msn_core.masks`, so a mask shown here keeps the same patches as the same specification sent to ``/embed``, to
OIP or used by ``msn-eval``. Errors are ``ValueError`` (``MaskError``); the app shows them to the user.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from msn_core.masks import resolve_mask
from visualizer.render import bitmap_from_keep_idx

__all__ = ["MODES", "keep_bitmap", "mask_spec"]

MODES = ("random", "focal", "click")


def mask_spec(mode: str, ratio: float, seed: int, focal: float, grid: int) -> dict[str, Any] | None:
    """The specification of the random and focal modes (``focal`` is the block side as a fraction of the grid);
    ``None`` for clicked patches, which have no short specification."""
    if mode == "random":
        return {"ratio": float(ratio), "seed": int(seed)}
    if mode == "focal":
        return {"focal": {"size": min(grid, max(1, round(float(focal) * grid)))}}
    if mode == "click":
        return None
    raise ValueError(f"unknown mask mode {mode!r}; expected one of {', '.join(MODES)}")


def keep_bitmap(mode: str, ratio: float, seed: int, focal: float, clicked: np.ndarray | None,
                grid: int) -> np.ndarray:
    """``(grid, grid)`` bool of kept patches: the mode's specification resolved, or the clicked bitmap (all
    patches kept before the first click)."""
    spec = mask_spec(mode, ratio, seed, focal, grid)
    if spec is not None:
        return bitmap_from_keep_idx(resolve_mask(spec, grid), grid)
    if clicked is None or np.asarray(clicked).shape != (grid, grid):
        return np.ones((grid, grid), dtype=bool)
    return np.asarray(clicked, dtype=bool)
