"""The run planner on simulated machines (CPU-only, one GPU, eight GPUs) and on real folders of images."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from training.config import ConfigError, dump_config, load_config
from training.run.machine import Machine, detect_machine
from training.run.plan import DataSurvey, lr_for_batch, parse_budget, plan_run, survey_data

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CPU = Machine("cpu", 1, 24.0, 2, False, 0.12, "2-core CPU")
H100 = Machine("cuda", 1, 79.6, 16, True, 990.0, "H100")
H100_X8 = Machine("cuda", 8, 79.6, 128, True, 990.0, "H100")
FASHION = DataSurvey("Fashion-MNIST", 60_000, 28, True)
DIGITS = DataSurvey("digits folder", 1_797, 8, False, [0.3] * 3, [0.35] * 3)
IMAGENET = DataSurvey("ImageNet-1k", 1_281_167, 375, False, [0.48, 0.45, 0.4], [0.27, 0.26, 0.28])


def planned(survey, machine, **fixed):
    plan = plan_run(survey, machine, {key.replace("__", "."): v for key, v in fixed.items()})
    return plan, {**plan.values, **plan.fixed}


def test_cpu_small_images_get_the_small_image_recipe():
    plan, v = planned(FASHION, CPU, optim__budget_minutes=10)
    expected = {"model.arch": "vit_tiny", "model.depth": 4, "model.image_size": 28, "model.patches_per_side": 4,
                "mask.num_focal": 0, "mask.ratio": 0.3, "data.batch_size": 64, "optim.lr": 2.5e-4,
                "optim.start_lr": 2e-4, "optim.horizon_scale": 1.0, "optim.ema_start": 0.99,
                "data.num_workers": 0, "model.feature": "cls_patch_tokens", "data.eval_resize_ratio": 1.0}
    assert {k: v[k] for k in expected} == expected  # configs/fmnist_vit_tiny.yaml, derived, not copied
    assert plan.reasons["optim.lr"].startswith("1e-3 x sqrt(64 / 1024)")
    text = plan.describe()
    assert text.count("\n") == len(plan.reasons) + 2 and "2-core CPU" in text


def test_tiny_images_are_upsampled_to_a_working_size():
    plan, v = planned(DIGITS, CPU, optim__budget_minutes=10)
    assert v["model.image_size"] == 32 and v["model.patches_per_side"] == 4  # 8 px x 4, not trained at 8 px
    assert "upsampled from 8 px" in plan.reasons["model.image_size"]
    assert v["data.load_size"] is None and v["data.mean"] == [0.3] * 3 and v["data.num_workers"] >= 1
    sizes = [planned(DataSurvey("odd", 5_000, side, False), CPU, optim__epochs=10)[1]["model.image_size"]
             for side in (14, 13, 28, 45)]
    assert sizes == [28, 40, 28, 44]  # x2; x3 = 39 on the 4 x 4 grid; native; native on the grid


def test_imagenet_plans_match_the_shipped_gpu_recipes():
    for machine, name in ((H100, "in1k_vit_s16_1gpu"), (H100_X8, "in1k_vit_s16_8gpu")):
        _, v = planned(IMAGENET, machine, optim__epochs=800)
        recipe = load_config(CONFIGS / f"{name}.yaml")
        assert (v["model.arch"], v["model.depth"], v["model.image_size"], v["model.patch_size"]) == (
            recipe.model.arch, 12, recipe.model.image_size, recipe.model.patch_size)
        assert (v["mask.num_focal"], v["mask.focal_size"], v["mask.ratio"]) == (
            recipe.mask.num_focal, recipe.mask.focal_size, recipe.mask.ratio)
        assert v["data.batch_size"] == recipe.data.batch_size
        global_batch = recipe.data.batch_size * machine.device_count
        assert v["optim.lr"] == recipe.optim.lr == pytest.approx(lr_for_batch(global_batch), rel=1e-3)  # 3 digits
    # The paper's own recipe (64 x 16 GPUs) is the rule's reference point.
    paper = load_config(CONFIGS / "in1k_vit_s16.yaml")
    assert lr_for_batch(paper.data.batch_size * 16) == paper.optim.lr
    assert load_config(CONFIGS / "in1k_vit_s16_8gpu.yaml").data.batch_size * 8 == 1024


def test_model_size_follows_data_and_budget():
    # A CPU cannot pay for ViT-S/16 at 224 px in 10 minutes: the small-image geometry at 64 px instead.
    _, v = planned(IMAGENET, CPU, optim__budget_minutes=10)
    assert (v["model.arch"], v["model.depth"], v["model.image_size"]) == ("vit_tiny", 4, 64)
    # 100k images of 96 px on a GPU for two hours: enough data for ViT-tiny, not for ViT-S; no focal views (a
    # 96/224 crop would be 3 x 3 patches); the paper's patches and resize margin.
    _, v = planned(DataSurvey("stl-like", 100_000, 96, False), H100, optim__budget_minutes=120)
    assert (v["model.arch"], v["model.depth"], v["model.patch_size"], v["mask.num_focal"]) == ("vit_tiny", 12, 16, 0)
    assert v["data.load_size"] == round(96 * 256 / 224) and v["model.feature"] == "cls_pre_norm"
    # Too few images for anything bigger: the smallest model on any machine; the batch is at most 1/8 of them.
    _, v = planned(DIGITS, H100_X8, optim__budget_minutes=120)
    assert v["model.depth"] == 4 and v["data.batch_size"] * 8 <= DIGITS.num_images // 8


def test_gpu_batch_is_what_fits_in_memory():
    small = Machine("cuda", 1, 16.0, 8, True, 100.0, "16 GB GPU")
    _, v16 = planned(IMAGENET, small, optim__epochs=100)
    _, v80 = planned(IMAGENET, H100, optim__epochs=100)
    assert v16["data.batch_size"] < v80["data.batch_size"] <= 1024
    assert v16["optim.lr"] < v80["optim.lr"]  # sqrt scaling follows the batch
    no_bf16 = Machine("cuda", 1, 79.6, 16, False, 495.0, "fp32 GPU")
    assert planned(IMAGENET, no_bf16, optim__epochs=100)[1]["data.batch_size"] < v80["data.batch_size"]


def test_explicit_settings_win_and_the_plan_derives_from_them():
    plan, v = planned(FASHION, CPU, optim__budget_minutes=10, data__batch_size=256, model__image_size=48)
    assert v["data.batch_size"] == 256 and v["model.image_size"] == 48
    assert plan.reasons["data.batch_size"] == "set by you" and "data.batch_size" not in plan.values
    assert v["optim.lr"] == 5e-4  # 1e-3 * sqrt(256 / 1024)
    _, v = planned(IMAGENET, H100, optim__epochs=10, model__arch="vit_base")
    assert (v["model.arch"], v["mask.ratio"]) == ("vit_base", 0.3)  # the paper's ViT-B/16 ratio
    with pytest.raises(ConfigError, match="needs a length"):
        plan_run(FASHION, CPU, {})


def test_parse_budget():
    assert [parse_budget(t) for t in ("30m", "2h", "1h30m", "90s", "45", "0.5h", "10 min")] == [
        30, 120, 90, 1.5, 45, 30, 10]
    for bad in ("soon", "10x", "0m", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_budget(bad)


def _write_images(folder: Path) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(20):
        Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(folder / f"rgb{i}.png")
    for i in range(5):
        Image.fromarray(rng.integers(0, 65535, (80, 100), dtype=np.uint16)).save(folder / f"grey16_{i}.png")
    (folder / "broken.jpg").write_bytes(b"not a jpeg")


def test_survey_reads_sizes_and_colours_of_a_folder(tmp_path):
    _write_images(tmp_path / "images" / "nested")
    survey = survey_data("auto", str(tmp_path / "images"))
    assert survey.num_images == 26 and survey.side == 30 and not survey.in_memory  # the broken file is listed
    assert all(0.3 < m < 0.7 for m in survey.mean) and all(0.1 < s < 0.5 for s in survey.std)
    with pytest.raises(ValueError, match="could be opened"):
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "x.png").write_bytes(b"junk")
        survey_data("folder", str(tmp_path / "bad"))


def test_pretrain_plans_from_data_records_the_plan_and_set_wins(tmp_path):
    from training.pretrain import parse_args, resolve_config

    _write_images(tmp_path / "images")
    args = parse_args(["--output-dir", str(tmp_path / "run"), "--data", str(tmp_path / "images"), "--budget", "10m",
                       "--set", "optim.lr=3e-4"])
    cfg, plan = resolve_config(args)
    assert cfg.optim.budget_minutes == 10 and cfg.optim.lr == 3e-4 and cfg.model.image_size == 32  # median 30 px
    assert cfg.model.arch == "vit_tiny" and cfg.model.depth == 4 and cfg.model.patch_size == 8
    assert plan is not None and plan.reasons["optim.lr"] == "set by you" and cfg.optim.start_lr == 2e-4
    dump_config(cfg, tmp_path / "config.yaml", plan=plan.record())
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "square-root" not in recorded["plan"]["why"]["optim.lr"] and "model.image_size" in recorded["plan"]["why"]
    assert load_config(tmp_path / "config.yaml") == cfg  # the plan section is a record that loading skips
    # A recipe is not re-planned; --budget / --epochs are short forms of the length keys.
    recipe = str(CONFIGS / "fmnist_vit_tiny.yaml")
    cfg, plan = resolve_config(parse_args(["--output-dir", "o", "--config", recipe, "--epochs", "3"]))
    assert (cfg.optim.epochs, cfg.optim.budget_minutes, plan) == (3, None, None)
    cfg, _ = resolve_config(parse_args(["--output-dir", "o", "--config", recipe, "--budget", "2h"]))
    assert cfg.optim.budget_minutes == 120
    with pytest.raises(ConfigError, match="not both"):
        resolve_config(parse_args(["--output-dir", "o", "--config", recipe, "--budget", "2h", "--epochs", "3"]))


def test_detect_machine_reads_cpu_flags_and_simulated_gpus(monkeypatch):
    monkeypatch.setenv("MSN_CPU_FLAGS", "avx2 fma avx512f avx512_bf16")
    machine = detect_machine("cpu")
    assert machine.device_type == "cpu" and machine.bf16 and machine.cpu_cores >= 1 and machine.device_count == 1
    monkeypatch.setenv("MSN_CPU_FLAGS", "avx2 fma")
    assert not detect_machine("cpu").bf16 and detect_machine("cpu").tflops < machine.tflops
    # The device query, simulated: eight H100-like GPUs under torchrun.
    props = SimpleNamespace(name="Simulated H100", total_memory=80 * 2**30, multi_processor_count=132, major=9,
                            minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    gpu = detect_machine("auto")
    assert (gpu.device_type, gpu.device_count, gpu.bf16, round(gpu.device_memory_gib)) == ("cuda", 8, True, 80)
    assert gpu.tflops == pytest.approx(990, rel=0.01)
    _, v = planned(IMAGENET, gpu, optim__epochs=800)
    assert v["data.batch_size"] == 128  # = configs/in1k_vit_s16_8gpu.yaml
    assert detect_machine("cpu").device_type == "cpu"  # run.device=cpu never asks the GPU


def test_images_with_little_detail_get_views_that_keep_most_of_them():
    official = {"mask.ratio": 0.3}
    _, fashion = planned(FASHION, CPU, optim__budget_minutes=10)
    assert {k: fashion[k] for k in official} == official and "mask.rand_crop_scale" not in fashion
    assert "augment.blur_p" not in fashion  # Fashion-MNIST keeps the official views (and its filed figures)
    resampled = DataSurvey("digits at 32 px", 1_201, 32, False, [0.3] * 3, [0.35] * 3, detail=8)
    for survey in (DIGITS, resampled):
        plan, v = planned(survey, CPU, optim__budget_minutes=10)
        assert v["mask.rand_crop_scale"] == [0.6, 1.0] and v["mask.ratio"] == 0.15
        assert v["augment.color_jitter_p"] == v["augment.grayscale_p"] == v["augment.blur_p"] == 0.0
        assert plan.reasons["mask.ratio"].startswith("the images hold 8 px of detail")
    _, sharp = planned(DataSurvey("glyphs", 2_880, 28, False, detail=19), CPU, optim__budget_minutes=10)
    assert sharp["mask.ratio"] == 0.3 and "mask.rand_crop_scale" not in sharp
    _, chosen = planned(resampled, CPU, optim__budget_minutes=10, mask__ratio=0.3)
    assert chosen["mask.ratio"] == 0.3 and chosen["mask.rand_crop_scale"] == [0.6, 1.0]  # --set wins, per key


def test_backgrounds_of_differing_grey_get_views_whose_levels_are_redrawn():
    glyphs = DataSurvey("glyphs", 2_880, 28, False, detail=19, background_spread=11.1)
    plan, v = planned(glyphs, CPU, optim__budget_minutes=10)
    assert v["augment.levels_p"] == 1.0 and "std 11.1 of 255" in plan.reasons["augment.levels_p"]
    for survey in (FASHION, DataSurvey("black backgrounds", 2_880, 28, False, background_spread=0.0),
                   DataSurvey("photographs", 2_880, 28, False, background_spread=None)):
        assert "augment.levels_p" not in planned(survey, CPU, optim__budget_minutes=10)[1]
    assert planned(glyphs, CPU, optim__budget_minutes=10, augment__levels_p=0.0)[1]["augment.levels_p"] == 0.0


def test_background_spread_reads_plain_borders_only():
    from training.run.survey import background_spread

    rng = np.random.default_rng(0)

    def glyph(level: float) -> np.ndarray:
        image = np.full((28, 28), level, np.float32)
        image[8:20, 12:16] = 220.0
        return image

    assert background_spread([glyph(0.0) for _ in range(8)]) == 0.0
    assert background_spread([glyph(v) for v in (0, 10, 20, 30, 40)]) == pytest.approx(14.1, abs=0.1)
    photos = [rng.uniform(0, 255, (28, 28)).astype(np.float32) for _ in range(8)]
    assert background_spread(photos) is None and background_spread([]) is None
    assert background_spread(photos[:5] + [glyph(v) for v in (0, 40, 0, 40, 0, 40)]) == pytest.approx(20.0, abs=0.1)


def test_detail_is_read_off_the_images_not_their_size(tmp_path):
    from sklearn.datasets import load_digits

    from training.run.survey import detail_side

    rng = np.random.default_rng(0)
    small = [(a * 255 / 16).astype(np.uint8) for a in load_digits().images[:16]]  # 8 x 8 handwritten digits
    upsampled = [np.asarray(Image.fromarray(a).resize((32, 32), Image.BICUBIC), dtype=np.float32) for a in small]
    sharp = [rng.integers(0, 255, (32, 32)).astype(np.float32) for _ in range(16)]
    assert detail_side(upsampled) == 8 and detail_side(sharp) == 32
    assert detail_side([np.zeros((28, 28), np.float32)]) == 28  # a flat image keeps its side
    folder = tmp_path / "digits"
    folder.mkdir()
    for i, a in enumerate(small):
        Image.fromarray(a).resize((32, 32), Image.BICUBIC).save(folder / f"{i}.png")
    survey = survey_data("auto", str(folder))
    assert (survey.side, survey.detail_side) == (32, 8)
