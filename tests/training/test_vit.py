"""ViT trunk, projection head and key mappings: numerics vs an official-style reference, masking, init, names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.bundle.convert import (
    hf_config_to_kwargs,
    hf_to_ours,
    kwargs_to_hf_config,
    official_to_ours,
    ours_to_hf,
    ours_to_official,
)
from training.bundle.sources import complete_preprocessing, resize_encoder
from training.model import vit
from training.model.heads import ProjectionHead, init_prototypes
from training.model.load import KeyMismatchError, load_trunk, trunk_keys
from training.model.vit import (
    ARCHS,
    VisionTransformer,
    build_encoder,
    encoder_kwargs,
    explicit_attention,
    parse_official_arch,
)

IMAGE, PATCH, DIM, DEPTH, HEADS = 32, 4, 48, 2, 3
NUM_PATCHES = (IMAGE // PATCH) ** 2


@pytest.fixture(scope="module")
def encoder() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(IMAGE, PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS).eval()
    with torch.no_grad():  # non-trivial norms/biases so the tests see every parameter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))


def reference_cls(
    model: VisionTransformer, images: torch.Tensor, keep: list[int] | None = None
) -> torch.Tensor:
    """Official deit.py semantics written out by hand (explicit softmax attention, no SDPA), one sample."""
    tokens = model.patch_embed.proj(images).flatten(2).transpose(1, 2) + model.pos_embed[:, 1:]
    if keep is not None:
        tokens = tokens[:, keep]
    x = torch.cat((model.cls_token + model.pos_embed[:, :1], tokens), dim=1)

    def split_heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], t.shape[1], HEADS, DIM // HEADS).transpose(1, 2)

    for block in model.blocks:
        h = F.layer_norm(x, (DIM,), block.norm1.weight, block.norm1.bias, eps=1e-6)
        q, k, v = map(split_heads, F.linear(h, block.attn.qkv.weight, block.attn.qkv.bias).chunk(3, dim=-1))
        attn = (q @ k.transpose(-2, -1) * (DIM // HEADS) ** -0.5).softmax(dim=-1)
        x = x + F.linear(
            (attn @ v).transpose(1, 2).reshape(x.shape), block.attn.proj.weight, block.attn.proj.bias
        )
        h = F.layer_norm(x, (DIM,), block.norm2.weight, block.norm2.bias, eps=1e-6)
        x = x + F.linear(
            F.gelu(F.linear(h, block.mlp.fc1.weight, block.mlp.fc1.bias)), *block.mlp.fc2.parameters()
        )
    return x[:, 0]


# --- numerics ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_matches_official_style_reference(encoder, images):
    pre, post = encoder(images)
    expected = torch.cat([reference_cls(encoder, images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(pre, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post, encoder.norm(pre))
    assert pre.shape == post.shape == (3, DIM)
    assert not torch.allclose(pre, post, atol=1e-3)  # the final LayerNorm really is applied to one of them


@torch.no_grad()
def test_keep_idx_with_all_patches_equals_no_keep_idx(encoder, images):
    all_idx = torch.arange(NUM_PATCHES).expand(len(images), -1)
    for got, want in zip(encoder(images, all_idx), encoder(images)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@torch.no_grad()
def test_kept_patches_equal_running_only_those_patches(encoder, images):
    keep = torch.randperm(NUM_PATCHES, generator=torch.Generator().manual_seed(2))[:19]
    pre, _ = encoder(images[:1], keep[None])
    torch.testing.assert_close(pre, reference_cls(encoder, images[:1], keep.tolist()), atol=1e-5, rtol=1e-5)
    # CLS is permutation invariant given positions (positions are added before dropping).
    shuffled, _ = encoder(images[:1], keep.flip(0)[None])
    torch.testing.assert_close(shuffled, pre, atol=1e-6, rtol=0)
    # Dropping a patch is the same as hiding it from attention.
    hidden = torch.zeros(1, NUM_PATCHES, dtype=torch.bool)
    hidden[0, keep] = True
    masked, _ = encoder(images[:1], keep_mask=hidden)
    torch.testing.assert_close(masked, pre, atol=1e-6, rtol=0)
    # and it matters: a different subset gives a different embedding
    other, _ = encoder(images[:1], keep[:10][None])
    assert (other - pre).abs().max() > 1e-3


@torch.no_grad()
def test_padded_mixed_keep_batch_equals_unpadded_runs(encoder, images):
    generator = torch.Generator().manual_seed(3)
    counts = [NUM_PATCHES, 20, 3]
    keep_idx = torch.zeros(3, NUM_PATCHES, dtype=torch.long)  # padding slots point at patch 0 on purpose
    keep_mask = torch.zeros(3, NUM_PATCHES, dtype=torch.bool)
    for row, count in enumerate(counts):
        keep_idx[row, :count] = torch.randperm(NUM_PATCHES, generator=generator)[:count]
        keep_mask[row, :count] = True
    padded_pre, padded_post = encoder(images, keep_idx, keep_mask)
    for row, count in enumerate(counts):
        solo_pre, solo_post = encoder(images[row : row + 1], keep_idx[row : row + 1, :count])
        torch.testing.assert_close(padded_pre[row : row + 1], solo_pre, atol=1e-6, rtol=0)
        torch.testing.assert_close(padded_post[row : row + 1], solo_post, atol=1e-6, rtol=0)
    unmasked, _ = encoder(images, keep_idx)  # without the mask the padding would leak into CLS
    assert (unmasked[2] - padded_pre[2]).abs().max() > 1e-3


def test_explicit_attention_equals_the_fused_kernel_with_and_without_key_mask():
    """The bf16 CPU path computes what F.scaled_dot_product_attention computes (fp32 here: exact up to rounding)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 9, 8, generator=g) for _ in range(3))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 4:] = False
    for m in (None, mask):
        torch.testing.assert_close(explicit_attention(q, k, v, m), F.scaled_dot_product_attention(q, k, v, attn_mask=m))


