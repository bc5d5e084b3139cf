"""Conv-stem ViTs (official ``deit_small_convstem`` / ``vitc_4gf``): structure, official conversion, export parity,
masking after the stem, training with the stem and what the EMA target does with its BatchNorm statistics."""

from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from msn_core.bundle import Architecture, BundleError, parse_bundle_info
from training import distributed as dist
from training.bundle import export
from training.bundle.convert import KeyMismatchError, kwargs_to_hf_config, official_to_ours, ours_to_official
from training.config import ConfigError, load_config
from training.model import vit
from training.model.load import load_encoder, load_trunk, trunk_keys
from training.model.msn import build_networks, ema_update
from training.model.stem import ConvStem, default_conv_stem
from training.model.vit import VisionTransformer, build_encoder, encoder_kwargs, parse_official_arch
from training.run.build import build_run
from training.run.checkpoints import Checkpoints
from training.run.schedules import StepHyperparameters
from training.run.state import Progress, TrainState
from training.run.step import train_step

# --- an official-format checkpoint, restated from src/deit.py (ConvEmbed + VisionTransformer) ----------------
#
# ConvEmbed(channels, strides): channels = [in_chans] + channels; for each i < len(channels) - 2 append
# Conv2d(c_i, c_{i+1}, 3, stride=strides[i], padding=1, bias=False), BatchNorm2d(c_{i+1}), ReLU; then
# Conv2d(c[-2], c[-1], 1, stride=strides[-1]) (with bias); all inside ``stem`` (nn.Sequential).
# vitc_4gf / deit_small_convstem: channels [48, 96, 192, 384, 384], strides [2, 2, 2, 2, 1], 384 / 11 blocks /
# 6 heads, mlp_ratio 3 / 6, qkv_bias, LayerNorm eps 1e-6.


