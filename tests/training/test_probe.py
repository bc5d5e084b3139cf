"""The kNN probe during pretraining: where its labelled images come from, what it measures, when it runs, and that
it leaves the run untouched."""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from msn_core.sources import SourceError
from training.data import SyntheticDataset
from training.model.vit import build_encoder
from training.run.probe import KnnProbe, ProbeImages, probe_images

from .pretrain_here import pretrain_here

def _write_images(folder: Path, count: int, value: int, size: int = 8) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    for i in range(count):
        pixels = np.clip(value + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{value}_{i:03d}.png")


def _tiny_encoder():
    return build_encoder("vit_tiny", patch_size=4, image_size=16, embed_dim=16, depth=1, num_heads=2)


def _probe(images: ProbeImages, encoder=None, **kwargs) -> KnnProbe:
    prep = {"resize": 16, "crop": 16, "mean": [0.5] * 3, "std": [0.25] * 3}
    return KnnProbe(images, encoder or _tiny_encoder(), feature="cls_pre_norm", eval_preprocessing=prep,
                    device=torch.device("cpu"), autocast=nullcontext, **kwargs)


# ------------------------------------------------------------------------------------------- labelled images


def test_training_images_give_disjoint_seeded_bank_and_queries():
    dataset = SyntheticDataset(90, load_size=16)
    images = probe_images(dataset, eval_data=None, load_size=16, max_images=60, seed=3)
    assert (len(images.bank), len(images.queries)) == (40, 20)
    assert images.bank.dtype == torch.uint8 and images.bank.shape[1:] == (3, 16, 16)
    again = probe_images(dataset, eval_data=None, load_size=16, max_images=60, seed=3)
    assert torch.equal(images.bank, again.bank) and np.array_equal(images.query_labels, again.query_labels)
    # disjoint: no query image is in the bank
    bank = {tuple(x.flatten().tolist()) for x in images.bank}
    assert not any(tuple(x.flatten().tolist()) in bank for x in images.queries)
    other = probe_images(dataset, eval_data=None, load_size=16, max_images=60, seed=4)
    assert not torch.equal(images.bank, other.bank)


def test_unlabelled_training_images_give_no_probe(tmp_path):
    from training.data import build_dataset

    _write_images(tmp_path / "flat", 6, 40)
    dataset = build_dataset("auto", root=str(tmp_path / "flat"), load_size=8)  # a flat folder: no labels
    assert dataset.labels is None
    assert probe_images(dataset, eval_data=None, load_size=8, max_images=10, seed=0) is None


def test_eval_data_folder_with_val_split_and_single_folder(tmp_path):
    for split, count in (("train", 10), ("val", 4)):
        _write_images(tmp_path / "split" / split / "dark", count, 30)
        _write_images(tmp_path / "split" / split / "bright", count, 220)
    images = probe_images(None, eval_data=str(tmp_path / "split"), load_size=8, max_images=100, seed=0)
    assert (len(images.bank), len(images.queries)) == (20, 8) and "train/val" in images.description
    assert sorted(set(images.query_labels.tolist())) == [0, 1]

    _write_images(tmp_path / "one" / "dark", 9, 30)
    _write_images(tmp_path / "one" / "bright", 9, 220)
    images = probe_images(None, eval_data=str(tmp_path / "one"), load_size=8, max_images=100, seed=0)
    assert (len(images.bank), len(images.queries)) == (12, 6)


def test_eval_data_without_labels_is_an_error(tmp_path):
    _write_images(tmp_path / "flat", 6, 40)
    with pytest.raises(SourceError, match="no labels"):
        probe_images(None, eval_data=str(tmp_path / "flat"), load_size=8, max_images=10, seed=0)


# ------------------------------------------------------------------------------------------- the probe itself


def _separable(n=24):
    """Two classes a kNN on any sensible feature separates: dark and bright noise images."""
    generator = torch.Generator().manual_seed(0)
    dark = torch.randint(0, 50, (n, 3, 16, 16), dtype=torch.uint8, generator=generator)
    bright = torch.randint(200, 255, (n, 3, 16, 16), dtype=torch.uint8, generator=generator)
    half = n // 2
    labels = np.array([0] * half + [1] * half)
    return ProbeImages(torch.cat([dark[:half], bright[:half]]), labels, torch.cat([dark[half:], bright[half:]]),
                       labels, "test")


def test_probe_scores_the_served_feature_and_leaves_the_run_untouched():
    encoder = _tiny_encoder().train()
    probe = _probe(_separable(), encoder, every_steps=10)
    rng_before = torch.get_rng_state()
    weights_before = {k: v.clone() for k, v in encoder.state_dict().items()}
    result = probe.run(10)
    assert result.knn_top1 == 100.0 and result.seconds > 0
    assert result.record() == {"knn20_top1": 100.0, "probe_seconds": result.seconds}
    assert encoder.training and torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(v, weights_before[k]) for k, v in encoder.state_dict().items())
    # labels that do not follow the images: about chance
    shuffled = _separable()
    shuffled.query_labels = 1 - shuffled.query_labels
    assert _probe(shuffled, encoder, every_steps=10).run(10).knn_top1 == 0.0