def test_bf16_autocast_on_cpu_takes_the_explicit_path_and_matches_fp32(encoder, images):
    """Under CPU bf16 autocast the trunk (explicit attention) stays within bf16 rounding of the fp32 trunk, masks
    included, and gradients flow."""
    keep = torch.stack([torch.randperm(NUM_PATCHES, generator=torch.Generator().manual_seed(i))[:40]
                        for i in range(len(images))])
    with torch.no_grad():
        ref, _ = encoder(images, keep)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = encoder(images, keep)
    assert 0 < (low.float() - ref).abs().max() < 0.05 * ref.abs().max()  # bf16-rounded, not the fp32 result
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert vit._cpu_bf16(torch.zeros(1))  # the path taken
        encoder(images, keep)[0].float().sum().backward()
    assert encoder.blocks[0].attn.qkv.weight.grad is not None
    encoder.zero_grad(set_to_none=True)


@torch.no_grad()
def test_pos_embed_interpolated_for_smaller_and_non_square_grids(encoder):
    torch.testing.assert_close(encoder.patch_pos_embed(8, 8), encoder.pos_embed[:, 1:], atol=0, rtol=0)
    stored = encoder.pos_embed[:, 1:].reshape(1, 8, 8, DIM).permute(0, 3, 1, 2)
    expected = F.interpolate(stored, size=(4, 6), mode="bicubic", align_corners=False)
    torch.testing.assert_close(encoder.patch_pos_embed(4, 6), expected.flatten(2).transpose(1, 2))

    small = torch.randn(2, 3, 16, 24)  # a "focal view" through a 32 px model, non-square
    assert encoder.patch_grid(16, 24) == (4, 6)
    pre, _ = encoder(small)
    assert pre.shape == (2, DIM) and torch.isfinite(pre).all()
    # A 16 px model holding the resized embeddings (what load_trunk does) sees the same thing.
    square = torch.randn(2, 3, 16, 16)
    resized = load_trunk(VisionTransformer(16, PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS),
                         encoder.state_dict(), "test").eval()  # fmt: skip
    torch.testing.assert_close(resized(square)[0], encoder(square)[0], atol=1e-6, rtol=0)
    keep = torch.tensor([[0, 5, 23], [23, 1, 2]])  # indices live in the 4x6 grid
    assert encoder(small, keep)[0].shape == (2, DIM)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        encoder(torch.randn(1, 3, 30, 32))


def test_drop_path_is_per_sample_and_off_in_eval(images):
    torch.manual_seed(0)
    model = VisionTransformer(IMAGE, PATCH, embed_dim=DIM, depth=4, num_heads=HEADS, drop_path_rate=0.5)
    assert [round(b.drop_path.drop_prob, 3) for b in model.blocks] == [0.0, 0.167, 0.333, 0.5]
    model.train()
    first, second = model(images)[0], model(images)[0]
    assert (first - second).abs().max() > 1e-4
    model.eval()
    torch.testing.assert_close(model(images)[0], model(images)[0], atol=0, rtol=0)
    drop = model.blocks[-1].drop_path.train()
    out = drop(torch.ones(4000, 1, 1))
    assert set(out.unique().tolist()) <= {0.0, 2.0} and 0.45 < (out == 0).float().mean() < 0.55


