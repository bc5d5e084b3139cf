"""Every image source (folders, image folders, file lists), odd image modes, and the commands that read them:
``pretrain.py --data DIR``, ``msn-eval`` and ``msn-embed`` on file lists."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from msn_core.bundle import Preprocessing
from msn_core.sources import SourceError, SourceNotFound, list_images, read_file_list, relabel
from training.data import ImageListDataset, build_dataset, build_loader, load_image, pil_to_tensor

from .pretrain_here import pretrain_here
from .test_pretrain import TINY

SIZE = 16
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}


def _png(path: Path, colour=(128, 128, 128), size=(20, 20)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _pixel(path: Path) -> list[int]:
    return pil_to_tensor(load_image(path, SIZE))[:, SIZE // 2, SIZE // 2].tolist()


# ------------------------------------------------------------------------------------------------------ folders


def test_flat_folder_is_unlabelled_and_skips_hidden_and_other_files(tmp_path: Path) -> None:
    for name in ("b.png", "a.JPG", "c.webp"):
        Image.new("RGB", (8, 8)).save(tmp_path / name, format="WEBP" if name.endswith("webp") else None)
    (tmp_path / "notes.txt").write_text("not an image")
    _png(tmp_path / "._a.png")  # macOS resource fork
    _png(tmp_path / ".cache" / "thumb.png")
    for source in ("auto", "folder"):
        listing = list_images(source, tmp_path)
        assert listing.source == "folder" and not listing.labelled and listing.classes is None
        assert listing.names == ["a.JPG", "b.png", "c.webp"]
        assert listing.files == [str(tmp_path / n) for n in listing.names] and len(listing) == 3
    with pytest.raises(SourceNotFound, match="data.source=folder"):  # the README's old line on a flat folder
        list_images("image_folder", tmp_path)


def test_nested_folder_of_any_depth_is_unlabelled(tmp_path: Path) -> None:
    for rel in ("2020/06/a.png", "2020/b.png", "2021/x/y/z/c.png", "2021/d.png"):
        _png(tmp_path / rel)
    listing = list_images("auto", tmp_path)
    assert listing.source == "folder" and listing.labels is None
    assert listing.names == ["2020/b.png", "2020/06/a.png", "2021/d.png", "2021/x/y/z/c.png"]
    _png(tmp_path / "top.png")  # a top-level image: still one unlabelled collection
    (tmp_path / "2021" / "x" / "loop").symlink_to(tmp_path, target_is_directory=True)  # followed, not forever
    (tmp_path / "2020" / "elsewhere").symlink_to(tmp_path / "2021" / "x", target_is_directory=True)
    names = list_images("auto", tmp_path).names
    assert names[0] == "top.png" and "2020/elsewhere/y/z/c.png" in names and len(names) == 6


def test_image_folder_detected_labels_and_splits(tmp_path: Path) -> None:
    for split in ("train", "val"):
        for cls in ("dog", "cat"):
            for i in range(2):
                _png(tmp_path / split / cls / f"{split}{i}.png")
    _png(tmp_path / "train" / "cat" / ".hidden.png")
    train = list_images("auto", tmp_path, split="train")
    assert (train.source, train.classes, train.labels) == ("image_folder", ["cat", "dog"], [0, 0, 1, 1])
    assert train.base == str(tmp_path / "train") and train.names[0] == "cat/train0.png"
    assert "2 classes (cat, dog)" in train.describe() and "data.source=folder" in train.describe()
    test = list_images("auto", tmp_path, split="test")  # no test/: val/ serves
    assert test.base == str(tmp_path / "val") and test.labels == [0, 0, 1, 1]
    forced = list_images("folder", tmp_path / "train")  # folders that are not classes
    assert forced.source == "folder" and forced.labels is None and len(forced) == 4
    one_class = tmp_path / "single"
    _png(one_class / "only" / "a.png")
    assert list_images("auto", one_class).source == "folder"  # one folder is no labelling
    assert list_images("image_folder", one_class).classes == ["only"]


def test_missing_and_wrong_roots_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFound, match="neither an image folder nor a file list"):
        list_images("auto", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFound, match="no images"):
        list_images("folder", tmp_path / "empty")
    with pytest.raises(SourceError, match="in-memory dataset"):
        list_images("fashion-mnist", tmp_path)
    (tmp_path / "list.txt").write_text("a.png\n")
    with pytest.raises(SourceError, match="is a file"):
        list_images("folder", tmp_path / "list.txt")


# --------------------------------------------------------------------------------------------------- file lists


def test_text_list_with_and_without_labels(tmp_path: Path) -> None:
    images = tmp_path / "images"
    for rel in ("a.png", "b.png", "my photos/img 1.png"):
        _png(images / rel)
    plain = images / "plain.txt"
    plain.write_text("# my images\n\nb.png\nmy photos/img 1.png\n" + f"{images / 'a.png'}\n")
    listing = list_images("auto", plain)
    assert listing.source == "file_list" and listing.labels is None
    assert listing.names == ["b.png", "my photos/img 1.png", str(images / "a.png")]  # the list's order
    assert listing.files == [str(images / "b.png"), str(images / "my photos/img 1.png"), str(images / "a.png")]

    labelled = tmp_path / "labelled.txt"  # elsewhere: paths are read from --image-root
    labelled.write_text("a.png 10\nb.png\t9\nmy photos/img 1.png 2\n")
    with pytest.raises(SourceNotFound, match="image_root"):
        list_images("file_list", labelled)
    listing = list_images("file_list", labelled, image_root=images)
    assert listing.classes == ["2", "9", "10"] and listing.labels == [2, 1, 0]  # numeric labels sort as numbers
    assert listing.files[2] == str(images / "my photos/img 1.png")

    (tmp_path / "mixed.txt").write_text("a.png cat\nb.png\n")
    with pytest.raises(SourceError, match="line 1 has a label but line 2 has none"):
        read_file_list(tmp_path / "mixed.txt")
    (tmp_path / "blank.txt").write_text("# nothing\n")
    with pytest.raises(SourceError, match="no entries"):
        read_file_list(tmp_path / "blank.txt")


def test_csv_lists_with_and_without_header(tmp_path: Path) -> None:
    for rel in ("x/a.png", "x/b,c.png"):
        _png(tmp_path / rel)
    (tmp_path / "with_header.csv").write_text('id,filename,split,class\n1,x/a.png,train,cat\n2,"x/b,c.png",train,dog\n')
    listing = list_images("auto", tmp_path / "with_header.csv")
    assert listing.names == ["x/a.png", "x/b,c.png"] and listing.classes == ["cat", "dog"]
    assert listing.labels == [0, 1]
    (tmp_path / "bare.csv").write_text('"x/b,c.png",dog\nx/a.png,cat\n')
    listing = list_images("auto", tmp_path / "bare.csv")
    assert listing.names == ["x/b,c.png", "x/a.png"] and listing.labels == [1, 0]
    (tmp_path / "paths.csv").write_text("path\nx/a.png\n")
    assert list_images("auto", tmp_path / "paths.csv").labels is None


def test_imagenet_subset_file_names_files_by_their_synset_folder(tmp_path: Path) -> None:
    root = tmp_path / "imagenet" / "train"
    names = ["n01440764_10026.JPEG", "n01440764_10027.JPEG", "n01443537_2.JPEG"]
    for name in names:
        path = root / name.split("_")[0] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 12), (5, 5, 5)).save(path, format="JPEG")
    subset = tmp_path / "splits" / "1imgs_class.txt"
    subset.parent.mkdir()
    subset.write_text("\n".join(names) + "\n")
    listing = list_images("auto", subset, image_root=root)
    assert listing.source == "file_list" and listing.classes == ["n01440764", "n01443537"]
    assert listing.labels == [0, 0, 1] and listing.names[2] == "n01443537/n01443537_2.JPEG"
    assert listing.files[0] == str(root / "n01440764" / "n01440764_10026.JPEG")
    # The same file restricting the class folder (data.subset_file): same images, the folder's labels.
    restricted = list_images("image_folder", root, subset=subset)
    assert restricted.files == listing.files and restricted.labels == [0, 0, 1]
    dataset = build_dataset("file_list", root=str(subset), image_root=str(root), load_size=SIZE)
    assert len(dataset) == 3 and dataset[2].label == 1 and dataset[2].num_skipped == 0


def test_relabel_maps_test_classes_onto_the_training_classes(tmp_path: Path) -> None:
    for rel in ("a.png", "b.png"):
        _png(tmp_path / rel)
    (tmp_path / "test.txt").write_text("a.png dog\nb.png cat\n")
    test = list_images("auto", tmp_path / "test.txt")
    assert test.labels == [1, 0]
    mapped = relabel(test, ["ant", "cat", "dog"])
    assert mapped.labels == [2, 1] and mapped.classes == ["ant", "cat", "dog"]
    with pytest.raises(SourceError, match="lack"):
        relabel(test, ["cat"])


# ------------------------------------------------------------------------------------------ decoding odd images


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory) -> Path:
    """A flat, unlabelled folder of every awkward mode, plus three unreadable files (ids 2, 3, 12 sorted)."""
    root = tmp_path_factory.mktemp("odd")
    Image.new("L", (20, 20), 77).save(root / "00_grey.png")
    Image.fromarray(np.full((20, 24), 40000, np.uint16)).save(root / "01_16bit.png")  # opens as I;16
    (root / "02_empty.png").write_bytes(b"")
    (root / "03_text.jpg").write_text("not a JPEG")
    Image.fromarray(np.full((20, 20), 3_000_000, np.int32)).save(root / "04_int32.tif")  # mode I
    Image.new("RGBA", (20, 20), (255, 0, 0, 128)).save(root / "05_rgba.png")
    palette = Image.new("P", (20, 20), 1)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.save(root / "06_palette.png", transparency=1)  # index 1: green, fully transparent
    Image.new("LA", (20, 20), (200, 0)).save(root / "07_la.png")
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(root / "08_cmyk.jpg", quality=95)
    array = np.zeros((20, 40, 3), np.uint8)
    array[:, :20] = (255, 0, 0)
    array[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(array).save(root / "09_exif6.jpg", quality=95, exif=exif)
    Image.new("1", (20, 20), 1).save(root / "10_bilevel.png")
    Image.fromarray(np.full((20, 20), 0.25, np.float32)).save(root / "11_float.tif")  # mode F
    full = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(full, format="JPEG")
    (root / "12_truncated.jpg").write_bytes(full.getvalue()[:300])
    return root


def test_odd_modes_decode_as_msn_serve_decodes_them(odd_folder: Path) -> None:
    from msn_serve.embedding.preprocess import decode_image, resize_crop, to_mode

    pre = Preprocessing.from_dict({"resize": SIZE, "crop": SIZE, "mean": [0.5] * 3, "std": [0.5] * 3, "channels": 3})
    readable = [p for p in sorted(odd_folder.iterdir()) if p.name[:2] not in ("02", "03", "12")]
    for path in readable:
        served = np.asarray(resize_crop(to_mode(decode_image(path.read_bytes(), max_pixels=10**8), 3), pre))
        trained = np.asarray(load_image(path, SIZE))
        tolerance = 2 if path.suffix == ".jpg" else 0
        assert np.abs(served.astype(int) - trained.astype(int)).max() <= tolerance, path.name
    assert _pixel(odd_folder / "00_grey.png") == [77, 77, 77]
    assert _pixel(odd_folder / "01_16bit.png") == [156] * 3  # 40000 / 257, not clipped to 255
    assert _pixel(odd_folder / "04_int32.tif") == [255] * 3  # scaled by its maximum, above the 16-bit range
    assert _pixel(odd_folder / "05_rgba.png") == [255, 0, 0]  # alpha dropped (documented), not composited
    assert _pixel(odd_folder / "06_palette.png") == [0, 255, 0]
    assert _pixel(odd_folder / "07_la.png") == [200] * 3
    assert _pixel(odd_folder / "10_bilevel.png") == [255] * 3
    assert _pixel(odd_folder / "11_float.tif") == [64] * 3  # [0, 1] floats scaled to 255
    red, green, blue = _pixel(odd_folder / "08_cmyk.jpg")
    assert red > 200 and green < 60 and blue < 60
    # EXIF orientation 6: the red left half becomes the top half, so the top row is red end to end.
    top = pil_to_tensor(load_image(odd_folder / "09_exif6.jpg", SIZE))[:, 0]
    assert top[0, 0] > 200 and top[0, -1] > 200 and top[2, -1] < 60


def test_unreadable_files_are_skipped_and_counted_in_an_unlabelled_folder(odd_folder: Path) -> None:
    dataset = build_dataset("auto", root=str(odd_folder), load_size=SIZE)
    assert isinstance(dataset, ImageListDataset) and len(dataset) == 13 and dataset.labels is None
    assert dataset[2].num_skipped == 2 and torch.equal(dataset[2].image, dataset[4].image)
    assert dataset[12].num_skipped == 1 and torch.equal(dataset[12].image, dataset[0].image)  # wraps around
    assert dataset[0].label == -1
    loader, _ = build_loader(dataset, batch_size=13, num_workers=0, rank=0, world_size=1, seed=0,
                                   pin_memory=False)
    images, labels, skipped = next(iter(loader))
    assert images.shape == (13, 3, SIZE, SIZE) and skipped == 4 and labels.tolist() == [-1] * 13


# ------------------------------------------------------------------------------------------------ the commands


def _class_images(root: Path, per_class: int) -> dict[str, list[str]]:
    """Images of three colour classes (with pixel noise) under ``root``; returns their relative paths by class."""
    rng = np.random.default_rng(0)
    out: dict[str, list[str]] = {}
    for cls, colour in COLOURS.items():
        for i in range(per_class):
            noisy = np.clip(np.array(colour) + rng.integers(-20, 20, (20, 20, 3)), 0, 255).astype(np.uint8)
            rel = f"{cls}_{i}.png"
            Image.fromarray(noisy).save(root / rel)
            out.setdefault(cls, []).append(rel)
    return out


def test_pretrain_with_data_dir_on_a_flat_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``pretrain.py --data DIR`` with no config: a flat folder with one unreadable file trains, its config records
    the source, the skipped file is counted, and ``--set`` takes several pairs after one flag. Both runs go through
    ``main`` in this process (``pretrain_here``): the command line, the files and the error line are the point."""
    images = tmp_path / "images"
    images.mkdir()
    _class_images(images, 6)
    (images / "blue_5.png").unlink()  # 17 images and a broken file: 3 batches of 6 meet each file once
    (images / "broken.png").write_bytes(b"not a png")
    tiny = [item for item in TINY if not item.startswith(("data.source", "data.synthetic_size"))]
    out = tmp_path / "run"
    argv = ["--data", str(images), "--output-dir", str(out),
            "--set", *tiny[:10], "--set", *tiny[10:], "run.max_steps=3", "data.batch_size=6"]
    assert pretrain_here(argv, caplog) is None
    assert "18 images, unlabelled folder" in caplog.text
    config = (out / "config.yaml").read_text()
    assert "source: auto" in config and f"root: {images}" in config and "batch_size: 6" in config
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["skipped_files"] == 1
    bad = pretrain_here(["--data", str(images), "--output-dir", str(tmp_path / "bad"),
                         "--set", "data.source=image_folder", *tiny], caplog)
    # the exit message is the command's whole error output; any other exception (a traceback) fails the call above
    assert isinstance(bad, str) and bad.startswith("pretrain: ") and "\n" not in bad
    assert "no images" in bad and "data.source=folder" in bad


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    from training.bundle.export import export_bundle
    from training.model.vit import build_encoder

    torch.manual_seed(0)
    encoder = build_encoder("vit_tiny", 4, SIZE, embed_dim=32, depth=2, num_heads=2)
    out = tmp_path_factory.mktemp("bundle") / "tiny"
    preprocessing = {"resize": SIZE, "crop": SIZE, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                     "channels": 3}
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=preprocessing, parity_check=False)
    return out


