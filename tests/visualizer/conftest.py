"""Fixtures for the visualizer tests: a tiny exported bundle and a tiny decoder trained a few steps on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

PREPROCESSING = {"resize": 32, "crop": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "channels": 3,
                 "interpolation": "bicubic"}

# A decoder small enough to train a step in well under a second on one CPU core.
TINY_OVERRIDES = [
    "model.image_size=16", "model.block_out_channels=[32, 32]", "model.attention=[false, true]",
    "model.norm_num_groups=8", "model.attention_head_dim=16", "model.layers_per_block=1",
    "diffusion.sample_steps=3", "data.source=synthetic", "data.synthetic_size=64", "data.batch_size=8",
    "data.num_workers=0", "run.device=cpu", "run.progress_bar=false", "run.sample_every_steps=0",
    "run.grid_images=2", "run.grid_samples=2", "run.log_every_steps=1", "optim.warmup_steps=2",
    "run.quality_images=10",
]


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    encoder = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    out = tmp_path_factory.mktemp("viz-bundle") / "tiny"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=PREPROCESSING)
    return out


def tiny_config(*extra: str):
    from visualizer.config import load_config

    return load_config(None, TINY_OVERRIDES + list(extra))


def _trained(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory, folder: str, name: str,
             *overrides: str) -> Path:
    from visualizer.train import train

    out = tmp_path_factory.mktemp(folder) / name
    train(tiny_config(*overrides), tiny_bundle, out)
    return out


@pytest.fixture(scope="session")
def tiny_run(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder run directory (checkpoint.pt after 3 steps)."""
    return _trained(tiny_bundle, tmp_path_factory, "viz-run", "rcdm", "optim.max_steps=3")


@pytest.fixture(scope="session")
def tiny_guided_run(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder run trained with condition dropout (an unconditional branch, so guidance means something)."""
    return _trained(tiny_bundle, tmp_path_factory, "viz-run-guided", "rcdm", "optim.max_steps=3",
                    "diffusion.cond_drop_prob=0.5")


@pytest.fixture(scope="session")
def tiny_tokenmap_run(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder on the token map (cond.feature=token_map, the inpainting view), trained 2 steps."""
    return _trained(tiny_bundle, tmp_path_factory, "viz-run-tokenmap", "tokenmap", "optim.max_steps=2",
                    "cond.feature=token_map", "model.map_channels=4", "model.global_mlp=true",
                    "run.quality_images=0")


@pytest.fixture(scope="session")
def tiny_regression_run(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A regression decoder (model.kind=regression) on the default CLS feature, trained 2 steps."""
    return _trained(tiny_bundle, tmp_path_factory, "viz-run-regression", "regression", "optim.max_steps=2",
                    "model.kind=regression")


@pytest.fixture(scope="session")
def sample_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 48x40 colour picture (non-square, so resize + centre crop are exercised)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("viz-images") / "picture.png"
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)
    return path
