"""Pictures: masked views on the patch grid and sample grids (original | masked | samples), Pillow only."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from msn_core.durable import atomic_write

__all__ = ["bitmap_from_keep_idx", "grid_image", "masked_view", "patch_grid_image", "save_grid", "to_hwc", "upscale"]

MASK_GREY = 127


def to_hwc(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """uint8 (3, H, W) tensor or (H, W, 3) array -> (H, W, 3) uint8 array."""
    array = image.cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3:
        array = array.transpose(1, 2, 0)
    return np.ascontiguousarray(array.astype(np.uint8))


def upscale(image: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resize of an (H, W, 3) image to ``size`` x ``size`` (pixels stay visible)."""
    if image.shape[0] == size and image.shape[1] == size:
        return image
    return np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.NEAREST))


def bitmap_from_keep_idx(keep_idx: torch.Tensor | Sequence[int], grid: int) -> np.ndarray:
    bitmap = np.zeros(grid * grid, dtype=bool)
    bitmap[np.asarray(keep_idx, dtype=np.int64)] = True
    return bitmap.reshape(grid, grid)


def masked_view(view: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The encoder's view with dropped patches painted grey; ``keep`` is the (grid, grid) keep bitmap."""
    grid = keep.shape[0]
    cell = view.shape[0] // grid
    pixel_keep = np.kron(keep, np.ones((cell, cell), dtype=bool))
    out = view.copy()
    out[~pixel_keep] = MASK_GREY
    return out


def patch_grid_image(view: np.ndarray, keep: np.ndarray, cell_px: int) -> np.ndarray:
    """Clickable picture: the view upscaled to ``grid * cell_px``, dropped patches dimmed, grid lines drawn."""
    grid = keep.shape[0]
    image = upscale(view, grid * cell_px).astype(np.float32)
    pixel_keep = np.kron(keep, np.ones((cell_px, cell_px), dtype=bool))
    image[~pixel_keep] = 0.25 * image[~pixel_keep] + 0.75 * np.array([40.0, 40.0, 60.0])
    image[::cell_px, :] = image[:, ::cell_px] = 255.0
    image[-1, :] = image[:, -1] = 255.0
    return image.round().astype(np.uint8)


def grid_image(rows: Sequence[Sequence[np.ndarray]], *, cell: int = 96, pad: int = 2) -> Image.Image:
    """Rows of (H, W, 3) uint8 images as one picture, each image upscaled to ``cell``, on white."""
    width = max(len(row) for row in rows)
    canvas = Image.new("RGB", (width * (cell + pad) + pad, len(rows) * (cell + pad) + pad), (255, 255, 255))
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            canvas.paste(Image.fromarray(upscale(image, cell)), (pad + c * (cell + pad), pad + r * (cell + pad)))
    return canvas


def save_grid(rows: Sequence[Sequence[np.ndarray]], path: str | os.PathLike, *, cell: int = 96,
              pad: int = 2) -> Path:
    """Write rows of (H, W, 3) uint8 images as one PNG (:func:`grid_image`), atomically."""
    path = Path(path)
    canvas = grid_image(rows, cell=cell, pad=pad)
    atomic_write(path, lambda f: canvas.save(f, format="PNG"))
    return path
