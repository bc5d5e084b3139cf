"""What a decoder is conditioned on (cond.feature: the CLS by default, the token map as an option), the regression
reference decoder, the paper's figure, and the app with two decoders side by side."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.visualizer.conftest import tiny_config
from training.api import feature_spec, load_encoder, read_feature
from visualizer.config import ConfigError
from visualizer.features import FrozenEncoder
from visualizer.pipeline import RCDMPipeline, load_run
from visualizer.train import train


def test_the_decoder_reads_its_feature_beside_the_served_one(tiny_bundle: Path) -> None:
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    keep = torch.arange(0, 64, 2)
    cls = FrozenEncoder(tiny_bundle, feature="cls_post_norm")
    assert (cls.feature, cls.served, cls.dim, cls.layout.side) == ("cls_post_norm", "cls_pre_norm", 64, 0)
    feat, served = cls.embed_with_served(images, keep)  # one forward pass, both features
    encoder, _ = load_encoder(tiny_bundle)
    pixels = cls.preprocess(images).float()
    want = read_feature(encoder, feature_spec(encoder, "cls_post_norm"), pixels, keep.expand(3, -1))
    torch.testing.assert_close(feat, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(served, FrozenEncoder(tiny_bundle).embed(images, keep), atol=1e-5, rtol=1e-5)
    token_map = FrozenEncoder(tiny_bundle, feature="token_map")
    assert token_map.feature == "cls_patch_tokens" and token_map.layout.side == 8 and token_map.dim == 65 * 64
    with pytest.raises(ValueError, match="cond.backend=onnx reads the graph's cls_pre_norm only"):
        FrozenEncoder(tiny_bundle, backend="onnx", feature="cls_post_norm")
    from visualizer.config import load_config

    demo, inpainting = (load_config(f"configs/{name}.yaml") for name in ("rcdm_fmnist_28", "rcdm_fmnist_28_tokenmap"))
    assert (demo.cond.feature, demo.model.map_channels, demo.model.global_mlp) == ("cls_post_norm", 0, True)
    assert (inpainting.cond.feature, inpainting.model.map_channels) == ("token_map", 16)
    with pytest.raises(ConfigError, match="cond.feature='cls_middle'"):
        tiny_config("cond.feature=cls_middle")
    with pytest.raises(ConfigError, match="model.kind=regression"):
        tiny_config("model.kind=regression", "diffusion.cond_drop_prob=0.1")


def test_the_onnx_graph_gives_the_cls_it_serves_inside_the_token_map(tiny_bundle: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle serving cls_patch_tokens (its CLS scaled by sqrt(N)) gives the CLS decoder its condition over ONNX:
    here a stand-in graph that outputs what such a bundle's graph outputs (an export would take seconds)."""
    torch_side = FrozenEncoder(tiny_bundle, feature="cls_patch_tokens")

    class Graph:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def run(self, pixels: np.ndarray, keep: np.ndarray) -> np.ndarray:
            out = read_feature(torch_side.encoder, torch_side.spec, torch.from_numpy(pixels), torch.from_numpy(keep))
            return out.numpy()

    import training.api

    real = training.api.load_encoder

    def serving_the_token_map(path):
        encoder, info = real(path)
        return encoder, dataclasses.replace(info, feature="cls_patch_tokens")

    monkeypatch.setattr("visualizer.features.OrtGraph", Graph)
    monkeypatch.setattr(training.api, "load_encoder", serving_the_token_map)
    onnx = FrozenEncoder(tiny_bundle, backend="onnx", feature="cls_post_norm")
    images, keep = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8), torch.arange(0, 64, 3)
    feat, served = onnx.embed_with_served(images, keep)
    assert feat.shape == (2, 64) and served.shape == (2, 65 * 64)
    want = FrozenEncoder(tiny_bundle, feature="cls_post_norm").embed(images, keep)
    torch.testing.assert_close(feat, want, atol=1e-5, rtol=1e-5)


