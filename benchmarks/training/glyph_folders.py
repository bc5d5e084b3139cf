"""A second development set off Fashion-MNIST: digit glyphs rendered here, pretrained from an unlabelled folder.

    python -m benchmarks.training.glyph_folders --dry-run                 # print the plan, run nothing
    python -m benchmarks.training.glyph_folders                           # pretrain on the flat folder for 10 minutes
    python -m benchmarks.training.glyph_folders --layout flat nested --budget 30m
    python -m benchmarks.training.glyph_folders --render-only             # write the images, train nothing
    python -m benchmarks.training.glyph_folders --set augment.affine_p=0.8 augment.stroke_p=0.8 --tag shape

The images: the digits 0-9 (10 classes) drawn with Pillow in the TrueType fonts of ``FONT_FILES`` that exist on the
machine (DejaVu and Liberation on Debian; Pillow's built-in font where none does, so the set builds anywhere, but
then it is a different set: ``images.json`` lists the fonts used), with affine jitter (glyph height, rotation, shear,
translation), stroke jitter (bold fonts, and strokes widened or, at 24 px and more, thinned by a grey-level
dilation or erosion) and contrast jitter, mixed in one folder at several sizes (16, 28 and 32 px by default: a
user's folder is rarely one size, and the planner picks the image size from the median). Grey 8-bit PNGs, a light
glyph on a dark background: the polarity of Fashion-MNIST and scikit-learn's digits, the project's other two development
sets, so the three compare (ink is the high value in all of them). Every class has the same number of images at every
size and in every font (2,880 training and 1,440 test images by default); image ``i`` of a split is drawn from its own
seeded generator, so the set is the same on every run and machine with the same fonts and Pillow.

1. ``DATA/flat/NNNNN.png`` (the training images, no labels), the same images as ``DATA/nested/sK/subJ/NNNNN.png``
   (two folders deep, so the trainer's ``auto`` source lists them as one unlabelled folder rather than as classes),
   and ``DATA/labelled/{train,val}/<digit>/NNNNN.png`` for evaluation only.
2. For each ``--layout``: ``torchrun --standalone --nproc_per_node=1 training/pretrain.py --data DATA/<layout>
   --budget B``, no ``--config`` and no ``--set`` unless given (then the work folder and the results file carry
   ``--tag``); then ``msn-export``, ``msn-eval lowshot --shots 1 2 5 --splits 3``
   and ``msn-eval knn`` on ``DATA/labelled`` for the bundle and for raw pixels, as
   :mod:`benchmarks.training.other_folders` does (its steps are reused).

One rule of the trainer's plan was found on these images (views whose grey levels are redrawn when the plain
backgrounds differ in grey: docs/results-notes.md); nothing else in it was tuned on them. The pretraining runs are
timed: give them the machine to themselves. The result goes to ``benchmarks/results/glyph_folders-<budget>.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from benchmarks.common import REPO, RESULTS, machine, save_json
from benchmarks.training.other_folders import collect_run, execute, folder_plan
from benchmarks.training.steps import Step
from msn_core.durable import atomic_write_json

CLASSES = tuple("0123456789")
SIZES = (16, 28, 32)
TRAIN_PER_CLASS, TEST_PER_CLASS = 288, 144  # multiples of 3 sizes x 12 fonts: every cell equal
LAYOUTS = ("flat", "nested")
FONT_ROOT = Path("/usr/share/fonts/truetype")
# Sans, serif, monospace, condensed, italic and bold faces: the shape variety a digit set needs. Missing ones are
# skipped; with none, Pillow's built-in font is used.
FONT_FILES = (
    "dejavu/DejaVuSans.ttf", "dejavu/DejaVuSans-Bold.ttf", "dejavu/DejaVuSerif.ttf", "dejavu/DejaVuSansMono.ttf",
    "dejavu/DejaVuSansCondensed-Oblique.ttf", "dejavu/DejaVuSerif-Italic.ttf",
    "liberation/LiberationSans-Regular.ttf", "liberation/LiberationSerif-Regular.ttf",
    "liberation/LiberationSerif-Bold.ttf", "liberation/LiberationMono-Regular.ttf",
    "liberation/LiberationSansNarrow-Regular.ttf", "liberation/LiberationSerif-Italic.ttf",
)
DEFAULT_FONT = "Pillow default"
RENDER_PX = 96  # the font size a glyph is drawn at before it is fitted to its image
SUPERSAMPLE = 4  # jitter is applied at 4x the image size, then box-filtered down: smooth edges at 16 px
MARGIN = 0.06  # of the image side, kept clear of the glyph so no stroke is clipped
# Stroke jitter, in output pixels per side of a stroke: (thinnest, widest) from 24 px, and below. A regular DejaVu
# stroke is ~1.3 px at 16 px: thinner it breaks up; much wider and a bold 8 fills its counters. Under ``SMALL`` px
# strokes are only widened.
STROKE_PX, SMALL_STROKE_PX, SMALL = (-0.2, 0.5), (0.0, 0.35), 24
SPLIT_CODES = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Jitter:
    """One image's random draw; lengths are fractions of the image side unless named in pixels."""

    height: float  # the glyph's height before rotation
    rotation: float  # degrees
    shear: float  # horizontal shear factor
    stroke_px: float  # output pixels added to each side of every stroke (negative: taken away)
    shift: tuple[float, float]  # in [-1, 1]: where in the free room around the glyph it sits
    background: int
    foreground: int


