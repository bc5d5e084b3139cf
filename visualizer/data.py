"""What a decoder trains on, and the held-out images its quality figure and sample grids use.

Sources are pretraining's (:mod:`msn_core.sources`, ``training.data``): ``fashion-mnist`` and ``synthetic`` in
memory, or images on disk (``auto``: a flat or nested folder, ``root/<class>/...``, a file list or a pattern). A
decoder needs no labels, so an unlabelled folder trains like any other; only class consistency needs them.

Held-out images are the source's own split when it has one (Fashion-MNIST's test set, ``root/val`` or
``root/test``). Otherwise ``data.holdout_images`` images (at most a tenth of the listing) are left out of training:
those whose relative names hash lowest. A hash of the name, not a seeded draw, so every rank, every resume and every
seed hold out the same files, and adding images to the folder moves few of them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from torch.utils.data import Dataset

from msn_core.sources import FILE_SOURCES, SPLIT_FOLDERS, SourceListing, list_images, relabel
from training.api import ImageListDataset, build_dataset
from visualizer.config import RCDMConfig

__all__ = ["HOLDOUT_MAX_FRACTION", "DecoderData", "decoder_data", "split_holdout"]

log = logging.getLogger("msn.visualize")
HOLDOUT_MAX_FRACTION = 0.1  # a small folder keeps most of its images for training


@dataclass(frozen=True)
class DecoderData:
    """``train`` feeds the decoder; ``held_out`` (None: there is none) is never trained on. ``held_out_from`` says
    where the held-out images come from, for logs and the quality record."""

    train: Dataset
    held_out: Dataset | None
    held_out_from: str

    @property
    def labelled(self) -> bool:
        """Whether class consistency can be measured: both sets carry labels."""
        held = self.held_out if self.held_out is not None else self.train
        return getattr(self.train, "labels", None) is not None and getattr(held, "labels", None) is not None


def _subset(listing: SourceListing, indices: list[int]) -> SourceListing:
    labels = [listing.labels[i] for i in indices] if listing.labels is not None else None
    return replace(listing, names=[listing.names[i] for i in indices], files=[listing.files[i] for i in indices],
                   labels=labels)


def split_holdout(listing: SourceListing, wanted: int) -> tuple[SourceListing, SourceListing | None]:
    """``(train, held_out)``: the ``min(wanted, len // 10)`` images whose names hash lowest are held out (listing
    order kept on both sides); ``held_out`` is None when that is no image."""
    count = min(wanted, int(len(listing) * HOLDOUT_MAX_FRACTION))
    if count <= 0:
        return listing, None
    def rank(i: int) -> bytes:
        return hashlib.blake2b(listing.names[i].encode(), digest_size=8).digest()

    order = sorted(range(len(listing)), key=rank)
    held = sorted(order[:count])
    kept = sorted(order[count:])
    return _subset(listing, kept), _subset(listing, held)


def _on_disk(cfg: RCDMConfig, load_size: int) -> DecoderData:
    data = cfg.data
    train = list_images(data.source, data.root, split="train")
    has_split = train.source in ("folder", "image_folder") and any(
        (Path(data.root) / name).is_dir() for name in SPLIT_FOLDERS["val"])
    val = list_images(train.source, data.root, split="val") if has_split else None
    if val is not None:
        if train.labels is not None and val.labels is not None:
            val = relabel(val, train.classes)  # label k means the same class on both sides
        held_from = f"{len(val):,} images of {val.base}"
    else:
        train, val = split_holdout(train, data.holdout_images)
        held_from = (f"{len(val):,} of the {len(train) + len(val):,} images held out of training (no val split; "
                     "data.holdout_images)") if val is not None else "none (no val split; data.holdout_images)"
    log.info("decoder data: %s; held out: %s", train.describe(), held_from)
    if train.labels is None:
        log.info("decoder data: no labels, which the decoder does not need; class consistency will not be measured")
    held = ImageListDataset(val, load_size=load_size) if val is not None else None
    return DecoderData(ImageListDataset(train, load_size=load_size), held, held_from)


def decoder_data(cfg: RCDMConfig, load_size: int) -> DecoderData:
    """The run's training and held-out images (see the module docstring)."""
    data = cfg.data
    if data.source in FILE_SOURCES:
        return _on_disk(cfg, load_size)
    train = build_dataset(data.source, root=data.root, split="train", load_size=load_size,
                          synthetic_size=data.synthetic_size, seed=cfg.run.seed)
    try:
        held = build_dataset(data.source, root=data.root, split="test", load_size=load_size,
                             synthetic_size=data.synthetic_size, seed=cfg.run.seed)
    except (FileNotFoundError, ValueError):
        return DecoderData(train, None, "none (the source has no test split)")
    return DecoderData(train, held, f"{len(held):,} images of the {data.source} test split")
