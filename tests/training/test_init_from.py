"""Warm start (``--init-from``): our checkpoint written in the official layout, read back into both networks.

The source is a real checkpoint of a tiny pretraining run. It goes through the official-layout converter, an exported
bundle and an HF ViTMSN folder, is loaded into freshly built (differently seeded) networks, and the warm-started
target encoder must embed held-out images as the source does. One run goes end to end through ``pretrain.py``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.training import test_pretrain
from training.bundle import export, to_official
from training.bundle.convert import kwargs_to_hf_config, official_head, official_to_ours, ours_to_hf
from training.bundle.sources import encoder_from_training_checkpoint
from training.bundle.warm_start import WarmStartError, model_settings, read_source, warm_start
from training.checkpoint import load_checkpoint
from training.config import config_from_dict
from training.data import build_dataset
from training.model.msn import build_networks
from training.model.vit import VisionTransformer, encoder_kwargs

REPO = Path(__file__).resolve().parents[2]
PRETRAIN, TINY = test_pretrain.PRETRAIN, test_pretrain.TINY  # the same tiny run as the pretraining tests


def _pretrain(output_dir: Path, extra: list[str], *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, PRETRAIN, "--output-dir", str(output_dir), *flags]
    for item in TINY + extra:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True, check=False)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """checkpoint.pt of a real 3-step run: online and target differ, head and prototypes are trained."""
    run_dir = tmp_path_factory.mktemp("source")
    _pretrain(run_dir, ["run.max_steps=3"])
    return run_dir / "checkpoint.pt"


def held_out_images(size: int = 16, count: int = 6) -> torch.Tensor:
    """Test-split images the source never trained on (the synthetic test split has its own seed)."""
    dataset = build_dataset("synthetic", split="test", load_size=size, synthetic_size=count)
    images = torch.stack([dataset[i].image for i in range(count)]).float() / 255
    return (images - 0.5) / 0.25


def fresh_networks(checkpoint: Path, seed: int = 123, **model):
    """The networks a new run of the source's config (with ``model`` overrides) builds, from another seed."""
    raw = load_checkpoint(checkpoint)["config"]
    raw["model"].update(model)
    torch.manual_seed(seed)
    return build_networks(config_from_dict(raw).model)


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a, b, dim=1).min().item()


@torch.no_grad()
def assert_embeds_like(encoder: VisionTransformer, source_encoder: VisionTransformer, size: int = 16) -> None:
    images = held_out_images(size)
    encoder, source_encoder = copy.deepcopy(encoder).eval(), source_encoder.eval()
    for got, expected in zip(encoder(images), source_encoder(images), strict=True):  # CLS before and after the norm
        assert min_cosine(got, expected) >= 0.9999
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def same_state(module: torch.nn.Module, state: dict) -> bool:
    own = module.state_dict()
    return set(own) == set(state) and all(torch.equal(own[k], state[k].to(own[k].dtype)) for k in own)


# --- the official layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False], ids=["module", "no-module"])
def test_to_official_writes_the_released_layout(source, tmp_path, prefix):
    out = tmp_path / "msn.pth.tar"
    argv = [str(source), "--out", str(out)] + ([] if prefix else ["--no-module-prefix"])
    assert to_official.main(argv) == 0
    official, ours = torch.load(out, weights_only=True), load_checkpoint(source)
    assert set(official) == {"target_encoder", "prototypes"}  # what the released files hold (msn#7)
    keys = official["target_encoder"]
    assert all(k.startswith("module.") == prefix for k in keys)
    p = "module." if prefix else ""
    dim = ours["encoder_kwargs"]["embed_dim"]
    assert keys[f"{p}blocks.0.attn.qkv.weight"].shape == (3 * dim, dim)  # fused q, k, v
    assert {f"{p}fc.fc1.weight", f"{p}fc.bn1.running_var", f"{p}fc.fc3.bias"} <= set(keys)  # the head as `fc`
    assert torch.equal(official["prototypes"], ours["prototypes"])
    # The reader msn-export --from-official uses takes it back exactly (tests/training/test_export.py: its features).
    assert all(torch.equal(v, ours["target_encoder"][k]) for k, v in official_to_ours(keys).items())
    assert all(torch.equal(v, ours["target_head"][k]) for k, v in official_head(keys).items())