def draw_jitter(rng: np.random.Generator, size: int) -> Jitter:
    """Modest ranges: every image stays a legible digit (a 6 is never turned into a 9)."""
    low, high = SMALL_STROKE_PX if size < SMALL else STROKE_PX
    return Jitter(height=float(rng.uniform(0.5, 0.8)), rotation=float(rng.uniform(-15, 15)),
                  shear=float(rng.uniform(-0.3, 0.3)), stroke_px=float(rng.uniform(low, high)),
                  shift=(float(rng.uniform(-1, 1)), float(rng.uniform(-1, 1))),
                  background=int(rng.integers(0, 41)), foreground=int(rng.integers(170, 256)))


def available_fonts(root: Path = FONT_ROOT) -> list[str]:
    """The paths of ``FONT_FILES`` under ``root`` that exist, in the list's order; ``[DEFAULT_FONT]`` if none do."""
    found = [str(root / name) for name in FONT_FILES if (root / name).is_file()]
    return found or [DEFAULT_FONT]


@cache
def _font(font: str) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if font == DEFAULT_FONT:
        return ImageFont.load_default(size=RENDER_PX)  # Aileron; a small bitmap font where Pillow lacks FreeType
    return ImageFont.truetype(font, RENDER_PX)


def font_name(font: str) -> str:
    """What ``images.json`` records: the font file's name, or which built-in font Pillow gave."""
    if font != DEFAULT_FONT:
        return Path(font).stem
    loaded = _font(font)
    if hasattr(loaded, "getname"):
        return f"{DEFAULT_FONT} ({' '.join(loaded.getname())})"
    return f"{DEFAULT_FONT} (bitmap)"


@cache
def glyph_mask(char: str, font: str) -> Image.Image:
    """The glyph drawn white on black at ``RENDER_PX``, cropped to its ink."""
    canvas = Image.new("L", (3 * RENDER_PX, 3 * RENDER_PX), 0)
    ImageDraw.Draw(canvas).text((RENDER_PX, RENDER_PX // 2), char, fill=255, font=_font(font))
    return canvas.crop(canvas.getbbox())


def _stroke(glyph: Image.Image, pixels: float) -> Image.Image:
    """Widen (``pixels`` > 0) or thin every stroke by about ``pixels`` on each side (a grey dilation/erosion)."""
    radius = round(abs(pixels))
    if radius == 0:
        return glyph
    pad = Image.new("L", (glyph.width + 2 * radius, glyph.height + 2 * radius), 0)
    pad.paste(glyph, (radius, radius))
    kernel = 2 * radius + 1
    return pad.filter(ImageFilter.MaxFilter(kernel) if pixels > 0 else ImageFilter.MinFilter(kernel))


def _rotate_shear(glyph: Image.Image, degrees: float, shear: float) -> Image.Image:
    """The glyph rotated and sheared about its centre, on a canvas that holds all of it, cropped to its ink."""
    t = math.radians(degrees)
    forward = np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]]) @ np.array([[1.0, shear], [0, 1]])
    w, h = glyph.size
    corners = np.array([[-w, -h], [w, -h], [-w, h], [w, h]]) / 2 @ forward.T
    out_w, out_h = (int(v) + 4 for v in np.ceil(corners.max(0) - corners.min(0)))
    (a, b), (d, e) = np.linalg.inv(forward)  # PIL maps each output pixel back to the input
    data = (a, b, w / 2 - a * out_w / 2 - b * out_h / 2, d, e, h / 2 - d * out_w / 2 - e * out_h / 2)
    out = glyph.transform((out_w, out_h), Image.Transform.AFFINE, data, resample=Image.Resampling.BICUBIC)
    return out.crop(out.getbbox())


