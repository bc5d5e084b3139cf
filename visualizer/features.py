"""Frozen MSN features from an exported bundle, with optional patch masking.

The encoder is the bundle's torch trunk (``encoder.safetensors``) or its ONNX graph (``model.onnx`` under ONNX
Runtime); either way the image goes through the bundle's own preprocessing (resize, centre crop, mean/std). What is
returned is the feature the decoder reads (``cond.feature``: by default the [CLS] output, whatever the bundle
serves), from the same forward pass as the served feature when both are asked for; the ONNX graph outputs the served
feature only, so it gives the CLS where the served feature holds it (``cls_patch_tokens``). Masks are kept-patch
indices in row-major patch order (:mod:`msn_core.masks`); a batch may mix samples that keep different numbers of
patches, padded with ``-1`` (:data:`msn_core.masks.PAD`, the convention of the bundle, the service and training),
which gives the same CLS as unpadded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from msn_core.features import feature_dim, feature_layout
from msn_core.inference import OrtGraph
from msn_core.masks import PAD, num_kept
from training.api import as_keep_tensor, encoder_keep_args, eval_transform, read_features
from visualizer.config import FEATURE_ALIASES

__all__ = ["FrozenEncoder", "random_keep_rows", "resolve_feature", "to_uint8"]


def resolve_feature(name: str | None, served: str) -> str:
    """The feature a decoder reads for ``cond.feature`` ``name``: an alias resolved (``token_map``), ``served`` or
    ``None`` the bundle's own feature ``served``."""
    if name is None or name == "served":
        return served
    return FEATURE_ALIASES.get(name, name)


