from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from training.evaluation import splits

REPO_SPLITS = Path(__file__).resolve().parents[2] / "splits" / "fashion-mnist"
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")


def _indices(path: Path) -> np.ndarray:
    return np.array([int(x) for x in splits.read_subset_file(path)])


@pytest.fixture(scope="module")
def fmnist_labels() -> np.ndarray:
    if not FMNIST.is_file():
        pytest.skip("Fashion-MNIST idx files not installed")
    from training.data import FashionMNIST

    return FashionMNIST(split="train").labels


def test_shipped_splits_regenerate_identically(fmnist_labels, tmp_path):
    written = splits.write_splits(fmnist_labels, tmp_path, dataset="fashion-mnist")
    assert len(written) == 12
    for path in written:
        assert path.read_bytes() == (REPO_SPLITS / path.name).read_bytes(), path.name


@pytest.mark.parametrize("split", [1, 2, 3])
def test_shipped_splits_are_class_balanced_and_nested(fmnist_labels, split):
    previous: set[int] = set()
    for shots in (1, 2, 5):
        idx = _indices(REPO_SPLITS / splits.split_file_name(shots, split))
        assert len(set(idx)) == len(idx) == 10 * shots
        assert Counter(fmnist_labels[idx].tolist()) == {c: shots for c in range(10)}
        assert previous <= set(idx.tolist())
        previous = set(idx.tolist())
    percent = _indices(REPO_SPLITS / splits.split_file_name("1percent", split))
    assert Counter(fmnist_labels[percent].tolist()) == {c: 60 for c in range(10)}  # 1 % of 6000 per class


def test_splits_differ_between_seeds():
    a, b = (_indices(REPO_SPLITS / splits.split_file_name(5, s)) for s in (1, 2))
    assert set(a.tolist()) != set(b.tolist())


def test_class_balanced_indices_deterministic_and_validated():
    labels = np.repeat(np.arange(4), 7)
    a = splits.class_balanced_indices(labels, 3, seed=5)
    assert np.array_equal(a, splits.class_balanced_indices(labels, 3, seed=5))
    assert np.array_equal(np.bincount(labels[a]), [3, 3, 3, 3])
    with pytest.raises(ValueError):
        splits.class_balanced_indices(labels, 8, seed=0)
    assert np.array_equal(np.bincount(labels[splits.percent_indices(labels, 0.01, seed=0)]), [1, 1, 1, 1])


class _Folder:
    """Stands in for ImageFolderDataset: samples and class_to_idx."""

    def __init__(self) -> None:
        self.class_to_idx = {"n01": 0, "n02": 1}
        self.samples = [("n01/n01_1.JPEG", 0), ("n01/n01_2.JPEG", 0), ("n02/n02_7.JPEG", 1)]

    def __len__(self) -> int:
        return len(self.samples)


def test_resolve_imagenet_style_and_index_files(tmp_path):
    names = tmp_path / "1imgs_class.txt"
    names.write_text("n02_7.JPEG\nn01/n01_2.JPEG\n\n")
    assert splits.resolve_subset(names, _Folder()).tolist() == [2, 1]
    index_file = tmp_path / "idx.txt"
    splits.write_index_file(index_file, np.array([2, 0]), header="two samples")
    assert index_file.read_text().startswith("# two samples\n")
    assert splits.resolve_subset(index_file, _Folder()).tolist() == [2, 0]


def test_resolve_rejects_missing_and_mislabelled(tmp_path):
    missing = tmp_path / "missing.txt"
    missing.write_text("n01_1.JPEG\nn01_99.JPEG\n")
    with pytest.raises(FileNotFoundError):
        splits.resolve_subset(missing, _Folder())
    folder = _Folder()
    folder.samples = [("n02/n01_1.JPEG", 1)]  # file name says n01, folder says n02
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("n01_1.JPEG\n")
    with pytest.raises(ValueError, match="disagrees"):
        splits.resolve_subset(wrong, folder)
    too_big = tmp_path / "big.txt"
    too_big.write_text("3\n")
    with pytest.raises(IndexError):
        splits.resolve_subset(too_big, _Folder())
