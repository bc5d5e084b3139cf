"""Batched feature extraction from an exported bundle, with ONNX Runtime or the torch encoder, cached on disk.

Every image goes through the bundle's evaluation preprocessing (resize shorter side, centre crop, normalise). An
optional masking ratio drops patches before the trunk: dataset image ``i`` gets the mask spec
``{"ratio": mask_ratio, "seed": [mask_seed, i]}`` of :mod:`msn_core.masks` (the patches ``/embed`` keeps for that
spec), so features do not depend on batch size, order or backend. Results are cached as ``.npz`` files keyed by
the bundle's content hash, the dataset's identity, the selected indices, the preprocessing, the feature, the
backend and the mask settings, and written atomically (msn_core.durable), so a sweep embeds once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from msn_core.bundle import ONNX_FILE, Preprocessing, load_bundle_info
from msn_core.durable import atomic_write
from msn_core.inference import OrtGraph
from msn_core.masks import random_keep
from training.data import collate_views
from training.masking import encoder_keep_args
from training.model.load import load_encoder
from training.model.readout import feature_spec, read_feature
from training.views import eval_transform

__all__ = [
    "BACKENDS",
    "Embedder",
    "Features",
    "OnnxEmbedder",
    "PixelEmbedder",
    "TorchEmbedder",
    "bundle_fingerprint",
    "dataset_identity",
    "extract_features",
    "keep_indices",
    "load_embedder",
]

BACKENDS = ("onnx", "torch", "pixels")
CACHE_VERSION = 1


class Embedder(Protocol):
    """Maps normalised images ``(B,3,H,W)`` and kept-patch indices ``(B,K)`` to features ``(B,D)``.

    ``-1`` in the indices is padding.
    """

    backend: str
    feature: str
    patch_size: int

    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray: ...


class OnnxEmbedder:
    """The bundle's ``model.onnx`` under ONNX Runtime; its output is the bundle's ``feature``.

    The graph runs as the service runs it (:class:`msn_core.inference.OrtGraph`: same session settings, same CUDA
    provider). ``model_path`` runs another graph with the same contract instead (the int8 graph, or one being
    checked before it is added to the bundle); ``intra_op_threads`` 0 = every CPU this process may use (set it when
    ranks share cores)."""

    backend = "onnx"

    def __init__(self, bundle_dir: str | os.PathLike, *, feature: str | None = None, device: str = "cpu",
                 intra_op_threads: int = 0, model_path: str | os.PathLike | None = None) -> None:
        info = load_bundle_info(bundle_dir, need=(ONNX_FILE,))
        self.feature = info.feature
        if feature is not None and feature != self.feature:
            raise ValueError(f"the bundle's ONNX model outputs {self.feature!r}, not {feature!r}; "
                             "use the torch backend for another feature")
        self.patch_size = info.patch_size
        self.graph = OrtGraph(model_path or info.onnx_path, device=device, intra_op_threads=intra_op_threads)

    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        return self.graph.run(pixel_values, keep_idx)


class TorchEmbedder:
    """A torch ``VisionTransformer`` (from the bundle's ``encoder.safetensors`` or given directly)."""

    backend = "torch"

    def __init__(self, encoder: torch.nn.Module, *, feature: str = "cls_pre_norm", device: str = "cpu") -> None:
        self.spec = feature_spec(encoder, feature)  # FeatureError (a ValueError) names the valid features
        self.encoder = encoder.to(device).eval()
        self.feature, self.device = feature, torch.device(device)
        self.patch_size = int(encoder.patch_size)

    @classmethod
    def from_bundle(cls, bundle_dir: str | os.PathLike, *, feature: str | None = None,
                    device: str = "cpu") -> TorchEmbedder:
        encoder, info = load_encoder(bundle_dir)
        return cls(encoder, feature=feature or info.feature, device=device)

    @torch.inference_mode()
    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        images = torch.from_numpy(pixel_values).to(self.device)
        keep_idx_t = torch.from_numpy(keep_idx).to(self.device)
        _, keep_mask = encoder_keep_args(keep_idx_t)
        return read_feature(self.encoder, self.spec, images, keep_idx_t, keep_mask).float().cpu().numpy()


class PixelEmbedder:
    """Raw-pixel baseline: the flattened preprocessed image. Masking is not defined for it."""

    backend = "pixels"
    feature = "pixels"

    def __init__(self, patch_size: int = 1) -> None:
        self.patch_size = patch_size

    def __call__(self, pixel_values: np.ndarray, keep_idx: np.ndarray) -> np.ndarray:
        return pixel_values.reshape(len(pixel_values), -1).copy()


def load_embedder(bundle_dir: str | os.PathLike, backend: str = "onnx", *, feature: str | None = None,
                  device: str = "cpu", threads: int = 0) -> Embedder:
    """The embedder named by ``backend``: ``onnx`` | ``torch`` | ``pixels`` (bundle only gives preprocessing).

    ``threads`` sets ONNX Runtime's intra-op threads (0: every CPU this process may use).
    """
    if backend == "onnx":
        return OnnxEmbedder(bundle_dir, feature=feature, device=device, intra_op_threads=threads)
    if backend == "torch":
        return TorchEmbedder.from_bundle(bundle_dir, feature=feature, device=device)
    if backend == "pixels":
        return PixelEmbedder(load_bundle_info(bundle_dir).patch_size)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


# ------------------------------------------------------------------------------------------------- identity


def _sha256_file(path: Path, digest) -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def bundle_fingerprint(bundle_dir: str | os.PathLike) -> str:
    """sha256 over the names and contents of every regular file in the bundle directory."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(bundle_dir).iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        _sha256_file(path, digest)
    return digest.hexdigest()


def dataset_identity(dataset) -> str:
    """A string that changes when the dataset's content or decoding changes (cheap: no image decoding)."""
    name = type(dataset).__name__
    load_size = getattr(dataset, "load_size", None)
    if isinstance(getattr(dataset, "images", None), np.ndarray):  # in-memory arrays: hash the content
        digest = hashlib.sha256(np.ascontiguousarray(dataset.images).data)
        digest.update(np.ascontiguousarray(dataset.labels).data)
        return f"{name}:{digest.hexdigest()}:load{load_size}"
    if hasattr(dataset, "samples"):  # image folder: root, file list and labels
        digest = hashlib.sha256(json.dumps(list(map(list, dataset.samples))).encode())
        return f"{name}:{Path(dataset.root).resolve()}:{digest.hexdigest()}:load{load_size}"
    params = {k: v for k, v in vars(dataset).items() if isinstance(v, (int, float, str, bool))}
    return f"{name}:{json.dumps(params, sort_keys=True)}:len{len(dataset)}"


# ------------------------------------------------------------------------------------------------ extraction


def keep_indices(indices: np.ndarray, num_patches: int, mask_ratio: float, seed: int) -> np.ndarray:
    """Kept-patch indices ``(B, K)``: dataset image ``i`` gets ``{"ratio": mask_ratio, "seed": [seed, i]}``."""
    if mask_ratio == 0:
        return np.broadcast_to(np.arange(num_patches, dtype=np.int64), (len(indices), num_patches)).copy()
    return np.stack([random_keep(num_patches, mask_ratio, [seed, int(i)]) for i in indices])


@dataclass
class Features:
    features: np.ndarray  # (n, D) float32
    labels: np.ndarray  # (n,) int64
    indices: np.ndarray  # (n,) dataset indices
    from_cache: bool = False


def _cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / f"features-{digest}.npz"


def _save(path: Path, key: dict, result: Features) -> None:
    atomic_write(path, lambda f: np.savez(f, features=result.features, labels=result.labels,
                                          indices=result.indices, key=np.array(json.dumps(key, sort_keys=True))))


def extract_features(dataset, embedder: Embedder, *, preprocessing: Preprocessing | Mapping,
                     indices: Sequence[int] | None = None,
                     batch_size: int = 64, mask_ratio: float = 0.0, mask_seed: int = 0,
                     cache_dir: str | os.PathLike | None = None, cache_tag: str | None = None,
                     num_workers: int = 0, progress: bool = True, desc: str = "embedding") -> Features:
    """Embed ``dataset[indices]`` (all samples by default) in batches.

    ``preprocessing`` is the bundle's ``{resize, crop, mean, std}``; the dataset should decode at ``load_size =
    resize``. ``cache_tag`` identifies the embedder's weights in the cache key (``bundle_fingerprint``); no cache
    is used unless both ``cache_dir`` and ``cache_tag`` are given.
    """
    idx = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    if len(idx) == 0:
        raise ValueError("no samples to embed")
    if isinstance(preprocessing, Preprocessing):
        preprocessing = preprocessing.to_dict()
    transform = {k: preprocessing[k] for k in ("resize", "crop", "mean", "std")}
    if mask_ratio and embedder.backend == "pixels":
        raise ValueError("masking is not defined for the raw-pixel baseline")
    crop = int(transform["crop"])
    num_patches = (crop // embedder.patch_size) ** 2
    path = key = None
    if cache_dir is not None and cache_tag is not None:
        key = {"version": CACHE_VERSION, "weights": cache_tag, "backend": embedder.backend,
               "feature": embedder.feature, "dataset": dataset_identity(dataset),
               "indices": hashlib.sha256(idx.tobytes()).hexdigest(), "transform": transform,
               "mask_ratio": float(mask_ratio), "mask_seed": int(mask_seed) if mask_ratio else None}
        path = _cache_path(Path(cache_dir), key)
        if path.is_file():
            with np.load(path) as cached:
                return Features(cached["features"], cached["labels"], cached["indices"], from_cache=True)

    loader = DataLoader(Subset(dataset, idx.tolist()), batch_size=batch_size, shuffle=False,
                        num_workers=num_workers, collate_fn=collate_views)
    chunks, labels, start = [], [], 0
    for images, batch_labels, _ in tqdm(loader, desc=desc, disable=not progress, leave=False):
        pixel_values = eval_transform(images, **transform).numpy()
        keep = keep_indices(idx[start:start + len(images)], num_patches, mask_ratio, mask_seed)
        chunks.append(np.asarray(embedder(pixel_values, keep), dtype=np.float32))
        labels.append(batch_labels.numpy())
        start += len(images)
    result = Features(np.concatenate(chunks), np.concatenate(labels).astype(np.int64), idx)
    if path is not None:
        _save(path, key, result)
    return result
