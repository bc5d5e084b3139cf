"""Datasets, decoding, collation, the resumable sampler and the loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training.data import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_ROOT,
    FashionMNIST,
    ImageFolderDataset,
    ResumableDistributedSampler,
    SyntheticDataset,
    build_dataset,
    build_loader,
    collate_views,
    normalization_stats,
)

LOAD = 16
HAVE_FMNIST = (Path(FASHION_MNIST_ROOT) / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST, reason=f"Fashion-MNIST idx files absent from {FASHION_MNIST_ROOT} (apt-get install "
                            "dataset-fashion-mnist)")


def _exif_jpeg(path: Path) -> None:
    """Landscape JPEG, left half red, right half blue, tagged 'rotate 90 degrees clockwise to display'."""
    array = np.zeros((20, 40, 3), np.uint8)
    array[:, :20] = (255, 0, 0)
    array[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(array).save(path, quality=95, exif=exif)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """12 files in 2 classes; files 3, 4 (truncated JPEG, empty file) and 8 (text named .jpg) are unreadable."""
    root = tmp_path_factory.mktemp("images")
    cat, dog = root / "cat", root / "dog"
    cat.mkdir()
    (dog / "nested").mkdir(parents=True)
    Image.new("RGB", (30, 20), (10, 200, 30)).save(cat / "00_rgb.png")
    Image.new("L", (20, 20), 77).save(cat / "01_grey.png")
    Image.new("RGBA", (20, 20), (255, 0, 0, 128)).save(cat / "02_rgba.png")
    Image.new("RGB", (64, 64), (1, 2, 3)).save(root / "full.jpg", quality=90)
    (cat / "03_truncated.jpg").write_bytes((root / "full.jpg").read_bytes()[:300])
    (root / "full.jpg").unlink()
    (cat / "04_empty.jpg").write_bytes(b"")
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(cat / "05_cmyk.jpg", quality=95)
    Image.fromarray(np.full((20, 24), 40000, np.uint16)).save(dog / "00_16bit.png")
    Image.new("P", (20, 20), 3).save(dog / "01_palette.gif")
    (dog / "02_text.jpg").write_text("this is not a JPEG")
    Image.new("RGB", (50, 20), (0, 0, 250)).save(dog / "03_wide.jpeg", quality=95)
    _exif_jpeg(dog / "04_exif.jpg")
    Image.new("RGB", (20, 20), (9, 9, 9)).save(dog / "nested" / "05_deep.png")
    (dog / "notes.txt").write_text("ignored: not an image extension")
    return root


def test_image_folder_decodes_every_mode(folder: Path) -> None:
    ds = ImageFolderDataset(folder, load_size=LOAD)
    assert len(ds) == 12 and ds.classes == ["cat", "dog"]
    assert ds.labels.tolist() == [0] * 6 + [1] * 6
    images = {Path(path).name: ds[i] for i, (path, _) in enumerate(ds.samples) if i not in (3, 4, 8)}
    for sample in images.values():
        assert sample.image.shape == (3, LOAD, LOAD) and sample.image.dtype == torch.uint8
        assert sample.num_skipped == 0

    def pixel(name: str) -> list[int]:
        return images[name].image[:, LOAD // 2, LOAD // 2].tolist()

    assert pixel("00_rgb.png") == [10, 200, 30]
    assert pixel("01_grey.png") == [77, 77, 77]
    assert pixel("02_rgba.png") == [255, 0, 0]  # alpha dropped, as msn-serve and torchvision's loader do
    assert pixel("00_16bit.png") == [156, 156, 156]  # 40000 / 65535 * 255, not clipped to 255
    red, green, blue = pixel("05_cmyk.jpg")
    assert red > 200 and green < 60 and blue < 60
    # EXIF orientation 6: the red left half becomes the top half, so the top row is red end to end.
    top = images["04_exif.jpg"].image[:, 0]
    assert top[0, 0] > 200 and top[0, -1] > 200 and top[2, -1] < 60


def test_unreadable_files_are_replaced_by_the_next_readable(folder: Path) -> None:
    ds = ImageFolderDataset(folder, load_size=LOAD)
    skipped = ds[3]  # truncated, then empty, then the CMYK JPEG
    assert skipped.num_skipped == 2 and skipped.label == 0
    assert torch.equal(skipped.image, ds[5].image)
    assert ds[4].num_skipped == 1
    text = ds[8]
    assert text.num_skipped == 1 and torch.equal(text.image, ds[9].image) and text.label == 1


def test_loader_runs_an_epoch_with_workers_and_counts_skips(folder: Path) -> None:
    ds = build_dataset("image_folder", root=str(folder), load_size=LOAD)
    loader, sampler = build_loader(ds, batch_size=4, num_workers=2, rank=0, world_size=1, seed=3, pin_memory=False)
    assert loader.persistent_workers and loader.drop_last
    expected_skips = {3: 2, 4: 1, 8: 1}
    for epoch in range(2):  # the second epoch reuses the persistent workers
        sampler.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 3
        assert all(images.shape == (4, 3, LOAD, LOAD) and images.dtype == torch.uint8 for images, _, _ in batches)
        assert sum(skips for _, _, skips in batches) == sum(expected_skips.values())
        labels = torch.cat([labels for _, labels, _ in batches])
        assert sorted(labels.tolist()) == sorted(ds[i].label for i in range(12))


def test_image_folder_errors_and_subset(tmp_path: Path, folder: Path) -> None:
    (tmp_path / "empty" / "class").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images"):
        ImageFolderDataset(tmp_path / "empty", load_size=LOAD)
    subset = tmp_path / "subset.txt"
    subset.write_text("05_cmyk.jpg\ndog/03_wide.jpeg\n\n")
    ds = ImageFolderDataset(folder, load_size=LOAD, subset=subset)
    assert [Path(p).name for p, _ in ds.samples] == ["05_cmyk.jpg", "03_wide.jpeg"]
    assert ds.labels.tolist() == [0, 1]
    subset.write_text("missing.jpg\n")
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        ImageFolderDataset(folder, load_size=LOAD, subset=subset)


def test_fashion_mnist_missing_files_say_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        FashionMNIST(tmp_path)


def test_fashion_mnist_rejects_a_bad_magic_number(tmp_path: Path) -> None:
    import gzip

    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write((2049).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\0")
    with pytest.raises(ValueError, match="magic number 2049, expected 2051"):
        FashionMNIST(tmp_path)


@needs_fmnist
def test_fashion_mnist_parses_both_splits() -> None:
    train, test = FashionMNIST(split="train"), FashionMNIST(split="test", load_size=32)
    assert (len(train), len(test)) == (60_000, 10_000)
    assert train.images.shape == (60_000, 28, 28) and len(train.classes) == 10
    assert train.classes[0] == "T-shirt/top" and train.classes[9] == "Ankle boot"
    for split, per_class in ((train, 6_000), (test, 1_000)):
        assert split.labels.min() == 0 and split.labels.max() == 9
        assert np.bincount(split.labels).tolist() == [per_class] * 10
    sample = train[0]
    assert sample.image.shape == (3, 28, 28) and sample.label == int(train.labels[0])
    assert torch.equal(sample.image[0], torch.from_numpy(train.images[0].copy()))
    assert torch.equal(sample.image[0], sample.image[2])
    assert test[5].image.shape == (3, 32, 32)
    mean = float(train.images[:5000].mean()) / 255
    assert abs(mean - FASHION_MNIST_MEAN[0]) < 0.01
    assert normalization_stats("fashion-mnist")[0] == FASHION_MNIST_MEAN


def test_synthetic_is_deterministic_and_class_structured() -> None:
    ds = build_dataset("synthetic", load_size=24, synthetic_size=40, synthetic_classes=4, seed=1)
    again = SyntheticDataset(40, num_classes=4, load_size=24, seed=1)
    assert isinstance(ds, SyntheticDataset) and len(ds) == 40
    assert all(torch.equal(ds[i].image, again[i].image) for i in (0, 7, 39))
    assert not torch.equal(ds[0].image, ds[4].image)  # same class, different sample
    assert ds[6].label == 2 and ds[6].image.shape == (3, 24, 24)
    # Classes are separable: nearest class-mean on mean colour classifies held-out samples.
    feats = torch.stack([ds[i].image.float().mean((1, 2)) for i in range(40)])
    labels = torch.as_tensor(ds.labels)
    centroids = torch.stack([feats[:20][labels[:20] == c].mean(0) for c in range(4)])
    predicted = torch.cdist(feats[20:], centroids).argmin(1)
    assert (predicted == labels[20:]).float().mean() >= 0.9
    test_split = build_dataset("synthetic", split="test", load_size=24, synthetic_size=40, synthetic_classes=4)
    assert not torch.equal(test_split[0].image, SyntheticDataset(40, num_classes=4, load_size=24)[0].image)
    with pytest.raises(ValueError, match="unknown dataset source"):
        build_dataset("cifar", load_size=24)


def test_collate_accepts_tuples_and_dicts() -> None:
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    images, labels, skipped = collate_views([(image, 1, 0), (image + 1, 2, 3)])
    assert images.shape == (2, 3, 4, 4) and labels.tolist() == [1, 2] and labels.dtype == torch.int64
    assert skipped == 3
    _, labels, skipped = collate_views([{"image": image, "label": 5, "num_skipped": 1}])
    assert labels.tolist() == [5] and skipped == 1


def test_sampler_rank_slices_are_disjoint_and_cover_the_epoch() -> None:
    samplers = [ResumableDistributedSampler(101, rank=r, world_size=3, seed=7) for r in range(3)]
    orders = [list(s) for s in samplers]
    assert all(len(order) == len(s) == 33 for order, s in zip(orders, samplers))
    together = [i for order in orders for i in order]
    assert len(set(together)) == 99 and set(together) <= set(range(101))
    single = ResumableDistributedSampler(10, seed=7)
    assert sorted(single) == list(range(10))


def test_sampler_epochs_differ_and_are_reproducible() -> None:
    sampler = ResumableDistributedSampler(50, rank=1, world_size=2, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    other = ResumableDistributedSampler(50, rank=1, world_size=2, seed=0)
    other.set_epoch(1)
    assert list(other) == second


def test_sampler_resume_mid_epoch_is_exact() -> None:
    uninterrupted = ResumableDistributedSampler(40, rank=0, world_size=2, seed=5)
    uninterrupted.set_epoch(3)
    full = list(uninterrupted)
    consumed = full[:8]  # two batches of 4 before the "crash"
    resumed = ResumableDistributedSampler(40, rank=0, world_size=2, seed=5)
    resumed.set_epoch(3)
    resumed.set_start_index(8)
    assert len(resumed) == 12
    assert consumed + list(resumed) == full
    resumed.set_epoch(4)  # the next epoch starts from the beginning again
    assert len(resumed) == 20
    with pytest.raises(ValueError):
        resumed.set_start_index(21)


def test_loader_resume_matches_uninterrupted_batches() -> None:
    ds = SyntheticDataset(24, num_classes=3, load_size=8)
    loader, sampler = build_loader(ds, batch_size=4, num_workers=0, rank=0, world_size=1, seed=2, pin_memory=False)
    sampler.set_epoch(1)
    full = [labels for _, labels, _ in loader]
    sampler.set_epoch(1)
    sampler.set_start_index(2 * 4)
    resumed = [labels for _, labels, _ in loader]
    assert len(full) == 6 and len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(full[2:], resumed))
    with pytest.raises(ValueError, match="fewer than one batch"):
        build_loader(ds, batch_size=16, num_workers=0, rank=0, world_size=2, seed=0, pin_memory=False)
