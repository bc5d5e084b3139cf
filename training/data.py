"""Datasets, collation and the resumable distributed sampler for MSN pretraining and evaluation.

Workers only decode and resize every image to one fixed ``load_size`` and return uint8 CHW tensors; all random
augmentation runs batched on the training device (``training.views``). Keeping workers this cheap is what stops
data loading from starving the GPU, and uint8 batches cost a quarter of the host-to-device bandwidth of float32.

A sample is ``Sample(image uint8 (3, S, S), label int, num_skipped int)``; ``num_skipped`` counts unreadable files
that were replaced by the next readable one, so the training loop can sum and report them instead of crashing. The
label is -1 for images without one (an unlabelled folder or list). Which files a source holds is
``msn_core.sources``'s business; this module decodes them.
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from msn_core.sources import FILE_SOURCES, IMAGE_EXTENSIONS, SOURCES, SourceError, SourceListing, list_images

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Measured once over the 60,000 Fashion-MNIST training images (pixels / 255), replicated to the 3 channels the
# encoder sees: mean 0.286041, std 0.353024.
FASHION_MNIST_MEAN = (0.2860, 0.2860, 0.2860)
FASHION_MNIST_STD = (0.3530, 0.3530, 0.3530)

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)


class Sample(NamedTuple):
    image: Tensor  # uint8 (3, S, S)
    label: int
    num_skipped: int


def normalization_stats(source: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (mean, std) in [0, 1] units for a ``build_dataset`` source."""
    if source == "fashion-mnist":
        return FASHION_MNIST_MEAN, FASHION_MNIST_STD
    return IMAGENET_MEAN, IMAGENET_STD


