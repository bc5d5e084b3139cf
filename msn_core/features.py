"""The frozen features an encoder can hand out, by name, and the width of each.

- ``cls_pre_norm``: the last block's CLS token before the final LayerNorm (the paper's low-shot feature).
- ``cls_post_norm``: the same token after the final LayerNorm (what the projection head reads in training).
- ``cls_last<n>``: the CLS tokens of the last ``n`` blocks, each through the final LayerNorm, concatenated
  (DINO's linear-evaluation feature), ``n * D`` wide.
- ``patch_tokens``: the last block's patch tokens after the final LayerNorm, laid back on the full patch grid in
  row-major order and flattened, ``num_patches * D`` wide: the feature that keeps the layout.
- ``patch_grid<g>``: the same map average-pooled to a ``g x g`` grid (``g`` divides the patch grid), ``g * g * D``
  wide: the layout at a size that suits large grids (ViT-S/16 at 224 px: 14 x 14 -> 2 x 2 = 1,536-d).
- ``cls_patch_tokens``: ``cls_post_norm`` scaled by ``sqrt(num_patches)``, then ``patch_tokens``,
  ``(num_patches + 1) * D`` wide: what the image is and where things are, with equal weight (the scale gives the one
  CLS token the energy of the whole map, so neither half drowns the other once the vector is L2-normalised).

A dropped patch (masking) has no token: its place on the map is zero, and a pooled cell averages the kept patches
it covers (zero when it covers none). So a spatial feature of a masked image says "nothing seen here" where the
patch was dropped, which is what a nearest-neighbour search or a linear classifier over the map should get.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CLS_FEATURES = ("cls_pre_norm", "cls_post_norm")
FEATURE_PATTERNS = ("cls_pre_norm", "cls_post_norm", "cls_last<n>", "patch_tokens", "patch_grid<g>",
                    "cls_patch_tokens")
_LAST = re.compile(r"cls_last([1-9][0-9]*)")
_GRID = re.compile(r"patch_grid([1-9][0-9]*)")


class FeatureError(ValueError):
    """A feature name that does not exist, or does not fit the architecture."""


@dataclass(frozen=True)
class FeatureSpec:
    """``kind`` is ``cls`` | ``cls_last`` | ``patch_tokens`` | ``patch_grid`` | ``cls_patch_tokens``; ``n`` the
    blocks or the grid side."""

    name: str
    kind: str
    n: int = 1
    pre_norm: bool = False

    @property
    def spatial(self) -> bool:
        return self.kind in ("patch_tokens", "patch_grid", "cls_patch_tokens")


def parse_feature(name: str) -> FeatureSpec:
    """The spec of a feature name; :class:`FeatureError` naming the valid patterns otherwise."""
    if name in CLS_FEATURES:
        return FeatureSpec(name, "cls", 1, pre_norm=name == "cls_pre_norm")
    if name in ("patch_tokens", "cls_patch_tokens"):
        return FeatureSpec(name, name)
    if m := _LAST.fullmatch(name):
        return FeatureSpec(name, "cls_last", int(m.group(1)))
    if m := _GRID.fullmatch(name):
        return FeatureSpec(name, "patch_grid", int(m.group(1)))
    raise FeatureError(f"unknown feature {name!r}; expected one of {', '.join(FEATURE_PATTERNS)}")


def check_feature(name: str, *, depth: int, grid: int) -> FeatureSpec:
    """:func:`parse_feature`, also checked against an encoder of ``depth`` blocks and a ``grid x grid`` patch grid."""
    spec = parse_feature(name)
    if spec.kind == "cls_last" and not 1 <= spec.n <= depth:
        raise FeatureError(f"feature {name!r}: the encoder has {depth} blocks")
    if spec.kind == "patch_grid" and grid % spec.n:
        raise FeatureError(f"feature {name!r}: {spec.n} does not divide the {grid} x {grid} patch grid")
    return spec


def feature_dim(name: str, *, embed_dim: int, depth: int, grid: int) -> int:
    """Width of the feature vector for an encoder of width ``embed_dim``."""
    spec = check_feature(name, depth=depth, grid=grid)
    if spec.kind == "cls":
        return embed_dim
    if spec.kind == "cls_last":
        return spec.n * embed_dim
    if spec.kind == "patch_tokens":
        return grid * grid * embed_dim
    if spec.kind == "cls_patch_tokens":
        return (grid * grid + 1) * embed_dim
    return spec.n * spec.n * embed_dim


@dataclass(frozen=True)
class FeatureLayout:
    """Where things are in a feature vector: ``global_dim`` values first (CLS parts; 0 for none), then a
    ``side x side`` map of ``token_dim``-wide places, row-major, each place's values together (``side`` 0: no map).
    A decoder reads the map as an image-shaped input instead of one flat vector."""

    global_dim: int
    side: int
    token_dim: int

    @property
    def map_dim(self) -> int:
        return self.side * self.side * self.token_dim


def feature_layout(name: str, *, embed_dim: int, depth: int, grid: int) -> FeatureLayout:
    """The :class:`FeatureLayout` of feature ``name`` for an encoder of width ``embed_dim``."""
    spec = check_feature(name, depth=depth, grid=grid)
    if spec.kind == "cls":
        return FeatureLayout(embed_dim, 0, 0)
    if spec.kind == "cls_last":
        return FeatureLayout(spec.n * embed_dim, 0, 0)
    if spec.kind == "patch_tokens":
        return FeatureLayout(0, grid, embed_dim)
    if spec.kind == "cls_patch_tokens":
        return FeatureLayout(embed_dim, grid, embed_dim)
    return FeatureLayout(0, spec.n, embed_dim)