def render_glyph(char: str, font: str, size: int, jitter: Jitter) -> np.ndarray:
    """A ``size`` x ``size`` uint8 image of ``char``; the whole glyph lies inside the margin."""
    side = size * SUPERSAMPLE
    mask = glyph_mask(char, font)
    height = jitter.height * side
    width = max(1, round(mask.width * height / mask.height))
    glyph = mask.resize((width, max(1, round(height))), Image.Resampling.BICUBIC)
    glyph = _rotate_shear(_stroke(glyph, jitter.stroke_px * SUPERSAMPLE), jitter.rotation, jitter.shear)
    room = side * (1 - 2 * MARGIN)
    if max(glyph.size) > room:  # a wide glyph, rotated: shrink rather than clip
        fit = room / max(glyph.size)
        glyph = glyph.resize((max(1, int(glyph.width * fit)), max(1, int(glyph.height * fit))),
                             Image.Resampling.BICUBIC)
    canvas = Image.new("L", (side, side), 0)
    x, y = ((side - extent) / 2 + (room - extent) / 2 * shift
            for extent, shift in zip(glyph.size, jitter.shift))
    canvas.paste(glyph, (round(x), round(y)))
    ink = np.asarray(canvas.resize((size, size), Image.Resampling.BOX), dtype=np.float64) / 255.0
    return np.round(jitter.background + (jitter.foreground - jitter.background) * ink).astype(np.uint8)


@dataclass(frozen=True)
class Glyph:
    """Image ``index`` of a split: its class, size and font are fixed by the index, so classes stay balanced."""

    index: int
    label: int
    size: int
    font: str