# ----------------------------------------------------------------------------------------------------- decoding


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB, as ``msn-serve`` does (``msn_serve/embedding/preprocess.py``), so
    training, evaluation and serving see the same pixels.

    Pillow's own ``convert("RGB")`` clips 16/32-bit greyscale at 255 instead of rescaling, which turns most 16-bit
    PNGs white: ``I;16`` is divided by 257 and ``I`` by ``max(65535, its maximum)``; float images are taken as
    [0, 1] when they fit. Alpha is dropped, not composited, as torchvision's loader (the official code's) and
    ``msn-serve`` do: LA, RGBA and transparent palettes keep the colour stored under their alpha.
    """
    if image.mode.startswith("I") or image.mode == "F":
        array = np.asarray(image, dtype=np.float64)
        if image.mode.startswith("I;16"):
            array = array / 257.0
        elif image.mode == "I":
            array = array * (255.0 / max(65535.0, float(array.max(initial=0))))
        elif array.max(initial=0) <= 1.0:
            array = array * 255.0
        return Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8)).convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # palette transparency converts cleanly only through RGBA
    return image.convert("RGB")


def resize_center_crop(image: Image.Image, size: int) -> Image.Image:
    """Resize the shorter side to ``size`` (bicubic, Pillow antialiasing) and centre-crop ``size`` x ``size``."""
    width, height = image.size
    if (width, height) != (size, size):
        scale = size / min(width, height)
        new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        left, top = (new_w - size) // 2, (new_h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return image


def load_image(path: str | os.PathLike, size: int) -> Image.Image:
    """Decode, apply the EXIF orientation, convert to RGB, resize and centre-crop one file."""
    with Image.open(path) as image:
        # JPEG DCT scaling: decode at the smallest 1/2, 1/4, 1/8 scale that is still >= size (much faster).
        image.draft("RGB", (size, size))
        image.load()  # truncated files raise here rather than later
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - a malformed EXIF block leaves the pixels readable, as stored
            log.debug("ignoring the unreadable EXIF orientation of %s", path)
        return resize_center_crop(to_rgb(image), size)


def pil_to_tensor(image: Image.Image) -> Tensor:
    """RGB Pillow image -> uint8 (3, H, W) tensor."""
    return torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()


# ----------------------------------------------------------------------------------------------------- datasets


class ImageListDataset(Dataset):
    """The images of a ``msn_core.sources.SourceListing`` (folder, image folder or file list), decoded with Pillow
    in the loader workers.

    Unreadable files (corrupt, truncated, empty, missing, not an image) are replaced by the next readable file in
    the listing's order, wrapping around; the sample's ``num_skipped`` says how many files were stepped over.
    Known-bad indices are remembered per worker so they are decoded once. ``samples`` holds ``(name, label)`` pairs
    (label -1 when unlabelled) and ``labels`` is None for an unlabelled source.
    """

    def __init__(self, listing: SourceListing, *, load_size: int) -> None:
        self.root = Path(listing.base)
        self.source = listing.source
        self.load_size = load_size
        labels = listing.labels if listing.labels is not None else [-1] * len(listing.names)
        self.samples = list(zip(listing.names, labels))
        self.classes = list(listing.classes or [])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.labels = np.asarray(listing.labels, dtype=np.int64) if listing.labels is not None else None
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        for skipped in range(len(self.samples)):
            i = (index + skipped) % len(self.samples)
            if i in self._bad:
                continue
            name, label = self.samples[i]
            path = self.root / name
            try:
                image = load_image(path, self.load_size)
            except Exception as error:  # noqa: BLE001 - any undecodable file must not end the epoch
                self._bad.add(i)
                log.warning("skipping unreadable image %s: %s", path, error)
                continue
            return Sample(pil_to_tensor(image), label, skipped)
        raise RuntimeError(f"none of the {len(self.samples)} files under {self.root} could be decoded")


class ImageFolderDataset(ImageListDataset):
    """``root/<class>/**/<image>`` (ImageNet / ImageFolder layout); ``subset`` optionally names a text file
    restricting it: relative paths (``n01440764/n01440764_10026.JPEG``) or bare file names as in the official MSN
    ImageNet subsets (``n01440764_10026.JPEG``)."""

    def __init__(self, root: str | os.PathLike, *, load_size: int, subset: str | os.PathLike | None = None,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS) -> None:
        super().__init__(list_images("image_folder", root, subset=subset, extensions=extensions), load_size=load_size)


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Parse a gzip'd big-endian idx file (LeCun's MNIST format), checking the magic number and the length."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    found, = struct.unpack(">i", data[:4])
    if found != magic:
        raise ValueError(f"{path}: magic number {found}, expected {magic}; not an idx{magic & 0xFF} file")
    ndim = magic & 0xFF
    shape = struct.unpack(f">{ndim}i", data[4:4 + 4 * ndim])
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but holds {payload.size} bytes")
    return payload.reshape(shape)


class FashionMNIST(Dataset):
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` idx files; grey replicated to 3 channels."""

    classes = FASHION_MNIST_CLASSES

    def __init__(self, root: str | os.PathLike | None = None, *, split: str = "train", load_size: int = 28) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        root = Path(root or FASHION_MNIST_ROOT)
        prefix = "train" if split == "train" else "t10k"
        image_path = root / f"{prefix}-images-idx3-ubyte.gz"
        label_path = root / f"{prefix}-labels-idx1-ubyte.gz"
        for path in (image_path, label_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found; install the files with `apt-get install dataset-fashion-mnist` "
                    "or pass the directory holding the idx .gz files as root")
        self.images = _read_idx(image_path, 2051)
        self.labels = _read_idx(label_path, 2049).astype(np.int64)
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels in {root}")
        self.load_size = load_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        image = Image.fromarray(self.images[index])
        if image.size != (self.load_size, self.load_size):
            image = image.resize((self.load_size, self.load_size), Image.Resampling.BICUBIC)
        grey = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True))
        return Sample(grey.expand(3, -1, -1).contiguous(), int(self.labels[index]), 0)


class SyntheticDataset(Dataset):
    """Deterministic class-structured images for tests and smoke runs, generated from the index alone.

    Class ``c`` is a grating whose orientation, frequency and colour depend on ``c``; the phase, a small
    brightness change and pixel noise are per-sample. Any worker produces the same sample for the same index.
    """

    def __init__(self, size: int = 512, *, num_classes: int = 10, load_size: int = 32, seed: int = 0) -> None:
        if size < 1 or num_classes < 1:
            raise ValueError("size and num_classes must be positive")
        self.size, self.num_classes, self.load_size, self.seed = size, num_classes, load_size, seed
        self.labels = np.arange(size, dtype=np.int64) % num_classes
        self.classes = tuple(f"class_{c}" for c in range(num_classes))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.size:
            raise IndexError(index)
        label = int(self.labels[index])
        rng = np.random.default_rng([self.seed, index])
        s = self.load_size
        y, x = np.mgrid[0:s, 0:s].astype(np.float32) / s
        angle = np.pi * label / self.num_classes
        frequency = 2.0 + 3.0 * (label % 3)
        phase = rng.uniform(0, 2 * np.pi)
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * frequency * (x * np.cos(angle) + y * np.sin(angle)) + phase)
        hue = 2 * np.pi * label / self.num_classes
        colour = 0.5 + 0.45 * np.cos(hue + np.array([0.0, 2.1, 4.2], dtype=np.float32))
        image = wave[None] * colour[:, None, None] * rng.uniform(0.7, 1.0)
        image = image + rng.normal(0.0, 0.05, size=image.shape)
        image = np.clip(np.rint(image * 255), 0, 255).astype(np.uint8)
        return Sample(torch.from_numpy(image), label, 0)