def official_convstem_state(embed_dim, depth, mlp_ratio, channels, strides, image_size, seed=0, head=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    state = {"cls_token": rnd(1, 1, embed_dim, scale=0.02),
             "pos_embed": rnd(1, (image_size // math.prod(strides)) ** 2 + 1, embed_dim, scale=0.02)}
    widths = [3, *channels]
    for i in range(len(widths) - 2):
        conv, bn = f"patch_embed.stem.{3 * i}", f"patch_embed.stem.{3 * i + 1}"
        state[f"{conv}.weight"] = rnd(widths[i + 1], widths[i], 3, 3, scale=(2 / (9 * widths[i])) ** 0.5)
        state[f"{bn}.weight"] = 1 + rnd(widths[i + 1])
        state[f"{bn}.bias"] = rnd(widths[i + 1])
        state[f"{bn}.running_mean"] = rnd(widths[i + 1])
        state[f"{bn}.running_var"] = 0.5 + torch.rand(widths[i + 1], generator=g)
        state[f"{bn}.num_batches_tracked"] = torch.tensor(1234)
    last = f"patch_embed.stem.{3 * (len(widths) - 2)}"
    state[f"{last}.weight"] = rnd(widths[-1], widths[-2], 1, 1, scale=(2 / widths[-2]) ** 0.5)
    state[f"{last}.bias"] = rnd(widths[-1])
    hidden = int(embed_dim * mlp_ratio)
    for i in range(depth):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            state[b + norm + ".weight"], state[b + norm + ".bias"] = 1 + rnd(embed_dim), rnd(embed_dim)
        state[b + "attn.qkv.weight"], state[b + "attn.qkv.bias"] = rnd(3 * embed_dim, embed_dim), rnd(3 * embed_dim)
        state[b + "attn.proj.weight"], state[b + "attn.proj.bias"] = rnd(embed_dim, embed_dim), rnd(embed_dim)
        state[b + "mlp.fc1.weight"], state[b + "mlp.fc1.bias"] = rnd(hidden, embed_dim), rnd(hidden)
        state[b + "mlp.fc2.weight"], state[b + "mlp.fc2.bias"] = rnd(embed_dim, hidden), rnd(embed_dim)
    state["norm.weight"], state["norm.bias"] = 1 + rnd(embed_dim), rnd(embed_dim)
    if head:  # the projection head inside the official encoder: dropped by the conversion
        state["fc.fc1.weight"], state["fc.fc1.bias"] = rnd(16, embed_dim), rnd(16)
    return {f"module.{k}": v for k, v in state.items()}  # DDP prefix, as the released files have it


def official_stem_forward(state, images, layers):
    """The official ConvEmbed in eval mode, written with functional ops from the key list alone."""
    x = images
    for i in range(layers):
        conv, bn = f"patch_embed.stem.{3 * i}", f"patch_embed.stem.{3 * i + 1}"
        x = F.conv2d(x, state[f"{conv}.weight"], None, stride=2, padding=1)
        x = F.batch_norm(x, state[f"{bn}.running_mean"], state[f"{bn}.running_var"], state[f"{bn}.weight"],
                         state[f"{bn}.bias"], training=False, eps=1e-5)
        x = F.relu(x)
    last = f"patch_embed.stem.{3 * layers}"
    x = F.conv2d(x, state[f"{last}.weight"], state[f"{last}.bias"])
    return x.flatten(2).transpose(1, 2)


SMALL_SPEC = {"embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 3.0,
              "conv_stem_channels": (4, 8, 16, 32, 32), "conv_stem_strides": (2, 2, 2, 2, 1)}


def test_official_factories_and_structure():
    assert parse_official_arch("vitc_4gf") == ("vitc_4gf", 16)
    assert parse_official_arch("deit_small_convstem") == ("deit_small_convstem", 16)
    assert parse_official_arch("deit_small") == ("vit_small", 16)
    assert default_conv_stem(384, 16) == ((48, 96, 192, 384, 384), (2, 2, 2, 2, 1))
    assert default_conv_stem(192, 4) == ((96, 192, 192), (2, 2, 1))
    for name, mlp_ratio in (("vitc_4gf", 3), ("deit_small_convstem", 6)):
        model = build_encoder(name, 16, 224)
        assert (model.embed_dim, model.depth, model.num_heads, model.mlp_ratio) == (384, 11, 6, mlp_ratio)
        assert (model.patch_size, model.grid_size) == (16, 14)
        stem = model.patch_embed.stem
        convs = [m for m in stem if isinstance(m, torch.nn.Conv2d)]
        assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.bias is not None)
                for c in convs] == [(3, 48, (3, 3), (2, 2), (1, 1), False), (48, 96, (3, 3), (2, 2), (1, 1), False),
                                    (96, 192, (3, 3), (2, 2), (1, 1), False), (192, 384, (3, 3), (2, 2), (1, 1), False),
                                    (384, 384, (1, 1), (1, 1), (0, 0), True)]  # fmt: skip
        assert [type(m).__name__ for m in stem][:3] == ["Conv2d", "BatchNorm2d", "ReLU"]
        # the real-size official key layout loads strictly (BN buffers included)
        official = official_convstem_state(384, 11, mlp_ratio, [48, 96, 192, 384, 384], [2, 2, 2, 2, 1], 224)
        load_trunk(model, official_to_ours(official), "official")
        assert model.patch_embed.stem[1].num_batches_tracked.item() == 1234
    with pytest.raises(ValueError, match="patch size 16, not 8"):
        build_encoder("vitc_4gf", 8, 224)


def test_official_init_kaiming_convs_and_fresh_batchnorm():
    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, embed_dim=64, depth=1, num_heads=2,
                              conv_stem_channels=[32, 64, 64], conv_stem_strides=[2, 2, 1])
    for module in model.patch_embed.modules():
        if isinstance(module, torch.nn.Conv2d):
            fan_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
            expected = math.sqrt(2.0 / fan_in)
            assert abs(module.weight.std().item() - expected) / expected < 0.15
            assert module.bias is None or module.bias.abs().max() == 0
        elif isinstance(module, torch.nn.BatchNorm2d):
            assert torch.equal(module.weight, torch.ones_like(module.weight)) and module.bias.abs().max() == 0
            assert module.running_mean.abs().max() == 0 and torch.equal(module.running_var,
                                                                       torch.ones_like(module.running_var))


def test_stem_matches_the_official_forward_and_masks_after_it():
    official = official_convstem_state(32, 2, 3.0, [4, 8, 16, 32, 32], [2, 2, 2, 2, 1], 64, seed=1)
    trunk = official_to_ours(official)
    assert set(trunk) == set(trunk_keys(2, stem_layers=4)) and not any(k.startswith("fc.") for k in trunk)
    encoder = load_trunk(VisionTransformer(image_size=64, **SMALL_SPEC), trunk, "official").eval()
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tokens = encoder.patch_embed(images)
        torch.testing.assert_close(tokens, official_stem_forward(trunk, images, 4), atol=1e-5, rtol=1e-5)
        # patch dropping gathers tokens of the stem's 4x4 grid: the stem always sees the whole image
        keep_idx = torch.tensor([[0, 5, 10, 15], [3, 2, 1, 0], [7, 8, 9, 12]])
        prepared = encoder.prepare_tokens(images, keep_idx)
        expected = torch.gather(tokens + encoder.pos_embed[:, 1:], 1, keep_idx[..., None].expand(-1, -1, 32))
        torch.testing.assert_close(prepared[:, 1:], expected)
        full = encoder(images, torch.arange(16).expand(3, -1))[0]
        torch.testing.assert_close(full, encoder(images)[0])
    # the round trip back to official names keeps every key (BatchNorm buffers included)
    back = ours_to_official(trunk, {"fc1.weight": official["module.fc.fc1.weight"]})
    assert set(back) == {k for k in official if not k.startswith("module.fc.")} | {"module.fc.fc1.weight"}
    with pytest.raises(KeyMismatchError, match="running_var"):
        official_to_ours({k: v for k, v in official.items() if not k.endswith("stem.4.running_var")})
    with pytest.raises(KeyMismatchError, match="conv stem"):
        load_trunk(build_encoder("vit_tiny", 16, 64, embed_dim=32, depth=2, num_heads=2), trunk, "official")
    with pytest.raises(ValueError, match="no conv stem"):
        kwargs_to_hf_config(encoder_kwargs(encoder))


def run_onnx(bundle, images, keep_idx):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return session.run(["embedding"], {"pixel_values": images.numpy(), "keep_idx": keep_idx.numpy()})[0]


def test_official_convstem_checkpoint_exports_with_parity(tmp_path, monkeypatch):
    monkeypatch.setitem(vit.CONV_STEM_ARCHS, "vitc_4gf", dict(SMALL_SPEC))  # a narrow 2-block vitc_4gf
    official = official_convstem_state(32, 2, 3.0, [4, 8, 16, 32, 32], [2, 2, 2, 2, 1], 224, seed=3)
    path = tmp_path / "vitc_4gf.pth.tar"
    torch.save({"target_encoder": official, "prototypes": torch.randn(8, 16), "epoch": 5}, path)
    out = tmp_path / "bundle"
    # 224 px weights exported at 64 px: the positional grid is resized 14x14 -> 4x4, the stem is unchanged
    assert export.main(["--from-official", str(path), "--arch", "vitc_4gf", "--out", str(out),
                        "--image-size", "64"]) == 0  # fmt: skip
    document = json.loads((out / "msn.json").read_text())
    arch = document["architecture"]
    assert arch["name"] == "vitc_4gf" and arch["patch_size"] == 16 and arch["image_size"] == 64
    assert arch["conv_stem_channels"] == [4, 8, 16, 32, 32] and arch["conv_stem_strides"] == [2, 2, 2, 2, 1]
    diffs = document["parity"]["max_abs_diff"]  # export's own ORT-vs-torch check: all, 30 % and padded K
    assert set(diffs) == {"keep_all", "keep_30pct", "padded_mixed"} and max(diffs.values()) <= 1e-4
    loaded, info = load_encoder(out)
    assert info.architecture.conv_stem and info.num_patches == 16
    assert loaded.patch_embed.stem[4].num_batches_tracked.item() == 1234
    generator = torch.Generator().manual_seed(4)
    images = torch.randn(2, 3, 64, 64, generator=generator)
    keep_idx = torch.stack([torch.randperm(16, generator=generator)[:6] for _ in range(2)])
    with torch.no_grad():
        masked = loaded(images, keep_idx)[0]
        unmasked = loaded(images)[0]
    np.testing.assert_allclose(run_onnx(out, images, keep_idx), masked.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(run_onnx(out, images, torch.arange(16).expand(2, -1)), unmasked.numpy(),
                               atol=1e-4, rtol=0)
    assert not torch.allclose(masked, unmasked, atol=1e-3)


def test_architecture_record_carries_the_stem():
    plain = {"name": "vit_tiny", "image_size": 32, "patch_size": 16, "embed_dim": 32, "depth": 2, "num_heads": 2}
    assert "conv_stem_channels" not in Architecture.from_dict(plain).to_dict()  # old bundles read (and write) as before
    stem = {**plain, "conv_stem_channels": [16, 32, 32], "conv_stem_strides": [4, 2, 2]}
    arch = Architecture.from_dict(stem)
    assert arch.conv_stem and arch.conv_stem_strides == (4, 2, 2)
    rebuilt = VisionTransformer(**arch.encoder_kwargs())
    assert rebuilt.conv_stem_strides == (4, 2, 2) and rebuilt.patch_size == 16
    for bad, match in (({"conv_stem_strides": [2, 2, 2]}, "give patch size 8"),
                       ({"conv_stem_channels": [16, 32, 64]}, "not embed_dim"),
                       ({"conv_stem_channels": [16, 32]}, "differ in length"),
                       ({"conv_stem_channels": None}, "go together")):
        with pytest.raises(BundleError, match=match):
            Architecture.from_dict({**stem, **bad})
    with pytest.raises(BundleError, match="conv_stem_channels"):
        parse_bundle_info({"format_version": 2, "model_id": "m", "architecture": {**stem, "conv_stem_channels": "x"},
                           "preprocessing": {"resize": 32, "crop": 32, "mean": [0, 0, 0], "std": [1, 1, 1]}})


# --- training ----------------------------------------------------------------------------------------------

TINY = ["data.source=synthetic", "data.synthetic_size=32", "data.load_size=28", "data.batch_size=8",
        "data.num_workers=0", "model.image_size=28", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.head_hidden_dim=64", "model.head_out_dim=16", "model.num_prototypes=32", "mask.num_focal=1",
        "mask.focal_size=12", "mask.ratio=0.3", "optim.fused=false", "run.precision=fp32"]


def test_config_expresses_a_small_stem():
    cfg = load_config(None, [*TINY, "model.conv_stem_channels=[16,32,32]", "model.conv_stem_strides=[2,2,1]"])
    assert cfg.model.conv_stem and cfg.model.patch_size == 4
    cfg = load_config(None, [*TINY, "model.conv_stem=true", "model.patch_size=4"])
    online, target = build_networks(cfg.model)
    encoder = online.net.encoder
    assert (encoder.conv_stem_channels, encoder.conv_stem_strides, encoder.grid_size) == ((16, 32, 32), (2, 2, 1), 7)
    assert target.encoder.conv_stem_strides == (2, 2, 1)
    with pytest.raises(ConfigError, match="give patch size 4"):
        load_config(None, [*TINY, "model.patch_size=8", "model.conv_stem_strides=[2,2,1]"])
    with pytest.raises(ConfigError, match="power of two"):
        load_config(None, [*TINY, "model.conv_stem=true", "model.patch_size=7"])


def test_ema_leaves_the_target_batchnorm_statistics_to_the_target():
    cfg = load_config(None, [*TINY, "model.conv_stem=true", "model.patch_size=4"])
    online, target = build_networks(cfg.model)
    bn_online, bn_target = online.net.encoder.patch_embed.stem[1], target.encoder.patch_embed.stem[1]
    with torch.no_grad():
        online(torch.randn(4, 3, 28, 28), None)
        bn_online.weight.add_(1.0)
    buffers = {k: v.clone() for k, v in target.named_buffers()}
    weight = bn_target.weight.clone()
    ema_update(target, online.net, 0.9, copy_buffers=False)
    assert all(torch.equal(v, buffers[k]) for k, v in target.named_buffers())  # buffers: not averaged, not copied
    torch.testing.assert_close(bn_target.weight, 0.9 * weight + 0.1 * bn_online.weight)  # BN affine: EMA'd
    assert not torch.equal(bn_target.running_mean, bn_online.running_mean)


def test_training_with_a_conv_stem_checkpoints_and_exports(tmp_path):
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, "model.conv_stem_channels=[16,32,32]", "model.conv_stem_strides=[2,2,1]"])
    run = build_run(cfg, dist.init_distributed("cpu"))
    assert run.target.training  # the target runs in train mode: its BatchNorms use (and track) batch statistics
    hyper = StepHyperparameters(lr=1e-3, weight_decay=0.04, ema_momentum=0.99, sharpen_temperature=0.25)
    images = next(iter(run.loader))[0]
    steps = 4
    losses = [train_step(run, hyper, images).loss.item() for _ in range(steps)]
    out = train_step(run, hyper, images)
    losses.append(out.loss.item())
    steps += 1
    assert all(math.isfinite(v) for v in losses)
    online_bn = run.online.net.encoder.patch_embed.stem[1]
    target_bn = run.target.encoder.patch_embed.stem[1]
    # the target's statistics come from its own forward passes (one per step, the unmasked target views);
    # the online BN also saw the focal views (two passes per step), and neither is copied to the other
    assert target_bn.num_batches_tracked.item() == steps and online_bn.num_batches_tracked.item() == 2 * steps
    assert target_bn.running_mean.abs().max() > 0 and not torch.allclose(target_bn.running_mean,
                                                                         online_bn.running_mean)
    # checkpoint -> resume restores the target's statistics; checkpoint -> export builds the same stem
    state = TrainState(run.online, run.target, run.optimizer)
    checkpoints = Checkpoints(run, state, tmp_path)
    checkpoints.save(Progress(step=steps), out)
    torch.manual_seed(1)
    resumed = build_run(cfg, dist.init_distributed("cpu"))
    Checkpoints(resumed, TrainState(resumed.online, resumed.target, resumed.optimizer), tmp_path).resume()
    for key, value in run.target.state_dict().items():
        assert torch.equal(resumed.target.state_dict()[key], value), key
    bundle = tmp_path / "bundle"
    assert export.main(["--checkpoint", str(checkpoints.path), "--out", str(bundle)]) == 0
    loaded, info = load_encoder(bundle)
    assert info.architecture.conv_stem_strides == (2, 2, 1) and info.patch_size == 4 and info.num_patches == 49
    target = run.target.encoder.eval()
    test_images = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(5))
    keep_idx = torch.stack([torch.randperm(49, generator=torch.Generator().manual_seed(6))[:20]] * 2)
    with torch.no_grad():
        expected = target(test_images, keep_idx)[0]
        torch.testing.assert_close(loaded(test_images, keep_idx)[0], expected, atol=0, rtol=0)
    np.testing.assert_allclose(run_onnx(bundle, test_images, keep_idx), expected.numpy(), atol=1e-4, rtol=0)
    assert isinstance(loaded.patch_embed, ConvStem)
