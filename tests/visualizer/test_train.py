"""Decoder training: a few steps, the sample grid, exact resume, sampling from the run, what the checkpoint records
(condition dropout, quality), the CLI (on a flat unlabelled folder too), DDP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from msn_core.sources import list_images
from tests.visualizer.conftest import TINY_OVERRIDES, tiny_config
from visualizer.cli import main
from visualizer.config import ConfigError
from visualizer.data import split_holdout
from visualizer.pipeline import RCDMPipeline, load_run
from visualizer.train import train

REPO = Path(__file__).resolve().parents[2]


def test_tiny_decoder_trains_and_samples(tiny_bundle: Path, tiny_run: Path) -> None:
    state = load_run(tiny_run)
    assert state["step"] == 3 and state["bundle"]["model_id"].startswith("msn-tiny4")
    grid = Image.open(tiny_run / "samples" / "step_000003.png")
    assert grid.size[0] > grid.size[1] > 0  # 2 rows x (original, masked, 2 samples)
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 3] and all(r["images_per_s"] > 0 for r in records[:3])
    quality = records[-1]["quality"]  # the end-of-training figure, also in the checkpoint
    assert quality == state["quality"] and quality["step"] == 3 and quality["images"] == 10
    assert 0.0 <= quality["class_consistency"] <= 1.0 and quality["chance"] == 0.1
    assert state["cond_drop_prob"] == 0.0
    pipe = RCDMPipeline.from_dirs(tiny_bundle, tiny_run)
    image = torch.randint(0, 256, (1, 3, 40, 48), dtype=torch.uint8)
    samples = pipe.sample(image, torch.arange(0, 64, 3), num_samples=5, steps=2, seed=1)
    assert samples.shape == (5, 3, 16, 16) and samples.dtype == torch.uint8


def test_resume_is_exact(tiny_bundle: Path, tmp_path: Path) -> None:
    extra = ("model.learn_sigma=true", "diffusion.cond_drop_prob=0.3", "cond.mask_prob=0.7",
             "run.checkpoint_every_steps=2", "data.synthetic_size=24")  # 3 steps per epoch: crosses an epoch
    straight = train(tiny_config("optim.max_steps=5", *extra), tiny_bundle, tmp_path / "a")
    train(tiny_config("optim.max_steps=2", *extra), tiny_bundle, tmp_path / "b")
    resumed = train(tiny_config("optim.max_steps=5", *extra), tiny_bundle, tmp_path / "b", resume=True)
    assert straight == resumed
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    assert (a["step"], a["epoch"], a["batch_in_epoch"]) == (b["step"], b["epoch"], b["batch_in_epoch"]) == (5, 1, 2)
    for key in ("decoder", "ema"):
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), f"{key}.{name} differs after resume"
    assert a["optimizer"]["state"][0]["exp_avg"].equal(b["optimizer"]["state"][0]["exp_avg"])


def test_max_minutes_stops_early_with_a_checkpoint_and_resume_continues(tiny_bundle: Path, tmp_path: Path) -> None:
    capped = train(tiny_config("optim.max_steps=4", "optim.max_minutes=1e-9"), tiny_bundle, tmp_path)
    assert capped["step"] == 1  # the cap is checked after each step: one step, then log, sample and save
    assert load_run(tmp_path)["step"] == 1 and (tmp_path / "samples" / "step_000001.png").exists()
    resumed = train(tiny_config("optim.max_steps=4"), tiny_bundle, tmp_path, resume=True)
    assert resumed["step"] == 4 and load_run(tmp_path)["step"] == 4
    with pytest.raises(ConfigError, match="optim.max_minutes=0"):
        tiny_config("optim.max_minutes=0")


def test_cli_sample_writes_a_grid(tiny_bundle: Path, tiny_run: Path, sample_png: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "grid.png"
    assert main(["sample", "--bundle", str(tiny_bundle), "--decoder", str(tiny_run), "--image", str(sample_png),
                 "--mask-ratio", "0.7", "--num-samples", "3", "--steps", "2", "--out", str(out)]) == 0
    assert "19/64 patches kept" in capsys.readouterr().out
    assert Image.open(out).size == (2 + 5 * 98, 100)  # original, masked, 3 samples at 96 px + 2 px padding
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(SystemExit, match="cannot read bad.png as an image"):
        main(["sample", "--bundle", str(tiny_bundle), "--decoder", str(tiny_run), "--image", str(bad),
              "--out", str(out)])


def test_checkpoint_records_condition_dropout_and_guidance_follows_it(tiny_bundle: Path, tiny_run: Path,
                                                                       tiny_guided_run: Path, tmp_path: Path) -> None:
    guided_state = load_run(tiny_guided_run)
    assert guided_state["cond_drop_prob"] == 0.5 and guided_state["step"] == 3
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    plain = RCDMPipeline.from_dirs(tiny_bundle, tiny_run)
    assert not plain.guidance_trained and plain.guidance() == 1.0
    with pytest.raises(ValueError, match="condition dropout"):
        plain.sample(image, num_samples=2, steps=2, guidance_scale=0.0)
    guided = RCDMPipeline.from_dirs(tiny_bundle, tiny_guided_run)
    assert guided.guidance_trained
    conditional, unconditional, strong = (guided.sample(image, num_samples=2, steps=2, guidance_scale=g, seed=1)
                                          for g in (1.0, 0.0, 3.0))
    assert not torch.equal(conditional, unconditional) and not torch.equal(conditional, strong)
    with pytest.raises(ValueError, match="outside"):
        guided.sample(image, num_samples=1, steps=2, guidance_scale=-1.0)
    # a checkpoint written before the field existed counts as trained without dropout
    old = tmp_path / "old"
    old.mkdir()
    torch.save({k: v for k, v in guided_state.items() if k not in ("cond_drop_prob", "quality")}, old / "checkpoint.pt")
    legacy = RCDMPipeline.from_dirs(tiny_bundle, old)
    assert not legacy.guidance_trained and legacy.quality is None
    # resuming a decoder whose first steps had no dropout keeps recording 0
    train(tiny_config("optim.max_steps=1", "run.quality_images=0"), tiny_bundle, tmp_path / "mixed")
    train(tiny_config("optim.max_steps=2", "run.quality_images=0", "diffusion.cond_drop_prob=0.5"), tiny_bundle,
          tmp_path / "mixed", resume=True)
    mixed = load_run(tmp_path / "mixed")
    assert mixed["step"] == 2 and mixed["cond_drop_prob"] == 0.0 and mixed["quality"] is None


def test_cli_refuses_guidance_the_decoder_was_not_trained_for(tiny_bundle: Path, tiny_run: Path, sample_png: Path,
                                                              tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs a decoder trained with condition dropout"):
        main(["sample", "--bundle", str(tiny_bundle), "--decoder", str(tiny_run), "--image", str(sample_png),
              "--steps", "2", "--guidance-scale", "2", "--out", str(tmp_path / "grid.png")])
    assert not (tmp_path / "grid.png").exists()


def test_cli_trains_on_a_flat_unlabelled_folder(tiny_bundle: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "photos"  # a user's own images: no class folders, no val split
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(30):
        Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(folder / f"img_{i:02d}.png")
    train_part, held = split_holdout(list_images("folder", folder), 50)  # at most a tenth, chosen by name
    assert held is not None and len(held) == 3 and len(train_part) == 27 and not set(held.names) & set(train_part.names)
    assert split_holdout(list_images("folder", folder), 50)[1].names == held.names
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("data.source=")] + ["optim.max_steps=2"]
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="msn.visualize"):
        assert main(["train", "--bundle", str(tiny_bundle), "--data", str(folder), "--output-dir", str(out),
                     "--set", *overrides]) == 0
    state = load_run(out)
    assert state["step"] == 2 and (out / "samples" / "step_000002.png").is_file()
    assert state["config"]["data"]["source"] == "auto" and state["config"]["data"]["root"] == str(folder)
    quality = state["quality"]  # the label-free figure is measured; class consistency says why it is not
    assert quality["class_consistency"] is None and quality["class_consistency_reason"].startswith("no labels")
    assert quality["images"] == 3 and quality["held_out"].startswith("3 of the 30 images held out")
    assert -1.0 <= quality["feature_similarity"] <= 1.0 and quality["feature_similarity_other"] is not None
    assert '"class_consistency": null' in (out / "metrics.jsonl").read_text()
    assert "class consistency not measured (no labels" in caplog.text
    with pytest.raises(SystemExit, match="no such folder or file list"):
        main(["train", "--bundle", str(tiny_bundle), "--data", str(tmp_path / "nope"), "--output-dir", str(out)])


@pytest.mark.slow
def test_torchrun_ddp_two_processes(tiny_bundle: Path, tmp_path: Path) -> None:
    overrides = [a for o in TINY_OVERRIDES + ["optim.max_steps=2"] for a in ("--set", o)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "visualizer.cli", "train", "--bundle", str(tiny_bundle), "--output-dir", str(tmp_path), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = load_run(tmp_path)
    assert state["world_size"] == 2 and state["step"] == 2 and len(state["rng"]) == 2