@pytest.fixture(scope="module")
def labelled_lists(tmp_path_factory) -> Path:
    """``train.csv`` (header, labels) and ``test.txt`` (``path label``) over colour-class images in ``images/``."""
    root = tmp_path_factory.mktemp("lists")
    (root / "images").mkdir()
    by_class = _class_images(root / "images", 8)
    train = [(f"images/{rel}", cls) for cls, rels in by_class.items() for rel in rels[:5]]
    test = [(f"images/{rel}", cls) for cls, rels in by_class.items() for rel in rels[5:]]
    (root / "train.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in train))
    (root / "test.txt").write_text("".join(f"{p} {c}\n" for p, c in reversed(test)))
    (root / "unlabelled.txt").write_text("".join(f"{p}\n" for p, _ in test))
    return root


def test_msn_eval_on_labelled_file_lists(tiny_bundle: Path, labelled_lists: Path, tmp_path: Path) -> None:
    from training.evaluation.cli import main

    common = ["--bundle", str(tiny_bundle), "--data", str(labelled_lists / "train.csv"), "--test-data",
              str(labelled_lists / "test.txt"), "--no-cache", "--no-progress"]
    out = tmp_path / "knn.json"
    assert main(["knn", *common, "--backend", "pixels", "--k", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert (result["train"], result["test"]) == (15, 9)
    assert result["top1"] == 100.0  # colour classes: pixels separate them, so labels line up across both lists
    out = tmp_path / "lowshot.json"
    assert main(["lowshot", *common, "--shots", "1", "--splits", "1", "--solver", "sklearn", "--json", str(out)]) == 0
    assert 0 <= json.loads(out.read_text())["results"][0]["mean"] <= 100
    unlabelled = [*common[:3], str(labelled_lists / "unlabelled.txt"), *common[4:]]
    with pytest.raises(SystemExit, match="needs labels"):
        main(["knn", *unlabelled])
    with pytest.raises(SystemExit, match="--test-data"):
        main(["knn", *common[:4], *common[6:]])


def test_msn_embed_on_a_csv_list(tiny_bundle: Path, labelled_lists: Path, tmp_path: Path) -> None:
    from training.bundle.embed import main

    out = tmp_path / "emb"
    assert main(["--bundle", str(tiny_bundle), "--data", str(labelled_lists / "train.csv"), "--out", str(out),
                 "--workers", "0", "--threads", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["count"], manifest["skipped"], manifest["dim"]) == (15, 0, 32)
    assert manifest["base"] == str(labelled_lists.resolve())
    rows = [json.loads(line) for line in (out / "shard-00000.paths.jsonl").read_text().splitlines()]
    assert rows[0] == {"id": 0, "path": "images/red_0.png", "label": "red"} and rows[-1]["label"] == "blue"
    assert np.load(out / "shard-00000.emb.npy").shape == (15, 32)


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file(),
                    reason="Fashion-MNIST idx files absent (apt-get install dataset-fashion-mnist)")
def test_flat_folder_benchmark_writes_an_unlabelled_folder_idempotently(tmp_path: Path) -> None:
    from benchmarks.training.flat_folder import write_flat_folder
    from training.data import FashionMNIST

    images = tmp_path / "images"
    assert write_flat_folder(images, limit=300) == 300
    listing = list_images("auto", images)
    assert listing.source == "folder" and len(listing) == 300 and listing.names[0] == "00000.png"
    expected = FashionMNIST(split="train").images
    assert np.array_equal(np.asarray(Image.open(listing.files[299])), expected[299])
    (images / "00007.png").unlink()
    stamp = (images / "00000.png").stat().st_mtime_ns
    assert write_flat_folder(images, limit=300) == 300 and not (images / "00007.png").exists()  # recorded: no work
    images.with_suffix(".json").unlink()
    assert write_flat_folder(images, limit=300) == 300 and (images / "00007.png").is_file()  # the gap refilled
    assert (images / "00000.png").stat().st_mtime_ns == stamp and len(list(images.iterdir())) == 300
