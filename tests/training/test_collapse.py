"""The collapse detector: its conditions on logged records, and on real short runs (a collapsing one stops early
and says why; healthy ones are never flagged)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.run.collapse import CollapseDetector, RunGeometry

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "training" / "pretrain.py")
K = 1024


def _detector(image_size=8, patch_size=2, batch_size=64):
    return CollapseDetector(RunGeometry(image_size=image_size, patch_size=patch_size, num_prototypes=K,
                                        batch_size=batch_size, sharpen_temperature=0.25, me_max_weight=1.0, lr=2.5e-4))


def _record(information=0.3, target_uniformity=0.8, usage=1.0, spread=0.9, target_usage=None):
    log_k = math.log(K)
    record = {"prototype_usage_entropy": usage * log_k, "entropy": usage * log_k - information,
              "target_entropy": target_uniformity * log_k, "embedding_spread": spread}
    if target_usage is not None:
        record["target_usage_entropy"] = target_usage
    return record


def _feed(detector, records, every=10):
    return [detector.update(every * (i + 1), r) for i, r in enumerate(records)]


def test_uniform_targets_are_confirmed_on_the_second_record_and_reported_once():
    uniform = _record(information=0.002, target_uniformity=0.99)
    found = _feed(_detector(), [_record()] * 3 + [uniform] * 6)
    flagged = [f for f in found if f is not None]
    assert len(flagged) == 1 and flagged[0].step == 50 and flagged[0].kind == "uniform_targets"
    message = flagged[0].message
    assert "model.image_size=32" in message and "uniform" in message and "loss.sharpen" in message
    assert flagged[0].record() == {"collapse": "uniform_targets", "collapse_message": message}


def test_advice_depends_on_the_image_size():
    uniform = _record(information=0.001, target_uniformity=0.99)
    found = [f for f in _feed(_detector(image_size=224, patch_size=16), [uniform] * 3) if f]
    assert "image_size=32" not in found[0].message and "mask.ratio" in found[0].message


def test_noise_and_early_near_uniform_phases_are_not_collapse():
    detector = _detector()
    # a healthy run passes near-uniform targets early (information ~0.01 nats): not below the threshold
    plateau = [_record(information=0.009, target_uniformity=0.97)] * 30
    # single low records between healthy ones never make a streak
    blips = [_record(information=0.001, target_uniformity=0.99), _record()] * 5
    assert not any(_feed(detector, plateau + blips))


def test_patience_counts_steps_as_well_as_records():
    uniform = _record(information=0.001, target_uniformity=0.99)
    # logged every 4 steps: two records span 4 steps, not yet; the fourth record is 12 steps after the first
    found = _feed(_detector(), [uniform] * 5, every=4)
    assert [f is not None for f in found] == [False, False, False, True, False]


def test_one_prototype_and_one_embedding():
    one = [f for f in _feed(_detector(), [_record(usage=0.05)] * 3) if f]
    assert one[0].kind == "one_prototype" and "me_max_weight" in one[0].message
    targets_on_one = [f for f in _feed(_detector(), [_record(target_usage=0.1)] * 3) if f]
    assert targets_on_one[0].kind == "one_prototype"
    same = [f for f in _feed(_detector(), [_record(spread=0.02)] * 3) if f]
    assert same[0].kind == "one_embedding" and "optim.lr" in same[0].message


def test_sharp_targets_in_a_small_batch_are_not_one_prototype():
    # a batch of 4 can use at most 4 prototypes as argmax: entropy log 4 is everything it can show, not collapse
    sharp_small_batch = _record(information=1.0, target_uniformity=0.05, target_usage=math.log(4))
    assert not any(_feed(_detector(batch_size=4), [sharp_small_batch] * 5))


def test_missing_statistics_read_as_healthy():
    assert not any(_feed(_detector(), [{"loss": 1.0}] * 5))


# ---------------------------------------------------------------------------------------------- real runs

TINY = [
    "data.source=synthetic", "data.synthetic_size=64", "data.load_size=16", "data.batch_size=8",
    "data.num_workers=0", "model.arch=vit_tiny", "model.image_size=16", "model.patch_size=4",
    "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.head_hidden_dim=64",
    "model.head_out_dim=16", "model.num_prototypes=32", "mask.focal_size=8", "mask.num_focal=2",
    "mask.ratio=0.5", "optim.total_steps=200", "optim.warmup_epochs=1", "run.log_every_steps=5",
    "run.progress_bar=false", "run.probe_every_steps=0",
]


def _command(output_dir: Path, sets: list[str], config: Path | None, data: Path | None) -> list[str]:
    cmd = [sys.executable, PRETRAIN, "--output-dir", str(output_dir)]
    cmd += ["--config", str(config)] if config else []
    cmd += ["--data", str(data)] if data else []
    return cmd + ["--set", *sets]


_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _pretrain(output_dir: Path, sets: list[str], *, config: Path | None = None, data: Path | None = None):
    return subprocess.run(_command(output_dir, sets, config, data), env=_ENV, capture_output=True, text=True,
                          timeout=600, check=False)


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_stop_on_collapse_ends_the_run_with_a_checkpoint_and_a_message(tmp_path):
    # Sharpening at T = 1000 makes every target uniform from the first step: a collapse by construction.
    result = _pretrain(tmp_path, TINY + ["loss.sharpen_start=1000", "loss.sharpen_end=1000",
                                         "run.stop_on_collapse=true"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "stopped at step" in result.stderr and "run.stop_on_collapse" in result.stderr
    records = _records(tmp_path)
    flagged = [r for r in records if "collapse" in r]
    assert len(flagged) == 1 and flagged[0]["collapse"] == "uniform_targets"
    assert records[-1]["step"] == flagged[0]["step"] < 200
    assert "training has collapsed" in result.stdout + result.stderr

    from training.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == flagged[0]["step"]


def test_a_healthy_tiny_run_is_not_flagged(tmp_path):
    result = _pretrain(tmp_path, TINY + ["run.max_steps=60", "run.stop_on_collapse=true"])
    assert result.returncode == 0, result.stderr[-2000:]
    records = _records(tmp_path)
    assert records[-1]["step"] == 60 and not any("collapse" in r for r in records)


@pytest.mark.slow
def test_8px_digits_collapse_is_flagged_within_5_percent_of_the_planned_steps(tmp_path):
    """The old failure, reproduced: the 28 px recipe on 8 px digits (unlabelled folder). Flagged within 5 % of the
    2,468 steps its 10-minute budget planned on the AVX2 machine it failed on (~35 s, one thread). That a healthy run
    goes unflagged is ``test_a_healthy_tiny_run_is_not_flagged``'s; the demo recipe on Fashion-MNIST run past the
    same bound is benchmarks/training/collapse_check.py's control (the suite's time is not spent on it twice)."""
    from benchmarks.training.collapse_check import OLD_RECIPE, write_digits

    config = tmp_path / "old_recipe.yaml"
    config.write_text(yaml.safe_dump(OLD_RECIPE))
    write_digits(tmp_path / "digits")
    planned, bound = 2468, int(0.05 * 2468)
    budget = ["optim.epochs=1", f"optim.total_steps={planned}", f"run.max_steps={bound + 2}",
              "run.stop_on_collapse=true", "run.progress_bar=false", "run.precision=fp32", "model.image_size=8"]
    done = _pretrain(tmp_path / "digits8", budget, config=config, data=tmp_path / "digits")

    flagged = [r for r in _records(tmp_path / "digits8") if "collapse" in r]
    assert done.returncode == 1 and flagged and flagged[0]["collapse"] == "uniform_targets", done.stderr[-2000:]
    assert flagged[0]["step"] <= bound and "model.image_size=32" in flagged[0]["collapse_message"]