def test_gradients_reach_only_kept_positions(encoder, images):
    model = VisionTransformer(**encoder_kwargs(encoder))
    model.load_state_dict(encoder.state_dict())
    keep = torch.tensor([[1, 7, 40]])
    model(images[:1], keep)[1].sum().backward()
    touched = model.pos_embed.grad[0].abs().sum(dim=-1).nonzero().flatten().tolist()
    assert touched == [0, 2, 8, 41]  # CLS slot + kept patches (offset by the CLS slot)


# --- construction, init, names ----------------------------------------------------------------------------


def test_state_dict_uses_official_key_names_and_shapes(encoder):
    state = encoder.state_dict()
    assert list(state) == trunk_keys(DEPTH)
    assert state["pos_embed"].shape == (1, NUM_PATCHES + 1, DIM)
    assert state["cls_token"].shape == (1, 1, DIM)
    assert state["patch_embed.proj.weight"].shape == (DIM, 3, PATCH, PATCH)
    assert state["blocks.0.attn.qkv.weight"].shape == (3 * DIM, DIM)
    assert state["blocks.1.mlp.fc1.weight"].shape == (4 * DIM, DIM)


def test_init_matches_official_statistics():
    torch.manual_seed(0)
    model = VisionTransformer(image_size=64, patch_size=16, embed_dim=192, depth=2, num_heads=3)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert abs(module.weight.std().item() - 0.02) < 0.002, name
            assert module.bias.abs().max() == 0, name
        elif isinstance(module, torch.nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert module.bias.abs().max() == 0, name
    assert abs(model.pos_embed.std().item() - 0.02) < 0.003
    assert abs(model.cls_token.std().item() - 0.02) < 0.005
    kaiming_std = math.sqrt(2.0 / (3 * 16 * 16))  # fan_in, relu gain
    assert abs(model.patch_embed.proj.weight.std().item() - kaiming_std) / kaiming_std < 0.05


def test_arch_names_and_builders():
    assert parse_official_arch("deit_small") == ("vit_small", 16)
    assert parse_official_arch("deit_base_p4") == ("vit_base", 4)
    assert parse_official_arch("deit_large_p7") == ("vit_large", 7)
    assert parse_official_arch("deit_huge_p10") == ("vit_huge", 10)
    assert parse_official_arch("vitc_4gf") == ("vitc_4gf", 16)  # conv stem: tests/training/test_convstem.py
    for bad in ("deit_gigantic", "vitc_8gf", "resnet50", "deit_small_p0"):
        with pytest.raises(ValueError, match="deit_small"):
            parse_official_arch(bad)
    model = build_encoder("vit_small", 8, 32, depth=1, drop_path_rate=0.1)
    assert (model.embed_dim, model.depth, model.num_heads, model.patch_size) == (384, 1, 6, 8)
    assert (model.grid_size, model.num_patches) == (4, 16)
    assert ARCHS["vit_huge"] == (1280, 32, 16)
    with pytest.raises(ValueError, match="vit_small"):
        build_encoder("vit_gigantic", 16, 224)
    with pytest.raises(TypeError, match="qkv_bias"):
        build_encoder("vit_tiny", 16, 224, qkv_bias=False)
    rebuilt = VisionTransformer(**encoder_kwargs(model))
    rebuilt.load_state_dict(model.state_dict())
    assert encoder_kwargs(rebuilt) == encoder_kwargs(model)


def test_projection_head_and_prototypes():
    head = ProjectionHead(DIM, hidden_dim=64, out_dim=16)
    assert [name for name, _ in head.named_children()] == [
        "fc1",
        "bn1",
        "gelu1",
        "fc2",
        "bn2",
        "gelu2",
        "fc3",
    ]
    assert head(torch.randn(5, DIM)).shape == (5, 16)
    assert all(m.bias.abs().max() == 0 for m in head if isinstance(m, torch.nn.Linear))
    no_bn = ProjectionHead(DIM, hidden_dim=64, out_dim=16, use_bn=False)
    assert [name for name, _ in no_bn.named_children()] == ["fc1", "gelu1", "fc2", "gelu2", "fc3"]
    prototypes = init_prototypes(1024, 256)
    assert prototypes.shape == (1024, 256) and prototypes.requires_grad
    assert prototypes.abs().max() <= 1 / 16 and prototypes.abs().max() > 0.06


# --- key mappings -----------------------------------------------------------------------------------------


def test_official_round_trip_strips_ddp_prefix_and_head(encoder):
    head = ProjectionHead(DIM, hidden_dim=32, out_dim=8).state_dict()
    official = ours_to_official(encoder.state_dict(), head)
    assert "module.blocks.0.attn.qkv.weight" in official and "module.fc.bn1.running_var" in official
    trunk = official_to_ours({**official, "module.pred.weight": torch.zeros(1)})
    assert list(trunk) == list(encoder.state_dict())
    assert all(torch.equal(trunk[k], v) for k, v in encoder.state_dict().items())


def test_hf_mapping_uses_legacy_names_and_splits_qkv(encoder):
    trunk = encoder.state_dict()
    hf = ours_to_hf(trunk)
    layer0 = {key for key in hf if key.startswith("encoder.layer.0.")}
    names = ["layernorm_before", "attention.attention.query", "attention.attention.key",
             "attention.attention.value", "attention.output.dense", "layernorm_after",
             "intermediate.dense", "output.dense"]  # fmt: skip
    assert layer0 == {f"encoder.layer.0.{n}.{p}" for n in names for p in ("weight", "bias")}
    assert {"embeddings.cls_token", "embeddings.position_embeddings", "layernorm.weight"} <= set(hf)
    assert "embeddings.patch_embeddings.projection.weight" in hf
    qkv = trunk["blocks.1.attn.qkv.weight"]
    assert torch.equal(hf["encoder.layer.1.attention.attention.key.weight"], qkv[DIM : 2 * DIM])
    back = hf_to_ours({**ours_to_hf(trunk, prefix="vit."), "classifier.weight": torch.zeros(2, DIM)})
    assert set(back) == set(trunk) and all(torch.equal(back[k], v) for k, v in trunk.items())


def test_mapping_errors_name_the_keys(encoder):
    trunk = dict(encoder.state_dict())
    del trunk["blocks.1.norm2.bias"]
    with pytest.raises(KeyMismatchError, match=r"missing keys: blocks\.1\.norm2\.bias"):
        official_to_ours(trunk)
    with pytest.raises(KeyMismatchError, match=r"unexpected keys: .*blocks\.0\.attn\.bogus"):
        official_to_ours({**encoder.state_dict(), "blocks.0.attn.bogus": torch.zeros(1)})
    wider = VisionTransformer(IMAGE, PATCH, embed_dim=2 * DIM, depth=DEPTH, num_heads=HEADS)
    with pytest.raises(KeyMismatchError, match=r"cls_token: got \(1, 1, 48\), expected \(1, 1, 96\)"):
        load_trunk(wider, encoder.state_dict(), "test weights")
    deeper = VisionTransformer(IMAGE, PATCH, embed_dim=DIM, depth=DEPTH + 1, num_heads=HEADS)
    with pytest.raises(KeyMismatchError, match="weights have 2 blocks, the encoder expects 3"):
        load_trunk(deeper, encoder.state_dict(), "test weights")


def test_hf_config_round_trip_and_rejections(encoder):
    config = kwargs_to_hf_config(encoder_kwargs(encoder))
    assert config["intermediate_size"] == 4 * DIM and config["layer_norm_eps"] == 1e-6
    assert hf_config_to_kwargs(config) == {
        k: v for k, v in encoder_kwargs(encoder).items() if k != "drop_path_rate"
    }
    with pytest.raises(ValueError, match=r"layer_norm_eps=1e-12 \(expected 1e-06\)"):
        hf_config_to_kwargs({**config, "layer_norm_eps": 1e-12})


@torch.no_grad()
def test_resize_encoder_keeps_features_and_rescales_preprocessing(encoder):
    preprocessing = complete_preprocessing({"resize": 36, "crop": 32}, IMAGE)
    resized, new_preprocessing = resize_encoder(encoder, preprocessing, 16)
    assert resized.image_size == 16 and resized.pos_embed.shape == (1, 4 * 4 + 1, DIM)
    assert (new_preprocessing["resize"], new_preprocessing["crop"]) == (18, 16)
    assert new_preprocessing["mean"] == [0.485, 0.456, 0.406]
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(resized.eval()(images)[0], encoder(images)[0], atol=1e-6, rtol=0)
