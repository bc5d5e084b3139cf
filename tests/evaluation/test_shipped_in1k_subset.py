"""The shipped ImageNet-1k 1 % list (SimCLR's, splits/README.md) is the file the README names, unchanged, and the
low-shot resolver reads it against an ImageNet-style folder listing."""

from __future__ import annotations

import hashlib
from pathlib import Path

from training.evaluation.splits import read_subset_file, resolve_subset

SPLITS = Path(__file__).resolve().parents[2] / "splits"
SUBSET = SPLITS / "in1k_1percent.txt"


class FolderListing:
    """What ``resolve_subset`` reads from an image folder: ``samples`` and ``class_to_idx`` (no files needed)."""

    def __init__(self, names: list[str]) -> None:
        wnids = sorted({name.split("_", 1)[0] for name in names})
        self.class_to_idx = {wnid: i for i, wnid in enumerate(wnids)}
        self.samples = [(f"{name.split('_', 1)[0]}/{name}", self.class_to_idx[name.split("_", 1)[0]])
                        for name in sorted(names)]


def test_in1k_1percent_is_simclrs_list_and_resolves() -> None:
    digest = hashlib.sha256(SUBSET.read_bytes()).hexdigest()
    assert digest in (SPLITS / "README.md").read_text()  # the checksum the README cites
    assert "Apache License" in (SPLITS / "LICENSE-simclr.txt").read_text()
    names = read_subset_file(SUBSET)
    per_class: dict[str, int] = {}
    for name in names:
        per_class[name.split("_", 1)[0]] = per_class.get(name.split("_", 1)[0], 0) + 1
    assert len(names) == len(set(names)) == 12_811 and len(per_class) == 1000
    assert set(per_class.values()) == {12, 13}
    listing = FolderListing(names + ["n01440764_99999999.JPEG"])  # one image the subset does not name
    indices = resolve_subset(SUBSET, listing)
    chosen = {Path(listing.samples[i][0]).name for i in indices}
    assert len(indices) == 12_811 and chosen == set(names) and "n01440764_99999999.JPEG" not in chosen