def build_dataset(source: str, *, root: str | None = None, split: str = "train", load_size: int,
                  synthetic_size: int = 512, synthetic_classes: int = 10, seed: int = 0,
                  subset: str | None = None, image_root: str | None = None) -> Dataset:
    """Build the dataset named by ``source``: one of ``msn_core.sources.SOURCES``.

    On-disk sources (``auto``, ``folder``, ``image_folder``, ``file_list``) are listed by
    ``msn_core.sources.list_images``: for folders, ``split`` is a subfolder of ``root`` when it exists
    (``root/train``; ``root/val`` or ``root/test``), otherwise ``root`` itself; ``image_root`` is where a file
    list's relative paths point.
    """
    if source in FILE_SOURCES:
        if root is None:
            raise ValueError(f"source {source!r} needs root (a folder of images or a file list)")
        listing = list_images(source, root, split=split, image_root=image_root, subset=subset)
        log.info("data (%s): %s", split, listing.describe())
        return ImageListDataset(listing, load_size=load_size)
    if source == "fashion-mnist":
        return FashionMNIST(root, split=split, load_size=load_size)
    if source == "synthetic":
        split_seed = seed if split == "train" else seed + 1_000_003
        return SyntheticDataset(synthetic_size, num_classes=synthetic_classes, load_size=load_size, seed=split_seed)
    raise ValueError(f"unknown dataset source {source!r}; expected {', '.join(SOURCES)}")


# ------------------------------------------------------------------------------------------- batching, sampling


def collate_views(batch: Sequence[Sample | tuple | dict]) -> tuple[Tensor, Tensor, int]:
    """Stack samples into ``(images uint8 (B,3,S,S), labels int64 (B,), total num_skipped)``."""
    if isinstance(batch[0], dict):
        batch = [(s["image"], s["label"], s.get("num_skipped", 0)) for s in batch]
    images = torch.stack([sample[0] for sample in batch])
    labels = torch.tensor([int(sample[1]) for sample in batch], dtype=torch.int64)
    return images, labels, sum(int(sample[2]) for sample in batch)


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler(shuffle=True, drop_last=True)`` that can resume exactly in the middle of an epoch.

    Every rank draws the same permutation from ``torch.Generator().manual_seed(seed + epoch)``, drops the tail
    that does not divide evenly, and takes the strided slice ``rank::world_size``. ``set_start_index(n)`` skips the
    first ``n`` indices of this rank's order for the current epoch; ``set_epoch`` resets it to 0, so call
    ``set_epoch`` first and ``set_start_index`` second when resuming.
    """

    def __init__(self, dataset_size: int | Dataset, *, rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        self.dataset_size = dataset_size if isinstance(dataset_size, int) else len(dataset_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_samples = self.dataset_size // world_size  # per rank, whole epoch
        if self.num_samples == 0:
            raise ValueError(f"{self.dataset_size} samples cannot be split over {world_size} ranks")
        self.epoch = 0
        self.start_index = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start_index = 0

    def set_start_index(self, start_index: int) -> None:
        if not 0 <= start_index <= self.num_samples:
            raise ValueError(f"start index {start_index} outside [0, {self.num_samples}]")
        self.start_index = start_index

    def epoch_order(self) -> list[int]:
        """This rank's full index order for the current epoch, ignoring the start index."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        permutation = torch.randperm(self.dataset_size, generator=generator)
        return permutation[: self.num_samples * self.world_size][self.rank :: self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order()[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


def build_loader(dataset: Dataset, *, batch_size: int, num_workers: int, rank: int, world_size: int, seed: int,
                 pin_memory: bool) -> tuple[DataLoader, ResumableDistributedSampler]:
    """DataLoader over ``ResumableDistributedSampler`` with full batches only and persistent workers."""
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world_size, seed=seed)
    if sampler.num_samples < batch_size:
        raise SourceError(f"{len(dataset)} samples over {world_size} rank(s) give {sampler.num_samples} per rank, "
                          f"fewer than one batch of {batch_size} (data.batch_size is per process)")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_views,
        pin_memory=pin_memory,
        drop_last=True,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        # Its own generator: creating an iterator must not draw from the global RNG, which drives the
        # augmentations and is checkpointed for exact resume.
        generator=torch.Generator().manual_seed(seed + rank),
    )
    return loader, sampler
