"""Fixed, seeded, class-balanced labelled subsets for low-shot evaluation, stored as text files.

As the official MSN repo ships ``imagenet_subsets{1,2,3}/{1,2,5}imgs_class.txt`` and ``1percent.txt``, we ship
``splits/<dataset>/{1,2,5}imgs_class_split{1,2,3}.txt`` and ``1percent_split{1,2,3}.txt``. Our files hold one
dataset index per line (``#`` lines are comments). ImageNet-style files, one file name per line whose class is the
prefix before ``_`` (``n04235860_14959.JPEG``), are read too and resolved against an image folder.

Within a split the subsets are nested: split ``s`` draws one permutation per class from ``seed = s`` and every
subset takes its first ``n`` members, so the 1-shot images are among the 2-shot images, and so on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_SHOTS",
    "class_balanced_indices",
    "percent_indices",
    "read_subset_file",
    "resolve_subset",
    "split_file_name",
    "standard_subsets",
    "write_index_file",
    "write_splits",
]

DEFAULT_SHOTS: tuple[int, ...] = (1, 2, 5)
DEFAULT_SPLITS: tuple[int, ...] = (1, 2, 3)
PERCENT_TAG = "1percent"
REPO_SPLITS = Path(__file__).resolve().parents[2] / "splits"


def split_file_name(shots: int | str, split: int) -> str:
    """``1imgs_class_split2.txt`` for 1 image per class, ``1percent_split2.txt`` for ``shots="1percent"``."""
    tag = PERCENT_TAG if shots == PERCENT_TAG else f"{int(shots)}imgs_class"
    return f"{tag}_split{split}.txt"


def _class_permutations(labels: np.ndarray, seed: int) -> dict[int, np.ndarray]:
    """One seeded permutation of each class's (ascending) indices; classes visited in sorted order."""
    rng = np.random.default_rng(seed)
    return {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)}


def class_balanced_indices(labels: Sequence[int] | np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Sorted indices of ``per_class`` samples of every class, drawn with ``seed``; nested across ``per_class``."""
    labels = np.asarray(labels)
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    chosen = []
    for c, members in _class_permutations(labels, seed).items():
        if len(members) < per_class:
            raise ValueError(f"class {c} has {len(members)} samples, fewer than {per_class}")
        chosen.append(members[:per_class])
    return np.sort(np.concatenate(chosen))


def percent_indices(labels: Sequence[int] | np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of ``round(fraction * n_c)`` (at least 1) samples of each class ``c``, drawn with ``seed``."""
    labels = np.asarray(labels)
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    chosen = [members[: max(1, round(fraction * len(members)))]
              for members in _class_permutations(labels, seed).values()]
    return np.sort(np.concatenate(chosen))


def write_index_file(path: str | os.PathLike, indices: np.ndarray, header: str = "") -> None:
    """Write one index per line, after optional ``#`` header lines."""
    lines = [f"# {line}" for line in header.splitlines()] + [str(int(i)) for i in indices]
    Path(path).write_text("\n".join(lines) + "\n")


def write_splits(labels: Sequence[int] | np.ndarray, out_dir: str | os.PathLike, *, dataset: str,
                 shots: Sequence[int] = DEFAULT_SHOTS, splits: Sequence[int] = DEFAULT_SPLITS,
                 percent: float = 0.01) -> list[Path]:
    """Write the low-shot subset files of one dataset's training labels; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split in splits:
        for n in shots:
            path = out / split_file_name(n, split)
            header = f"{dataset} train indices: {n} per class, seed {split}"
            write_index_file(path, class_balanced_indices(labels, n, seed=split), header)
            written.append(path)
        path = out / split_file_name(PERCENT_TAG, split)
        header = f"{dataset} train indices: {percent:.0%} of each class, seed {split}"
        write_index_file(path, percent_indices(labels, percent, seed=split), header)
        written.append(path)
    return written


def read_subset_file(path: str | os.PathLike) -> list[str]:
    """Non-empty, non-comment lines of a subset file, stripped."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def resolve_subset(path: str | os.PathLike, dataset) -> np.ndarray:
    """Dataset indices named by a subset file: an index list, or ImageNet-style file names.

    File names are matched against ``dataset.samples`` (``(relative_path, label)`` pairs, as an image folder has)
    by relative path or base name; when a name's class prefix (before ``_``) is a class folder of the dataset,
    the sample's label must agree with it.
    """
    entries = read_subset_file(path)
    if not entries:
        raise ValueError(f"subset file {path} lists no samples")
    if all(entry.isdigit() for entry in entries):
        indices = np.array([int(e) for e in entries], dtype=np.int64)
        if indices.max() >= len(dataset):
            raise IndexError(f"subset file {path} names index {indices.max()} but the dataset has {len(dataset)}")
        return indices
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise ValueError(f"subset file {path} lists file names but the dataset has no file list (.samples)")
    by_path = {os.path.normpath(p): i for i, (p, _) in enumerate(samples)}
    by_name = {os.path.basename(p): i for i, (p, _) in enumerate(samples)}
    class_to_idx = getattr(dataset, "class_to_idx", {})
    indices, missing = [], []
    for entry in entries:
        index = by_path.get(os.path.normpath(entry), by_name.get(os.path.basename(entry)))
        if index is None:
            missing.append(entry)
            continue
        prefix = os.path.basename(entry).split("_", 1)[0]
        if prefix in class_to_idx and class_to_idx[prefix] != samples[index][1]:
            raise ValueError(f"{entry}: class prefix {prefix!r} disagrees with its folder in the dataset")
        indices.append(index)
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(entries)} entries of {path} are not in the dataset, "
                                f"e.g. {missing[:3]}")
    return np.array(indices, dtype=np.int64)


def standard_subsets(train, data: str, *, shots: Sequence[str], splits: int,
                     shipped: Path = REPO_SPLITS) -> dict[str, list[np.ndarray]]:
    """``{setting: [indices of split 1, ...]}``: the shipped split files of ``data`` where they exist (``splits/
    fashion-mnist``), else the same seeded draws that wrote them. ``shots`` are counts or ``"1percent"``."""
    labels = np.asarray(train.labels)
    directory = shipped / data if Path(data).name == data and (shipped / data).is_dir() else None
    subsets: dict[str, list[np.ndarray]] = {}
    for shot in shots:
        name = PERCENT_TAG if shot == PERCENT_TAG else f"{int(shot)}imgs_class"
        chosen = []
        for split in range(1, splits + 1):
            path = directory / split_file_name(shot, split) if directory else None
            if path is not None and path.is_file():
                chosen.append(resolve_subset(path, train))
            elif shot == PERCENT_TAG:
                chosen.append(percent_indices(labels, 0.01, seed=split))
            else:
                chosen.append(class_balanced_indices(labels, int(shot), seed=split))
        subsets[name] = chosen
    return subsets


def main(argv: Sequence[str] | None = None) -> None:
    """Regenerate ``splits/fashion-mnist`` (``python -m training.evaluation.splits [--out DIR] [--root IDX_DIR]``)."""
    import argparse

    from training.data import FashionMNIST

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default="splits/fashion-mnist")
    parser.add_argument("--root", default=None, help="directory of the Fashion-MNIST idx files")
    args = parser.parse_args(argv)
    for path in write_splits(FashionMNIST(args.root, split="train").labels, args.out, dataset="fashion-mnist"):
        print(path)


if __name__ == "__main__":
    main()
