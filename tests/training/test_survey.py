"""The survey's detail readings: every form a 28-px handwritten-digit folder comes in reads as low-detail and gets
the easy views; Fashion-MNIST and the rendered glyphs, whose plans must not change, do not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.training.digit_forms import FORMS, render
from benchmarks.training.glyph_folders import available_fonts, render_split
from training.data import FASHION_MNIST_ROOT, FashionMNIST, resize_center_crop
from training.run.machine import Machine
from training.run.plan import plan_run
from training.run.survey import DataSurvey, detail_reading, stroke_width, survey_data

CPU = Machine("cpu", 1, 24.0, 2, False, 0.12, "2-core CPU")
HAVE_FMNIST = (Path(FASHION_MNIST_ROOT) / "train-images-idx3-ubyte.gz").is_file()
READS = {"nearest": "pixel grid", "box": "pixel grid", "bilinear": "round trip", "bicubic": "round trip",
         "lanczos": "round trip", "handwritten": "strokes"}


@pytest.fixture(scope="module")
def digits() -> list[np.ndarray]:
    from sklearn.datasets import load_digits

    return [(a * 255 / 16).round().astype(np.uint8) for a in load_digits().images[:32]]


@pytest.mark.parametrize("form", FORMS)
def test_every_digit_form_reads_low_detail(digits, form):
    detail, reading = detail_reading([render(a, form).astype(np.float32) for a in digits])
    assert detail <= 14 and reading == READS[form]


def test_glyphs_read_more_detail_than_the_rule_takes():
    glyphs = render_split("train", 4, (16, 28, 32), available_fonts()[:4])  # 40 images, sizes mixed as the folder's
    grey = [np.asarray(resize_center_crop(Image.fromarray(g).convert("RGB"), 28).convert("L"), np.float32)
            for _, g in glyphs]
    detail, _ = detail_reading(grey)
    assert detail > 14  # their plan keeps the official views: the easy views made their feature worse


@pytest.mark.skipif(not HAVE_FMNIST, reason=f"Fashion-MNIST idx files absent from {FASHION_MNIST_ROOT}")
def test_fashion_mnist_reads_its_full_side():
    images = FashionMNIST().images[:64].astype(np.float32)
    assert detail_reading(list(images)) == (28, "round trip")


def test_stroke_width_reads_strokes_not_filled_shapes():
    line = np.zeros((28, 28), np.float32)
    line[4:24, 12:15] = 255.0  # a stroke 3 px wide, 20 long
    assert stroke_width(line) == pytest.approx(2 * 60 / 46)  # 2 x area / perimeter: ~2.6, the ends count
    filled = np.zeros((28, 28), np.float32)
    filled[4:24, 4:24] = 255.0  # half the image: a shape, not a stroke
    assert stroke_width(filled) is None and stroke_width(np.zeros((28, 28), np.float32)) is None


def test_pixel_replication_reads_the_grid_it_was_enlarged_from():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 255, (7, 7)).astype(np.uint8)
    framed = np.zeros((28, 28), np.uint8)
    framed[7:21, 7:21] = np.kron(small, np.ones((2, 2), np.uint8))  # 7 px at x2 on a plain frame
    for image, grid in ((np.kron(small, np.ones((4, 4), np.uint8)), 7), (framed, 14)):
        assert detail_reading([image.astype(np.float32)]) == (grid, "pixel grid")
    noise = rng.integers(0, 255, (28, 28)).astype(np.float32)
    assert detail_reading([noise])[0] == 28


def test_a_handwritten_folder_gets_the_easy_views_and_says_why(digits, tmp_path):
    folder = tmp_path / "handwritten"
    folder.mkdir()
    for i, a in enumerate(digits):
        Image.fromarray(render(a, "handwritten")).save(folder / f"{i:02d}.png")
    survey = survey_data("auto", str(folder))
    assert (survey.side, survey.detail_reading, survey.low_detail) == (28, "strokes", True)
    plan = plan_run(survey, CPU, {"optim.budget_minutes": 10})
    assert plan.values["mask.rand_crop_scale"] == [0.6, 1.0] and plan.values["augment.blur_p"] == 0.0
    reason = plan.reasons["mask.ratio"]
    assert reason.startswith(f"the images hold {survey.detail} px of detail at 28 px (strokes about ")


def test_low_detail_is_false_when_not_measured():
    assert not DataSurvey("Fashion-MNIST", 60_000, 28, True).low_detail  # in memory: never surveyed
    assert DataSurvey("digits", 1_797, 8, False).low_detail  # 8 px: its side is all the detail it can hold
    sharp = DataSurvey("glyphs", 2_880, 28, False, detail=18, detail_reading="strokes")
    assert not sharp.low_detail and "mask.rand_crop_scale" not in plan_run(sharp, CPU, {"optim.epochs": 1}).values