def test_to_official_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for argv in ([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "o")],
                 [str(tmp_path / "junk.pt"), "--out", str(tmp_path / "o")]):
        with pytest.raises(SystemExit) as excinfo:
            to_official.main(argv)
        assert str(excinfo.value.code).startswith("to_official: ") and "\n" not in str(excinfo.value.code)
    assert not (tmp_path / "o").exists()


# --- warm starts from each kind of source -----------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False], ids=["module", "no-module"])
def test_official_checkpoint_warm_starts_both_networks(source, tmp_path, prefix):
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official, ddp_prefix=prefix)
    online, target = fresh_networks(source)
    loaded = read_source(official)
    assert loaded.kind == "official" and "num_heads" not in loaded.architecture  # 32 wide: no deit_* factory
    notes = warm_start(online, target, loaded)
    source_encoder, _ = encoder_from_training_checkpoint(source)
    assert_embeds_like(target.encoder, source_encoder)
    # Released weights hold the target only: the online network starts from it too, head and prototypes included.
    assert_embeds_like(online.net.encoder, source_encoder)
    ours = load_checkpoint(source)
    assert same_state(target.head, ours["target_head"]) and same_state(online.net.head, ours["target_head"])
    assert torch.equal(online.prototypes.detach(), ours["prototypes"])
    assert not any(level >= logging.WARNING for level, _ in notes), notes


def test_our_checkpoint_and_run_directory_warm_start_online_from_online(source):
    ours = load_checkpoint(source)
    for path in (source, source.parent):
        online, target = fresh_networks(source)
        loaded = read_source(path)
        assert loaded.kind == "training"
        warm_start(online, target, loaded)
        assert same_state(target.encoder, ours["target_encoder"]) and same_state(target.head, ours["target_head"])
        assert same_state(online.net.encoder, ours["encoder"]) and same_state(online.net.head, ours["head"])
        assert torch.equal(online.prototypes.detach(), ours["prototypes"])
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(ours["encoder"][qkv], ours["target_encoder"][qkv])


def test_bundle_warm_starts_the_trunk_and_says_the_head_is_fresh(source, tmp_path):
    bundle = tmp_path / "bundle"
    assert export.main(["--checkpoint", str(source), "--out", str(bundle), "--no-parity"]) == 0
    source_encoder, _ = encoder_from_training_checkpoint(source)
    for path in (bundle, bundle / "encoder.safetensors"):
        online, target = fresh_networks(source)
        head_before = copy.deepcopy(target.head.state_dict())
        notes = warm_start(online, target, read_source(path))
        assert_embeds_like(target.encoder, source_encoder)
        assert_embeds_like(online.net.encoder, source_encoder)
        assert same_state(target.head, head_before)  # left as built
        assert any(level == logging.WARNING and "start fresh" in line and "trunk only" in line for level, line in notes)


def write_hf_folder(encoder: VisionTransformer, directory: Path) -> Path:
    """An HF ViTMSN folder as save_pretrained writes it (config.json + model.safetensors, legacy key names)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(kwargs_to_hf_config(encoder_kwargs(encoder))))
    save_file(ours_to_hf(encoder.state_dict()), str(directory / "model.safetensors"))
    return directory


def test_hf_folder_warm_starts_the_trunk(source, tmp_path):
    source_encoder, _ = encoder_from_training_checkpoint(source)
    hf_dir = write_hf_folder(source_encoder, tmp_path / "vit-msn")
    online, target = fresh_networks(source)
    loaded = read_source(hf_dir)
    assert loaded.kind == "hf" and loaded.target_head is None and loaded.prototypes is None
    notes = warm_start(online, target, loaded)
    assert_embeds_like(target.encoder, source_encoder)
    assert_embeds_like(online.net.encoder, source_encoder)
    assert any("start fresh" in line and "hf weights hold the trunk only" in line for _, line in notes)


def test_hf_folder_from_transformers_save_pretrained(source, tmp_path):
    """A folder transformers itself wrote: the warm-started trunk embeds as ViTMSNModel does (post-norm CLS)."""
    transformers = pytest.importorskip("transformers")
    source_encoder, _ = encoder_from_training_checkpoint(source)
    settings = kwargs_to_hf_config(encoder_kwargs(source_encoder))
    config = transformers.ViTMSNConfig(**{k: v for k, v in settings.items()
                                          if k not in ("architectures", "model_type")})
    torch.manual_seed(5)
    model = transformers.ViTMSNModel(config).eval()
    model.save_pretrained(tmp_path / "hf")
    online, target = fresh_networks(source)
    warm_start(online, target, read_source(tmp_path / "hf"))
    images = held_out_images()
    with torch.no_grad():
        expected = model(pixel_values=images).last_hidden_state[:, 0]
        got = copy.deepcopy(target.encoder).eval()(images)[1]
    assert min_cosine(got, expected) >= 0.9999


# --- adaptations and refusals -----------------------------------------------------------------------------


def test_other_image_size_resizes_position_embeddings(source, tmp_path):
    """A 16 px source into a 32 px run: the grid is resized as the source's own forward pass resizes it."""
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official)
    online, target = fresh_networks(source, image_size=32)
    notes = warm_start(online, target, read_source(official))
    assert target.encoder.pos_embed.shape[1] == 1 + 8 * 8
    assert any("resized from 4x4 to 8x8" in line for _, line in notes)
    source_encoder, _ = encoder_from_training_checkpoint(source)
    assert_embeds_like(target.encoder, source_encoder, size=32)