def to_uint8(images: Tensor) -> Tensor:
    """[-1, 1] float images -> uint8 (B, 3, H, W) on the CPU."""
    return ((images.detach().float().cpu().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)


def random_keep_rows(batch: int, num_patches: int, ratios: Tensor | list[float],
                     generator: torch.Generator | None = None) -> Tensor:
    """Per-sample random masks at per-sample ratios -> ``keep_idx`` (B, Kmax), rows keeping fewer patches padded
    with :data:`~msn_core.masks.PAD`.

    The decoder's training conditioning: drawn from a torch generator, so a resumed run continues its stream.
    """
    ratios = torch.as_tensor(ratios, dtype=torch.float64).flatten().tolist()
    if len(ratios) != batch:
        raise ValueError(f"{len(ratios)} ratios for a batch of {batch}")
    keeps = [num_kept(num_patches, r) for r in ratios]
    width = max(keeps)
    keep_idx = torch.full((batch, width), PAD, dtype=torch.int64)
    for row, keep in enumerate(keeps):
        keep_idx[row, :keep] = torch.randperm(num_patches, generator=generator)[:keep].sort().values
    return keep_idx


class FrozenEncoder:
    """``embed(images_uint8, keep_idx=None) -> (B, D)`` float32 features on ``device``: the feature ``feature``
    names (:func:`resolve_feature`; default the bundle's served one), and with :meth:`embed_with_served` the served
    feature too, from the same forward pass."""

    def __init__(self, bundle_dir: str | os.PathLike, *, backend: str = "torch", device: str | torch.device = "cpu",
                 feature: str | None = None):
        from training.api import feature_spec, load_encoder

        self.bundle_dir = Path(bundle_dir)
        self.backend, self.device = backend, torch.device(device)
        encoder, self.info = load_encoder(self.bundle_dir)
        self.served, self.model_id = self.info.feature, self.info.model_id
        self.feature = resolve_feature(feature, self.served)
        prep = self.info.preprocessing
        self.transform = {"resize": prep.resize, "crop": prep.crop, "mean": list(prep.mean), "std": list(prep.std)}
        self.patch_size, self.grid = self.info.patch_size, self.info.grid
        arch = self.info.architecture
        shape = {"embed_dim": arch.embed_dim, "depth": arch.depth, "grid": arch.grid}
        self.num_patches, self.dim = self.info.num_patches, feature_dim(self.feature, **shape)  # what embed gives
        self.layout = feature_layout(self.feature, **shape)
        self.encoder = self.graph = None
        self._cls_scale: float | None = None
        if backend == "torch":
            self.encoder = encoder.to(self.device).eval().requires_grad_(False)
            self.spec, self.served_spec = feature_spec(encoder, self.feature), feature_spec(encoder, self.served)
        elif backend == "onnx":
            if self.feature != self.served:  # the graph outputs the served feature only; a CLS may be inside it
                if (self.feature, self.served) != ("cls_post_norm", "cls_patch_tokens"):
                    raise ValueError(f"cond.backend=onnx reads the graph's {self.served} only, not {self.feature}: "
                                     "use cond.backend=torch (the same weights) or cond.feature=served")
                self._cls_scale = float(self.num_patches) ** 0.5  # cls_patch_tokens scales its CLS by sqrt(N)
            self.graph = OrtGraph(self.info.onnx_path, device=str(self.device))  # as msn-serve runs it
        else:
            raise ValueError(f"backend must be 'torch' or 'onnx', got {backend!r}")

    @property
    def crop(self) -> int:
        return int(self.transform["crop"])

    def preprocess(self, images_uint8: Tensor) -> Tensor:
        """The bundle's evaluation preprocessing: uint8 (B, 3, H, W) -> normalised float (B, 3, crop, crop)."""
        return eval_transform(images_uint8.to(self.device), **self.transform)

    def model_view(self, images_uint8: Tensor) -> Tensor:
        """What the encoder sees, as uint8 (resize + centre crop, no normalisation): for display."""
        view = eval_transform(images_uint8.cpu(), resize=self.transform["resize"], crop=self.crop,
                              mean=[0.0] * 3, std=[1.0] * 3)
        return (view * 255).round().to(torch.uint8)

    @torch.no_grad()
    def embed(self, images_uint8: Tensor, keep_idx: Tensor | np.ndarray | None = None) -> Tensor:
        """``(B, D)`` features; ``keep_idx`` is ``(K,)`` for every image or ``(B, K)`` padded with ``-1``; ``None``
        keeps every patch."""
        return self._features(images_uint8, keep_idx, served=False)[0]

    @torch.no_grad()
    def embed_with_served(self, images_uint8: Tensor,
                          keep_idx: Tensor | np.ndarray | None = None) -> tuple[Tensor, Tensor]:
        """``(feature, served feature)`` of the same images from one forward pass (the same tensor twice when the
        decoder reads the served feature)."""
        feat, served = self._features(images_uint8, keep_idx, served=True)
        return feat, served

    def _features(self, images_uint8: Tensor, keep_idx: Tensor | np.ndarray | None, *, served: bool) -> list[Tensor]:
        pixels = self.preprocess(images_uint8)
        keep = as_keep_tensor(np.arange(self.num_patches) if keep_idx is None else keep_idx, pixels.shape[0]).cpu()
        if self.encoder is not None:
            keep = keep.to(self.device)
            _, keep_mask = encoder_keep_args(keep)
            specs = [self.spec] + ([self.served_spec] if served and self.served != self.feature else [])
            out = [f.float() for f in read_features(self.encoder, specs, pixels.float(), keep, keep_mask)]
            return out + out[:1] if served and len(out) == 1 else out
        graph_out = torch.from_numpy(self.graph.run(pixels.float().cpu().numpy(), keep.numpy())).to(self.device)
        own = graph_out if self._cls_scale is None else graph_out[:, : self.info.model_dim] / self._cls_scale
        return [own, graph_out] if served else [own]

    def embed_masked_batch(self, images_uint8: Tensor, *, mask_prob: float, ratio_min: float, ratio_max: float,
                           generator: torch.Generator | None = None) -> Tensor:
        """Training conditioning: each image is masked with probability ``mask_prob`` at a U[min, max] ratio."""
        batch = images_uint8.shape[0]
        masked = torch.rand(batch, generator=generator) < mask_prob
        ratios = masked * (ratio_min + (ratio_max - ratio_min) * torch.rand(batch, generator=generator))
        if not bool(masked.any()):
            return self.embed(images_uint8)
        return self.embed(images_uint8, random_keep_rows(batch, self.num_patches, ratios, generator))