def test_probe_schedule_every_n_steps_final_and_time_share():
    probe = _probe(_separable(4), every_steps=100, max_time_fraction=1e9)  # the schedule alone
    assert not probe.due(50) and probe.due(100)
    probe.run(100)
    assert not probe.due(150) and probe.due(200) and probe.due(150, final=True) and not probe.due(100, final=True)
    # a probe that took more than its share of the training time since the start waits
    stingy = _probe(_separable(4), every_steps=10, max_time_fraction=0.02)
    stingy.run(10)
    stingy.probe_seconds = 10.0  # as if the probe had taken 10 s of a run that has trained for well under 500 s
    assert not stingy.due(20) and stingy.due(20, final=True)
    stingy.started = time.monotonic() - 1000.0  # ... and after 1,000 s it is its turn again
    assert stingy.due(20)


# ------------------------------------------------------------------------------------------- in a real run

TINY = [
    "data.source=synthetic", "data.synthetic_size=64", "data.load_size=16", "data.batch_size=8",
    "data.num_workers=0", "model.arch=vit_tiny", "model.image_size=16", "model.patch_size=4",
    "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.head_hidden_dim=64",
    "model.head_out_dim=16", "model.num_prototypes=32", "mask.focal_size=8", "mask.num_focal=2",
    "mask.ratio=0.5", "optim.epochs=3", "optim.warmup_epochs=1", "run.log_every_steps=2",
    "run.progress_bar=false", "run.max_steps=10",
]


def _pretrain(output_dir: Path, extra: list[str], caplog: pytest.LogCaptureFixture, *args: str) -> str | int | None:
    """A tiny run in this process (``pretrain_here``): what it logs and writes is checked, not the process."""
    return pretrain_here(["--output-dir", str(output_dir), *args, "--set", *TINY, *extra], caplog)


def test_pretraining_logs_the_probe_every_n_steps_and_at_the_end(tmp_path, caplog):
    assert _pretrain(tmp_path, ["run.probe_every_steps=4"], caplog) is None
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    probed = [r["step"] for r in records if "knn20_top1" in r]
    # every 4 steps (step 8 may wait if step 4's probe took more than its share of this tiny run) and the last
    assert probed[0] == 4 and probed[-1] == 10 and set(probed) <= {4, 8, 10}
    assert all(0 <= r.get("knn20_top1", 0) <= 100 for r in records)
    assert "kNN probe: 43 bank and 21 query images" in caplog.text


def test_eval_data_flag_feeds_the_probe_and_a_bad_one_is_one_line(tmp_path, caplog):
    for split, count in (("train", 8), ("val", 4)):
        _write_images(tmp_path / "labelled" / split / "dark", count, 30, size=16)
        _write_images(tmp_path / "labelled" / split / "bright", count, 220, size=16)
    assert _pretrain(tmp_path / "run", ["run.max_steps=2"], caplog, "--eval-data", str(tmp_path / "labelled")) is None
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "knn20_top1" in last and "16 bank and 8 query images" in caplog.text

    _write_images(tmp_path / "flat", 4, 40, size=16)
    bad = _pretrain(tmp_path / "bad", ["run.max_steps=2"], caplog, "--eval-data", str(tmp_path / "flat"))
    # the exit message is the one line the command prints; any other exception (a traceback) fails the call above
    assert isinstance(bad, str) and "run.eval_data" in bad and "\n" not in bad