def test_the_checkpoint_records_the_conditioning_and_its_classifier(tiny_bundle: Path, tiny_run: Path,
                                                                    tmp_path: Path) -> None:
    state = load_run(tiny_run)
    assert (state["cond_feature"], state["served_feature"], state["cond_dim"]) == ("cls_post_norm", "cls_pre_norm",
                                                                                  64)
    record = state["classifier"]
    assert tuple(record["coef"].shape) == (64, 10) and record["classes"] == list(range(10))
    assert record["names"][0] == "class_0" and record["feature"] == "cls_post_norm"
    assert 0 < state["quality"]["random_pair_distance"] < 1 and state["quality"]["feature"] == "cls_post_norm"
    pipe = RCDMPipeline.from_dirs(tiny_bundle, tiny_run)
    assert pipe.kind.startswith("CLS decoder on cls_post_norm") and pipe.classifier["classes"] == record["classes"]
    # a checkpoint from before cond.feature conditioned on the served feature, and still does
    old = tmp_path / "old"
    old.mkdir()
    legacy = {k: v for k, v in state.items() if k not in ("cond_feature", "served_feature", "classifier")}
    legacy["config"] = {**state["config"], "cond": {k: v for k, v in state["config"]["cond"].items()
                                                    if k != "feature"}}
    torch.save(legacy, old / "checkpoint.pt")
    assert RCDMPipeline.from_dirs(tiny_bundle, old).encoder.feature == "cls_pre_norm"
    # resuming a CLS run as a token-map one is refused before anything is overwritten
    shutil.copytree(tiny_run, tmp_path / "resumed")
    with pytest.raises(ValueError, match="not a rcdm decoder on cls_patch_tokens"):
        train(tiny_config("optim.max_steps=4", "cond.feature=token_map", "model.map_channels=4"), tiny_bundle,
              tmp_path / "resumed", resume=True)


def test_the_regression_decoder_has_one_output(tiny_bundle: Path, tiny_regression_run: Path) -> None:
    pipe = RCDMPipeline.from_dirs(tiny_bundle, tiny_regression_run)
    assert pipe.kind.startswith("regression decoder on cls_post_norm") and not pipe.guidance_trained
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    a, b = (pipe.sample(image, num_samples=2, seed=s) for s in (0, 1))
    assert a.shape == (2, 3, 16, 16) and torch.equal(a, b) and torch.equal(a[0], a[1])  # whatever the seed
    with pytest.raises(ValueError, match="condition dropout"):
        pipe.sample(image, num_samples=1, guidance_scale=2.0)
    assert load_run(tiny_regression_run)["quality"]["images"] == 10  # the quality figure as for any decoder


def test_the_paper_figure_says_what_varies_and_what_stays(tiny_bundle: Path, tiny_run: Path,
                                                          tiny_tokenmap_run: Path) -> None:
    from visualizer.figure import figure_row, paper_figure

    cls, token_map = (RCDMPipeline.from_dirs(tiny_bundle, run) for run in (tiny_run, tiny_tokenmap_run))
    assert token_map.kind.startswith("token-map decoder on cls_patch_tokens (an inpainting view")
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    keep = np.arange(0, 64, 3)
    rows = [figure_row(pipe, image, keep, num_samples=3, steps=2, seed=0) for pipe in (cls, token_map)]
    assert rows[0].spread_fraction is not None and len(rows[0].sample_classes) == 3
    assert rows[1].sample_classes is None  # that run measured no quality figure, so it has no classifier
    view = cls.encoder.model_view(image)[0].permute(1, 2, 0).numpy()
    bitmap = np.zeros(64, dtype=bool)
    bitmap[keep] = True
    picture, note = paper_figure(rows, view, bitmap.reshape(8, 8))
    assert picture.shape == (2 * 98 + 2, 5 * 98 + 2, 3)  # two rows of original, masked, 3 samples
    assert "Row 1: **CLS decoder on cls_post_norm" in note and "Row 2: **token-map decoder" in note
    assert "22/64 patches kept" in note and "of the distance between two random images" in note
    assert f"in {sum(c == rows[0].original_class for c in rows[0].sample_classes)} of 3 samples" in note


def test_the_app_shows_two_decoders_side_by_side(tiny_bundle: Path, tiny_run: Path, tiny_tokenmap_run: Path,
                                                 sample_png: Path, tmp_path: Path) -> None:
    from gradio_client import Client, handle_file
    from PIL import Image

    from tests.visualizer.test_app import _component, _free_port
    from visualizer.app import decoder_runs, launch

    parent = tmp_path / "runs"  # a directory holding both runs, the token-map one first by name
    shutil.copytree(tiny_tokenmap_run, parent / "a-tokenmap")
    shutil.copytree(tiny_run, parent / "b-cls")
    assert [p.name for p in decoder_runs(parent)] == ["a-tokenmap", "b-cls"]
    assert decoder_runs(tmp_path / "not-yet") == [tmp_path / "not-yet"]  # a run still to be written is waited for
    port = _free_port()
    demo = launch(tiny_bundle, parent, port=port, block=False)
    url = f"http://127.0.0.1:{port}/"
    try:
        about = _component(url, "decoder-info")["value"]
        assert about.index("CLS decoder") < about.index("Token-map decoder")  # the paper's view leads
        client = Client(url, verbose=False)
        picture, note = client.predict(handle_file(str(sample_png)), 0.7, 1, 2, 2, 1.0, 0, api_name="/figure")
        assert Image.open(picture).size == (4 * 98 + 2, 2 * 98 + 2)
        assert "Row 1: **CLS decoder" in note and "Row 2: **token-map decoder" in note and "19/64" in note
    finally:
        demo.close()