def split_glyphs(per_class: int, sizes: Sequence[int], fonts: Sequence[str]) -> list[Glyph]:
    """Classes cycle fastest, then sizes, then fonts: every class has the same count at every size and in every
    font when ``per_class`` is a multiple of ``len(sizes) * len(fonts)``."""
    n = len(CLASSES)
    return [Glyph(i, i % n, sizes[(i // n) % len(sizes)], fonts[(i // (n * len(sizes))) % len(fonts)])
            for i in range(per_class * n)]


def render_split(split: str, per_class: int, sizes: Sequence[int], fonts: Sequence[str],
                 seed: int = 0) -> list[tuple[Glyph, np.ndarray]]:
    """Each image from its own generator (seed, split, index): a shorter split is a prefix of a longer one."""
    return [(g, render_glyph(CLASSES[g.label], g.font, g.size,
                             draw_jitter(np.random.default_rng([seed, SPLIT_CODES[split], g.index]), g.size)))
            for g in split_glyphs(per_class, sizes, fonts)]


def png_bytes(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image, mode="L").save(out, format="PNG")
    return out.getvalue()


def nested_name(index: int) -> str:
    """``sK/subJ/NNNNN.png``: two folders deep, unrelated to the class (a camera-dump-like tree)."""
    return f"s{index % 3}/sub{(index // 3) % 4}/{index:05d}.png"


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)  # images.json, written last, marks the set complete: a partial set is rewritten


def write_glyph_folders(data: Path, sizes: Sequence[int] = SIZES, train_per_class: int = TRAIN_PER_CLASS,
                        test_per_class: int = TEST_PER_CLASS, seed: int = 0,
                        font_root: Path = FONT_ROOT) -> dict:
    """The flat and nested unlabelled folders and the labelled train/val tree; the record (``DATA/images.json``) is
    returned, and read back instead of rendering again when it exists."""
    record_path = data / "images.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    fonts = available_fonts(font_root)
    counts: dict[str, int] = {}
    for split, per_class in (("train", train_per_class), ("val", test_per_class)):
        glyphs = render_split(split, per_class, sizes, fonts, seed)
        for glyph, image in glyphs:
            png, name = png_bytes(image), f"{glyph.index:05d}.png"
            _write(data / "labelled" / split / CLASSES[glyph.label] / name, png)
            if split == "train":
                _write(data / "flat" / name, png)
                _write(data / "nested" / nested_name(glyph.index), png)
        counts[split] = len(glyphs)
    record = {"train": counts["train"], "test": counts["val"], "sizes": list(sizes), "classes": list(CLASSES),
              "fonts": [font_name(font) for font in fonts],
              "seed": seed, "source": "benchmarks.training.glyph_folders (Pillow glyphs)",
              "split": f"{train_per_class} training and {test_per_class} test images per class"}
    atomic_write_json(record_path, record)
    return record


def data_dir(root: Path, sizes: Sequence[int]) -> Path:
    return root / f"glyphs-{'-'.join(map(str, sizes))}px"


def work_name(layout: str, budget: str, tag: str = "") -> str:
    return f"{layout}-{budget}" + (f"-{tag}" if tag else "")


def build_plans(root: Path, sizes: Sequence[int], budget: str, layouts: Sequence[str], sets: Sequence[str] = (),
                tag: str = "") -> dict[Path, list[Step]]:
    """One plan per layout, each a work folder of its own; the images are written once and shared."""
    data = data_dir(root, sizes)
    write = Step(f"write the glyph folders ({', '.join(map(str, sizes))} px)",
                 ["(python) write_glyph_folders", str(data)], [data / "images.json"],
                 lambda: print(f"{write_glyph_folders(data, sizes)['train']} training images in {data}"))
    return {root / work_name(layout, budget, tag): folder_plan(root / work_name(layout, budget, tag), write, budget,
                                                               data / layout, data / "labelled", sets)
            for layout in layouts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="image sizes mixed in the folder")
    parser.add_argument("--budget", default="10m", help="pretrain.py --budget (e.g. 10m, 30m)")
    parser.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["flat"],
                        help="which unlabelled folder(s) to pretrain on, one run each (both are always written)")
    parser.add_argument("--set", dest="sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="overrides of the plan, passed to pretrain.py (needs --tag)")
    parser.add_argument("--tag", default="", help="names the work folders and the results file of a --set run")
    parser.add_argument("--workdir", type=Path, help="images and one folder per layout (default: runs/glyph_folders)")
    parser.add_argument("--pretrain-only", action="store_true", help="stop each plan after pretraining (the timed "
                        "part), so evaluations can run later")
    parser.add_argument("--render-only", action="store_true", help="write the images and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if args.sets and not args.tag:
        parser.error("--set needs --tag: the planned run's folders and results keep their names")
    root = (args.workdir or REPO / "runs" / "glyph_folders").resolve()
    if args.render_only and not args.dry_run:
        record = write_glyph_folders(data_dir(root, args.sizes), args.sizes)
        print(f"{record['train']} training and {record['test']} test images in {data_dir(root, args.sizes)}; "
              f"fonts: {', '.join(record['fonts'])}")
        return 0
    plans = build_plans(root, args.sizes, args.budget, args.layout, args.sets, args.tag)
    if not execute(plans, dry_run=args.dry_run, pretrain_only=args.pretrain_only):
        return 0
    data = data_dir(root, args.sizes)
    folders = {f"glyphs-{layout}": collect_run(root / work_name(layout, args.budget, args.tag), args.budget,
                                               data / "images.json", data / layout, args.sets)
               for layout in args.layout}
    save_json(RESULTS / f"glyph_folders-{args.budget}{f'-{args.tag}' if args.tag else ''}.json",
              {"machine": machine(), "budget": args.budget, "sizes": list(args.sizes), "sets": args.sets,
               "folders": folders})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
