"""benchmarks/evaluation/decoder_harness.py at a tiny size: every figure, both references, the targets block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from visualizer.measures import pixel_vectors, random_pair_distance, reencoded_ranks, seed_spread

TINY = ["--images", "10", "--gallery", "100", "--labelled-per-class", "3", "--judge-bank", "300", "--kid-images", "20",
        "--spread-images", "3", "--pairs", "50", "--guidance-images", "4", "--timing-repeats", "1",
        "--ratios", "0", "0.7", "--steps", "1"]


def test_seed_spread_and_pixel_rank_on_known_cases() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 8, 8)).astype(np.uint8)
    unit = random_pair_distance(images, pairs=200)
    assert 0.3 < unit < 0.5  # uniform noise: RMS of the difference of two U[0, 1] is 1 / sqrt(6)
    same = np.stack([images[:5], images[:5]], axis=1)  # two identical samples per condition
    other = np.stack([images[:5], images[5:10]], axis=1)  # two unrelated ones
    assert seed_spread(same, unit) == 0.0 and seed_spread(other, unit) == pytest.approx(1.0, abs=0.15)
    assert reencoded_ranks(pixel_vectors(images[[3]]), np.array([3]), pixel_vectors(images)).tolist() == [1]


def test_the_harness_runs_at_a_tiny_size(tiny_bundle: Path, tiny_run: Path, tiny_tokenmap_run: Path,
                                         tiny_regression_run: Path, tmp_path: Path) -> None:
    from benchmarks.evaluation.decoder_harness import main

    out = tmp_path / "decoder_harness-tiny.json"
    main(["--bundle", str(tiny_bundle), "--decoder", str(tiny_run), "--tag", "tiny", "--out", str(out),
          "--random-init", str(tiny_tokenmap_run), "--random-init-bundle", str(tiny_bundle),  # a stand-in: its own
          "--regression", str(tiny_regression_run), *TINY])                                 # space, another feature
    result = json.loads(out.read_text())
    assert result["feature"] == "cls_post_norm" and result["served_feature"] == "cls_pre_norm"
    assert result["gallery"] == 100 and result["sizes"]["images"] == 10 and out.with_suffix(".png").is_file()
    rows = result["rows"]
    assert [(r["ratio"], r["guidance"]) for r in rows] == [(0.0, 1.0), (0.7, 1.0)]
    for row in rows:
        assert 1 <= row["median_rank"] <= 100 and 1 <= row["pixel_median_rank"] <= 100
        assert 1 <= row["condition_median_rank"] <= 100 and row["served_feature"] == "cls_pre_norm"
        assert row["seed_spread"] >= 0 and row["spread_images"] == 3 and 0 <= row["classifier"]["consistency"] <= 1
    assert rows[0]["condition_median_rank"] == 1  # unmasked, the condition is the source's own feature
    refs = result["references"]
    assert refs["random_init"]["feature"] == "cls_patch_tokens" and len(refs["random_init"]["rows"]) == 2
    assert all(r["seed_spread"] == 0.0 for r in refs["regression"]["rows"])  # one output whatever the seed
    targets = result["targets"]
    assert {"median_rank_unmasked", "seed_spread_grows_at_0.7", "rank_at_0.7_vs_condition",
            "classifier_above_random_init", "app_8_samples_s"} <= set(targets)
    assert all(isinstance(t["met"], bool) for t in targets.values())
    from benchmarks.render.decoder import section  # docs/results.md's table, with the new columns and references

    text = section(tmp_path)
    assert "| condition's rank | pixel rank |" in text and "tiny: reference random-init" in text
