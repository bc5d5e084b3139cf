"""Fixtures for the evaluation tests: one tiny exported bundle per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

IMAGENET_PREPROCESSING = {"resize": 16, "crop": 16, "mean": [0.485, 0.456, 0.406],
                          "std": [0.229, 0.224, 0.225], "channels": 3}


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init 2-block ViT (16 px, patch 4, 16 patches) exported as a bundle."""
    from training.bundle.export import export_bundle
    from training.model.vit import build_encoder

    torch.manual_seed(0)
    encoder = build_encoder("vit_tiny", 4, 16, embed_dim=32, depth=2, num_heads=2)
    out = tmp_path_factory.mktemp("bundle") / "tiny"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=IMAGENET_PREPROCESSING, parity_check=False)
    return out