def test_other_prototype_count_keeps_the_head_and_draws_fresh_prototypes(source, tmp_path):
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official)
    online, target = fresh_networks(source, num_prototypes=16)
    notes = warm_start(online, target, read_source(official))
    assert same_state(target.head, load_checkpoint(source)["target_head"])
    assert online.prototypes.shape == (16, 16)
    assert any(level == logging.WARNING and "source has 32" in line and "model.num_prototypes=32" in line
               for level, line in notes)


def test_other_head_shape_starts_head_and_prototypes_fresh(source, tmp_path):
    online, target = fresh_networks(source, head_hidden_dim=48)
    notes = warm_start(online, target, read_source(source))
    assert any("model.head_hidden_dim=64" in line for _, line in notes)
    assert target.head.fc1.weight.shape == (48, 32)


@pytest.mark.parametrize(("model", "named"), [
    ({"depth": 3}, "--set model.depth=2"),
    ({"embed_dim": 48}, "--set model.embed_dim=32"),
    ({"patch_size": 8, "image_size": 16}, "--set model.patch_size=4"),
    ({"num_heads": 4}, "--set model.num_heads=2"),
])
def test_mismatched_trunk_is_one_clear_line(source, tmp_path, model, named):
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official)
    for path in (official, source):
        if "num_heads" in model and path == official:
            continue  # official weights do not store the number of heads (a 32-wide trunk is not a deit_* one)
        online, target = fresh_networks(source, **model)
        with pytest.raises(WarmStartError) as excinfo:
            warm_start(online, target, read_source(path))
        message = str(excinfo.value)
        assert named in message and "\n" not in message and str(path) in message


def test_model_settings_build_networks_that_take_everything(source, tmp_path):
    """The settings a plan can adopt for a warm start: a default-config run built with them takes the whole
    official source (trunk, head and prototypes) without an adaptation."""
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official)
    loaded = read_source(official)
    settings = model_settings(loaded)
    assert settings == {"model.embed_dim": 32, "model.depth": 2, "model.patch_size": 4, "model.head_hidden_dim": 64,
                        "model.head_out_dim": 16, "model.head_use_bn": True, "model.num_prototypes": 32}
    model = {key.removeprefix("model."): value for key, value in settings.items()}
    online, target = fresh_networks(source, **model, num_heads=2, arch="vit_small")
    notes = warm_start(online, target, loaded)
    assert not any(level >= logging.WARNING for level, _ in notes), notes


def test_unreadable_sources_are_clear_errors(tmp_path):
    (tmp_path / "junk.pth.tar").write_bytes(b"no pickle here")
    torch.save({"state_dict": {}}, tmp_path / "other.pth")
    (tmp_path / "empty").mkdir()
    for path, expected in ((tmp_path / "missing.pth.tar", "does not exist"),
                           (tmp_path / "junk.pth.tar", "not a readable torch checkpoint"),
                           (tmp_path / "other.pth", "official one (target_encoder, prototypes)"),
                           (tmp_path / "empty", "not a bundle")):
        with pytest.raises(WarmStartError, match=re.escape(expected)) as excinfo:
            read_source(path)
        assert "\n" not in str(excinfo.value)


# --- through pretrain.py ----------------------------------------------------------------------------------


