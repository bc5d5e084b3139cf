"""What the planner's survey reads off handwritten digits at 28 px, written in the forms a user's folder comes in.

    python -m benchmarks.training.digit_forms                       # write the folders, print and file the table
    python -m benchmarks.training.digit_forms --forms nearest handwritten

A user's folder of 28-px handwritten digits stalled the planned run: its images read 28 px of detail, so the plan
kept the official views that stall digits. Whether the survey reads a digit as low-detail depends on how the file
was made, so this writes scikit-learn's 8 x 8 digits (``other_folders.digits_split``: the same stratified split) at
28 px in each form and surveys every folder with ``training.run.survey``:

- ``nearest``, ``box``, ``bilinear``, ``bicubic``, ``lanczos``: the 8-px digit resized to 28 px with Pillow's filter
  of that name (nearest and box replicate pixels: sharp block edges that a bicubic round trip cannot keep);
- ``handwritten``: MNIST's make-up (LeCun et al.: binary scans size-normalised into a 20 x 20 box with
  anti-aliasing, centred in 28 x 28). The 8-px digit is enlarged bicubic to 80 x 80, thresholded at half of full
  ink (grey 128 of 255) into a binary stroke, box-filtered down to 20 x 20 (an anti-aliased edge about one pixel
  wide) and pasted at (4, 4) on black.

and, as the folders the rule must leave alone, Fashion-MNIST (``FASHION_FILES`` of its training images as PNGs)
and the rendered glyphs (``glyph_folders.write_glyph_folders``, 16/28/32 px mixed). Each folder has ``flat/`` (the
training images, unlabelled, for ``--data``) and, for the digit forms, ``labelled/{train,val}/<digit>/`` for
evaluation, as ``other_folders.py`` writes them. Nothing is timed or random: the table is the same on any machine.
The result goes to ``benchmarks/results/digit_forms.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import REPO, RESULTS, save_json
from benchmarks.training.glyph_folders import write_glyph_folders
from benchmarks.training.other_folders import digits_split
from msn_core.durable import atomic_write_json

SIDE = 28
RESAMPLINGS = {"nearest": Image.Resampling.NEAREST, "box": Image.Resampling.BOX,
               "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
               "lanczos": Image.Resampling.LANCZOS}
FORMS = (*RESAMPLINGS, "handwritten")
BOX, SUPERSAMPLE, INK_THRESHOLD = 20, 4, 128  # the handwritten form: 20 x 20 box, drawn at 4x, binary at grey 128
HANDWRITTEN = (f"the 8-px digit bicubic to {BOX * SUPERSAMPLE} px, binary at grey {INK_THRESHOLD}, box-filtered to "
               f"{BOX} px, pasted at the centre of {SIDE} x {SIDE} black")
FASHION_FILES = 3000
FASHION_IDX = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def render(image: np.ndarray, form: str) -> np.ndarray:
    """One uint8 8 x 8 digit as a ``SIDE`` x ``SIDE`` uint8 image in ``form`` (module docstring)."""
    picture = Image.fromarray(image, mode="L")
    if form in RESAMPLINGS:
        return np.asarray(picture.resize((SIDE, SIDE), RESAMPLINGS[form]))
    if form != "handwritten":
        raise ValueError(f"unknown form {form!r}: one of {', '.join(FORMS)}")
    big = np.asarray(picture.resize((BOX * SUPERSAMPLE,) * 2, Image.Resampling.BICUBIC))
    binary = Image.fromarray(np.where(big >= INK_THRESHOLD, 255, 0).astype(np.uint8), mode="L")
    out = np.zeros((SIDE, SIDE), np.uint8)
    offset = (SIDE - BOX) // 2
    out[offset:offset + BOX, offset:offset + BOX] = np.asarray(binary.resize((BOX, BOX), Image.Resampling.BOX))
    return out


def _save(image: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")  # hidden: never listed as an image
    Image.fromarray(image, mode="L").save(partial, format="PNG")
    os.replace(partial, path)


def write_form_folders(work: Path, form: str) -> dict:
    """``WORK/flat`` and ``WORK/labelled/{train,val}/<digit>`` in ``form``; the record (``WORK/images.json``) is
    read back instead of writing again when it exists."""
    record = work / "images.json"
    if record.is_file():
        return json.loads(record.read_text())
    train_x, train_y, test_x, test_y = digits_split()
    for part, xs, ys in (("train", train_x, train_y), ("val", test_x, test_y)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            image = render(x, form)
            _save(image, work / "labelled" / part / str(int(y)) / f"{i:04d}.png")
            if part == "train":
                _save(image, work / "flat" / f"{i:04d}.png")
    made = HANDWRITTEN if form == "handwritten" else f"the 8-px digit resized to {SIDE} px, Pillow {form}"
    info = {"train": len(train_x), "test": len(test_x), "size": SIDE, "form": form, "made": made,
            "source": "sklearn.datasets.load_digits", "split": "stratified 2/3 : 1/3, seed 0"}
    atomic_write_json(record, info)
    return info


def write_fashion_folder(work: Path, count: int = FASHION_FILES, idx: Path = FASHION_IDX) -> dict:
    """The first ``count`` Fashion-MNIST training images as ``WORK/flat/NNNNN.png``."""
    record = work / "images.json"
    if record.is_file():
        return json.loads(record.read_text())
    with gzip.open(idx) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, SIDE, SIDE)
    for i, image in enumerate(images[:count]):
        _save(image, work / "flat" / f"{i:05d}.png")
    info = {"train": count, "size": SIDE, "source": str(idx)}
    atomic_write_json(record, info)
    return info


def measure(flat: Path) -> dict:
    """The survey of one flat folder, with each reading of the detail apart (the medians over the same sampled
    images the planner reads)."""
    from training.run import survey as s

    survey = s.survey_data("auto", str(flat))
    listing = s.list_images("auto", str(flat), split="train")
    rng = random.Random(0)  # the survey's own sample, so the columns describe the images it read
    sample = sorted(rng.sample(range(len(listing.files)), min(s.SAMPLED_FILES, len(listing.files))))
    grey = s._grey_images([listing.files[i] for i in sample[:: max(1, len(sample) // s.STATS_FILES)]], survey.side)
    widths = [w for w in map(s.stroke_width, grey) if w is not None]
    return {"side": survey.side, "detail": survey.detail, "reading": survey.detail_reading,
            "low_detail": survey.low_detail,
            "round_trip": int(statistics.median(map(s._round_trip_detail, grey))),
            "pixel_grid": int(statistics.median(map(s._grid_detail, grey))),
            "stroke_width": round(statistics.median(widths), 2) if widths else None,
            "sparse_share": round(len(widths) / len(grey), 2),
            "background_spread": survey.background_spread, "images_read": len(grey)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--workdir", type=Path, help="one folder per form under it (default: runs/digits28)")
    parser.add_argument("--glyphs", type=Path, help="the glyph folders (default: runs/glyph_folders/glyphs-16-28-32px)")
    args = parser.parse_args(argv)
    root = (args.workdir or REPO / "runs" / "digits28").resolve()
    folders = {}
    for form in args.forms:
        write_form_folders(root / form, form)
        folders[form] = root / form / "flat"
    write_fashion_folder(root / "fashion-mnist")
    folders["fashion-mnist"] = root / "fashion-mnist" / "flat"
    glyphs = (args.glyphs or REPO / "runs" / "glyph_folders" / "glyphs-16-28-32px").resolve()
    write_glyph_folders(glyphs)
    folders["glyphs"] = glyphs / "flat"
    table = {name: measure(flat) for name, flat in folders.items()}
    print(f"{'folder':<14} {'detail':>6}  {'reading':<11} {'low':<5} {'round trip':>10} {'grid':>5} "
          f"{'stroke px':>9} {'sparse':>6} {'bg spread':>9}")
    for name, row in table.items():
        print(f"{name:<14} {row['detail']!s:>6}  {row['reading']!s:<11} {row['low_detail']!s:<5} "
              f"{row['round_trip']:>10} {row['pixel_grid']:>5} {row['stroke_width']!s:>9} {row['sparse_share']:>6} "
              f"{row['background_spread']!s:>9}")
    save_json(RESULTS / "digit_forms.json", {"folders": {k: {**v, "flat": str(folders[k].relative_to(REPO))
                                                             if folders[k].is_relative_to(REPO) else str(folders[k])}
                                                         for k, v in table.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
