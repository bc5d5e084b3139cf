"""The rendered glyph folders (benchmarks/training/glyph_folders.py) and their section of docs/results.md."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.training import glyph_folders as gf

SIZES = (16, 28, 32)
TRAIN, TEST = 6, 3  # per class: two images per size


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("glyphs")
    gf.write_glyph_folders(root, SIZES, TRAIN, TEST)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.mode == "L"
        return np.asarray(image)


def test_the_same_seed_writes_the_same_bytes(data: Path, tmp_path: Path) -> None:
    gf.write_glyph_folders(tmp_path / "again", SIZES, TRAIN, TEST)
    assert _files(tmp_path / "again") == _files(data)
    gf.write_glyph_folders(tmp_path / "seed1", SIZES, TRAIN, TEST, seed=1)
    other = _files(tmp_path / "seed1")
    assert other.keys() == _files(data).keys() and other["flat/00000.png"] != _files(data)["flat/00000.png"]


def test_layout_and_counts_per_class(data: Path) -> None:
    names = [f"{i:05d}.png" for i in range(TRAIN * 10)]
    assert sorted(p.name for p in (data / "flat").iterdir()) == names
    nested = sorted(data.glob("nested/*/*/*.png"))
    assert sorted(p.name for p in nested) == names
    assert all(p.read_bytes() == (data / "flat" / p.name).read_bytes() for p in nested)
    for split, per_class in (("train", TRAIN), ("val", TEST)):
        classes = sorted(p.name for p in (data / "labelled" / split).iterdir())
        assert classes == list("0123456789")
        assert all(len(list((data / "labelled" / split / c).glob("*.png"))) == per_class for c in classes)
    record = json.loads((data / "images.json").read_text())
    assert (record["train"], record["test"], record["sizes"]) == (TRAIN * 10, TEST * 10, list(SIZES))
    assert record["fonts"] and len(record["fonts"]) == len(gf.available_fonts())


def test_every_class_has_images_at_every_size(data: Path) -> None:
    for split in ("train", "val"):
        seen = {(p.parent.name, _png(p).shape) for p in (data / "labelled" / split).glob("*/*.png")}
        assert seen == {(c, (s, s)) for c in "0123456789" for s in SIZES}


def test_glyphs_are_neither_blank_nor_clipped(data: Path) -> None:
    for path in sorted((data / "labelled").glob("*/*/*.png")):
        image = _png(path).astype(int)
        low, high = image.min(), image.max()
        assert high - low >= 100, path  # the contrast jitter keeps at least 130 levels
        fraction = (image > (low + high) / 2).mean()
        assert 0.02 <= fraction <= 0.45, (path, fraction)
        border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
        assert border.max() - low <= 2, path  # the glyph stays inside the margin


def test_the_trainer_lists_the_nested_folder_as_unlabelled_images(data: Path) -> None:
    from msn_core.sources import list_images

    nested = list_images("auto", data / "nested", split="train")  # what pretrain.py --data DIR does
    flat = list_images("auto", data / "flat", split="train")
    assert nested.source == flat.source == "folder" and not nested.labelled
    assert sorted(Path(n).name for n in nested.names) == sorted(flat.names)
    labelled = list_images("auto", data / "labelled", split="val")
    assert labelled.source == "image_folder" and labelled.classes == list("0123456789") and len(labelled) == TEST * 10


def test_without_system_fonts_pillows_own_font_is_used(tmp_path: Path) -> None:
    record = gf.write_glyph_folders(tmp_path / "data", (16,), 1, 1, font_root=tmp_path / "no-fonts")
    assert len(record["fonts"]) == 1 and record["fonts"][0].startswith(gf.DEFAULT_FONT)
    for path in (tmp_path / "data" / "labelled").glob("*/*/*.png"):
        image = _png(path).astype(int)
        assert 0.02 <= (image > (image.min() + image.max()) / 2).mean() <= 0.45


def test_dry_run_prints_the_plans_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gf.main(["--dry-run", "--workdir", str(tmp_path), "--layout", "flat", "nested"]) == 0
    out = capsys.readouterr().out
    assert not any(tmp_path.iterdir())
    pretrain = [line for line in out.splitlines() if "training/pretrain.py" in line]
    data = gf.data_dir(tmp_path.resolve(), SIZES)
    assert [line.split("--data ")[1].split()[0] for line in pretrain] == [str(data / "flat"), str(data / "nested")]
    assert all("--budget 10m" in line and "--config" not in line and "--set" not in line for line in pretrain)
    assert out.count("--shots 1 2 5 --splits 3") == 4 and out.count("--backend pixels") == 4
    assert out.count(f"--data {data / 'labelled'}") == 8
    assert out.count("[todo] write the glyph folders") == 2  # one set, shared by both plans


def test_other_folders_plans_are_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from benchmarks.training import other_folders

    assert other_folders.main(["--dry-run", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for size in (8, 32):
        work = tmp_path.resolve() / f"digits{size}-10m"
        assert f"--data {work / 'flat'} --budget 10m --output-dir {work / 'run'}" in out
        assert out.count(f"--data {work / 'labelled'}") == 4
    assert not any(tmp_path.iterdir())


def _report(budget: str, names: list[str]) -> dict:
    def lowshot(acc: float) -> dict:
        return {"results": [{"setting": f"{k}imgs_class", "mean": acc + k, "std": 0.5} for k in (1, 2, 5)]}

    images = {"train": 3000, "test": 1500, "sizes": [16, 28, 32], "fonts": ["DejaVuSans", "LiberationMono-Regular"]}
    folder = {"images": images, "config": {"model": {"arch": "vit_tiny", "image_size": 28, "patches_per_side": 4}},
              "run": {"steps": 2345, "collapse": None},
              "evals": {"flat-lowshot": lowshot(60.0), "flat-knn": {"results": [{"top1": 91.25}]},
                        "pixels-lowshot": lowshot(50.0), "pixels-knn": {"results": [{"top1": 88.0}]}}}
    return {"machine": {"cpu": "Test CPU", "cpu_count": 2}, "budget": budget, "folders": {n: folder for n in names}}


def test_the_glyph_section_renders_after_the_other_folders(tmp_path: Path) -> None:
    from benchmarks.render.own_images import glyph_folders_section
    from benchmarks.render.results_page import render

    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    assert glyph_folders_section(results) == ""
    assert "Rendered glyphs" not in render(tmp_path / "docs")
    (results / "other_folders-10m.json").write_text(json.dumps(_report("10m", ["digits8"])))
    (results / "glyph_folders-10m.json").write_text(json.dumps(_report("10m", ["glyphs-flat", "glyphs-nested"])))
    text = glyph_folders_section(results)
    assert "| glyphs-flat MSN | vit_tiny, 28 px, 4² patches | 2,345 | none | 61.0 ± 0.5 | 62.0 ± 0.5 | 65.0 ± 0.5 " \
           "| 91.2 |" in text
    assert "| glyphs-nested raw pixels | | | | 51.0 ± 0.5 | 52.0 ± 0.5 | 55.0 ± 0.5 | 88.0 |" in text
    assert "2 fonts (DejaVuSans, LiberationMono-Regular)" in text and "16/28/32 px" in text and "Test CPU" in text
    page = render(tmp_path / "docs")
    assert page.index("## Other small images") < page.index("## Rendered glyphs") < page.index("| glyphs-flat MSN")


def test_the_factor_table_names_how_each_image_was_drawn(data: Path) -> None:
    """benchmarks/training/glyph_factors.py: each row re-renders its own file, byte for byte."""
    from benchmarks.training.glyph_factors import FACTORS, factor_classes, factor_table

    record = json.loads((data / "images.json").read_text())
    fonts = gf.available_fonts()
    for split in ("train", "val"):
        files, rows = factor_table(data, split)
        assert len(files) == record["train" if split == "train" else "test"] == len(rows)
        for path, row in list(zip(files, rows))[::7]:
            assert path.parent.name == record["classes"][int(row[0])]
            factors = dict(zip(FACTORS, row))
            jitter = gf.Jitter(factors["height"], factors["rotation"], factors["shear"], factors["stroke"],
                               (factors["shift_x"], factors["shift_y"]), int(factors["background"]),
                               int(factors["foreground"]))
            image = gf.render_glyph(record["classes"][int(row[0])], fonts[int(factors["font"])],
                                    record["sizes"][int(factors["size"])], jitter)
            assert np.array_equal(image, _png(path))
    train_y, test_y = factor_classes(factor_table(data, "train")[1], factor_table(data, "val")[1])
    background = FACTORS.index("background")
    assert train_y.shape[1] == test_y.shape[1] == len(FACTORS)
    assert set(np.unique(train_y[:, background])) == {0, 1, 2, 3} >= set(np.unique(test_y[:, background]))
    assert set(np.unique(train_y[:, 0])) == set(range(10))
