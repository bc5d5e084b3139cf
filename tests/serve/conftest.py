"""Fixtures for the serving tests: a tiny bundle exported by the training code, and a running server.

The bundle is built once per session with ``training.bundle.export.export_bundle`` (torch is fine in tests; the server
process itself never imports it). Servers are real ``python -m msn_serve`` subprocesses on free loopback ports.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import PREPROCESSING, Server


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(0)
    encoder = VisionTransformer(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    out = tmp_path_factory.mktemp("bundle") / "tiny"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing=PREPROCESSING, feature="cls_pre_norm",
                  parity_check=True)
    return out


@pytest.fixture(scope="module")
def server(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(bundle_dir, tmp_path_factory.mktemp("serve") / "data").start()
    yield srv
    srv.stop()