def test_pretrain_init_from_official_then_resume_wins(source, tmp_path):
    """Step 0 of the warm-started run holds the source's target encoder: with the EMA momentum at 1 the target
    is not moved by the first step, so the saved target trunk is still the source's, bit for bit."""
    official = tmp_path / "msn.pth.tar"
    to_official.write_official(source, official, ddp_prefix=False)
    run_dir = tmp_path / "warm"
    frozen_target = ["optim.ema_start=1.0", "optim.ema_end=1.0"]
    result = _pretrain(run_dir, ["run.max_steps=1", *frozen_target], "--init-from", str(official), "--resume")
    assert "warm start from official weights" in result.stderr and "32 prototypes" in result.stderr
    state, ours = load_checkpoint(run_dir / "checkpoint.pt"), load_checkpoint(source)
    assert state["step"] == 1 and all(s["step"] == 1 for s in state["optimizer"]["state"].values())  # fresh Adam
    assert all(torch.equal(v, ours["target_encoder"][k]) for k, v in state["target_encoder"].items())
    assert state["config"]["run"]["init_from"] == str(official)
    # --resume of that run continues it; --init-from is not applied again (the log says so).
    again = _pretrain(run_dir, ["run.max_steps=2", *frozen_target], "--init-from", str(official), "--resume")
    assert "not applied" in again.stderr and load_checkpoint(run_dir / "checkpoint.pt")["step"] == 2


def test_pretrain_mismatch_exits_with_one_line(source, tmp_path):
    result = _pretrain(tmp_path / "bad", ["model.depth=3", "run.max_steps=1"], "--init-from", str(source),
                       check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain: --init-from") and "--set model.depth=2" in last
    assert not (tmp_path / "bad" / "checkpoint.pt").exists()


# --- benchmarks/training/warm_start.py (argument handling and its verdict; the lead runs it) -------------------


def test_warm_start_benchmark_plans_without_running(tmp_path, capsys):
    from benchmarks.training import warm_start as bench

    checkpoint = tmp_path / "demo" / "checkpoint.pt"  # need not exist for a dry run
    argv = ["--dry-run", "--checkpoint", str(checkpoint), "--minutes", "10", "--workdir", str(tmp_path / "w"),
            "--out", str(tmp_path / "r.json"), "--set", "optim.warm_lr_scale=0.25", "optim.warm_ema_start=0.996"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    pretrain = [line for line in out.splitlines() if "training.pretrain" in line]
    assert len(pretrain) == 1 and f"--init-from {checkpoint}" in pretrain[0]
    assert "--set optim.budget_minutes=10.0" in pretrain[0] and "fmnist_vit_tiny.yaml" in pretrain[0]
    assert pretrain[0].endswith("--set optim.warm_lr_scale=0.25 --set optim.warm_ema_start=0.996")  # docs' form
    assert out.count("msn-eval lowshot") == 4 and out.count("msn-eval knn") == 4  # 2 bundles x 2 features
    assert "cls_pre_norm" in out and "--shots 1 2 5 --splits 3" in out
    assert not (tmp_path / "w").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--minutes", "0"], "--minutes 0: must be positive"),
    (["--checkpoint", "/nonexistent/checkpoint.pt"], "make demo trains runs/demo/checkpoint.pt"),
    (["--config", "/nonexistent.yaml", "--dry-run"], "--config /nonexistent.yaml: no such file"),
])
def test_warm_start_benchmark_argument_errors(capsys, argv, expected):
    from benchmarks.training import warm_start as bench

    with pytest.raises(SystemExit) as excinfo:
        bench.main(argv)
    assert excinfo.value.code == 2 and expected in capsys.readouterr().err


def test_warm_start_benchmark_verdict():
    from benchmarks.training.warm_start import compare

    def lowshot(*means):
        return {"command": "lowshot", "results": [{"setting": f"{s}imgs_class", "mean": m}
                                                  for s, m in zip((1, 2, 5), means, strict=True)]}

    def knn(top1):
        return {"command": "knn", "results": [{"top1": top1}]}

    evals = {"source-served-lowshot": lowshot(50, 57, 66), "source-served-knn": knn(86.5),
             "warm-10min-served-lowshot": lowshot(51, 57, 67), "warm-10min-served-knn": knn(86.6)}
    result = compare(evals, "warm-10min")
    assert result["warm_at_least_source"] and result["metrics"]["served/knn"]["delta"] == pytest.approx(0.1)
    evals["warm-10min-served-knn"] = knn(86.0)
    assert not compare(evals, "warm-10min")["warm_at_least_source"]
    assert not compare({}, "warm-10min")["warm_at_least_source"]  # nothing measured is no verdict
