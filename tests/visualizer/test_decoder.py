"""RCDM decoder, diffusion loss/samplers and frozen features on tiny models."""

from __future__ import annotations

import pytest
import torch

from msn_core.masks import PAD
from tests.visualizer.conftest import tiny_config
from visualizer.config import ConfigError, load_config
from visualizer.decoder import RCDMDecoder
from visualizer.diffusion import Diffusion
from visualizer.features import FrozenEncoder, random_keep_rows


def _decoder(*extra: str) -> tuple[RCDMDecoder, Diffusion]:
    cfg = tiny_config(*extra)
    torch.manual_seed(0)
    return RCDMDecoder(cfg.model, cond_dim=64), Diffusion(cfg.diffusion, learn_sigma=cfg.model.learn_sigma)


def test_conditioning_enters_through_the_time_embedding() -> None:
    decoder, _ = _decoder("model.learn_sigma=true")
    unet = decoder.unet
    assert unet.config.class_embed_type == "identity" and unet.config.resnet_time_scale_shift == "scale_shift"
    assert decoder.cond_proj.out_features == unet.time_embedding.linear_2.out_features
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 500])
    with torch.no_grad():
        torch.nn.init.normal_(unet.conv_out.weight)  # the zero-free head so outputs depend on the condition
        out_a = decoder(x, t, torch.randn(2, 64))
        out_b = decoder(x, t, torch.randn(2, 64))
        out_null = decoder(x, t, torch.randn(2, 64), drop=torch.tensor([True, True]))
        out_null2 = decoder(x, t, torch.randn(2, 64), drop=torch.tensor([True, True]))
    assert out_a.shape == (2, 6, 16, 16)
    assert not torch.allclose(out_a, out_b)
    torch.testing.assert_close(out_null, out_null2)  # the null embedding ignores the feature


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_loss_is_finite_and_trains_every_parameter(learn_sigma: bool) -> None:
    decoder, diffusion = _decoder(f"model.learn_sigma={str(learn_sigma).lower()}")
    x0 = torch.rand(4, 3, 16, 16) * 2 - 1
    loss, stats = diffusion.loss(decoder, x0, torch.randn(4, 64))
    loss.backward()
    assert torch.isfinite(loss) and ("vb" in stats) == learn_sigma
    assert all(p.grad is not None for p in decoder.parameters())


@pytest.mark.parametrize("sampler,guidance", [("ddim", 1.0), ("ddpm", 1.0), ("ddim", 2.0)])
def test_sampling_shape_range_and_seed(sampler: str, guidance: float) -> None:
    decoder, diffusion = _decoder("model.learn_sigma=true")
    decoder.eval()
    feat = torch.randn(3, 64)

    def run(seed: int) -> torch.Tensor:
        return diffusion.sample(decoder, feat, image_size=16, steps=4, sampler=sampler, guidance_scale=guidance,
                                generator=torch.Generator().manual_seed(seed))

    a, b, c = run(0), run(0), run(1)
    assert a.shape == (3, 3, 16, 16) and a.min() >= -1 and a.max() <= 1
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)


def test_grey_decoder_generates_one_channel_shown_as_grey_rgb() -> None:
    decoder, diffusion = _decoder("model.channels=1", "model.learn_sigma=true")
    assert decoder.unet.config.in_channels == 1 and decoder.unet.config.out_channels == 2
    loss, _ = diffusion.loss(decoder, torch.rand(2, 1, 16, 16) * 2 - 1, torch.randn(2, 64))
    assert torch.isfinite(loss)
    decoder.eval()
    for sampler in ("ddim", "ddpm"):
        out = diffusion.sample(decoder, torch.randn(2, 64), image_size=16, steps=3, sampler=sampler,
                               generator=torch.Generator().manual_seed(0))
        assert out.shape == (2, 3, 16, 16)
        assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])


def test_ddim_rederives_epsilon_from_the_clipped_x0_as_adm() -> None:
    """The sampler equals a hand-written ADM DDIM (eta 0): x0 clipped, epsilon recomputed from it."""
    decoder, diffusion = _decoder()
    decoder.eval()
    with torch.no_grad():
        torch.nn.init.normal_(decoder.unet.conv_out.weight, std=3.0)  # large outputs: the clip matters
    feat, steps = torch.randn(2, 64), 5
    got = diffusion.sample(decoder, feat, image_size=16, steps=steps, sampler="ddim",
                           generator=torch.Generator().manual_seed(0))
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alpha_bar = torch.cumprod(1 - betas, 0).float()
    timesteps = [999 - i * (1000 // steps) for i in range(steps)]  # "trailing" spacing
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            a, a_prev = alpha_bar[t], alpha_bar[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0)
            eps = decoder(x, torch.full((2,), t), feat)
            x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
            eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    torch.testing.assert_close(got, x.clamp(-1, 1), atol=1e-3, rtol=1e-3)


def test_frozen_encoder_onnx_matches_torch_with_padded_masks(tiny_bundle) -> None:
    images = torch.randint(0, 256, (3, 3, 40, 48), dtype=torch.uint8)
    keep_idx = random_keep_rows(3, 64, [0.0, 0.5, 0.9], torch.Generator().manual_seed(0))
    assert (keep_idx != PAD).sum(1).tolist() == [64, 32, 6] and (keep_idx[:, 6:][2] == PAD).all()
    torch_enc, onnx_enc = FrozenEncoder(tiny_bundle, backend="torch"), FrozenEncoder(tiny_bundle, backend="onnx")
    got, want = onnx_enc.embed(images, keep_idx), torch_enc.embed(images, keep_idx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # padding does not change a row's feature
    row = torch_enc.embed(images[2:], keep_idx[2:, :6])
    torch.testing.assert_close(row, want[2:], atol=1e-5, rtol=1e-5)


def test_config_rejects_mistakes() -> None:
    with pytest.raises(ConfigError, match="model.channels"):
        load_config(None, ["model.channels=2"])
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=[true]"])
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(None, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match="data.root"):
        load_config(None, ["data.source=image_folder"])
    assert load_config("configs/rcdm_fmnist_32.yaml").data.source == "fashion-mnist"
    for name in ("rcdm_64", "rcdm_128"):  # image-folder configs: the root comes from --data-root
        assert load_config(f"configs/{name}.yaml", ["data.root=/data/imagenet"]).model.learn_sigma


def test_vb_term_vanishes_for_the_true_posterior() -> None:
    """With the exact noise and v = -1 (log-variance = the posterior's), the KL part of the hybrid loss is 0."""
    _, diffusion = _decoder("model.learn_sigma=true")
    x0 = torch.rand(4, 3, 8, 8) * 2 - 1
    noise, t = torch.randn_like(x0), torch.tensor([1, 10, 500, 999])
    x_t = diffusion._at("sqrt_ac", t) * x0 + diffusion._at("sqrt_1m_ac", t) * noise
    exact = diffusion._vb_bits(-torch.ones_like(x0), noise, x0, x_t, t)
    wrong = diffusion._vb_bits(torch.ones_like(x0), noise, x0, x_t, t)
    assert abs(exact.item()) < 1e-4 < wrong.item()


def test_a_token_map_conditions_the_pixels_at_its_place() -> None:
    """model.map_channels: the map (here 4 x 4 places of 8 values after a 16-wide CLS) enters as input channels,
    upsampled to the image, so changing one place moves the output there more than far from it."""
    from msn_core.features import FeatureLayout

    cfg = tiny_config("model.map_channels=4", "model.global_mlp=true")
    torch.manual_seed(0)
    layout = FeatureLayout(16, 4, 8)
    decoder = RCDMDecoder(cfg.model, cond_dim=16 + 4 * 4 * 8, layout=layout)
    assert decoder.unet.config.in_channels == 3 + 4
    x, t, feat = torch.randn(1, 3, 16, 16), torch.tensor([300]), torch.randn(1, 16 + 128)
    moved = feat.clone()
    moved[0, 16: 16 + 8] += 5.0  # place (0, 0): the top-left quarter of the 16 x 16 image's 4 x 4 cells
    with torch.no_grad():
        channels = (decoder.condition(moved)[1] - decoder.condition(feat)[1]).abs().mean(dim=(0, 1))
        torch.nn.init.normal_(decoder.unet.conv_out.weight)
        out_change = (decoder(x, t, moved) - decoder(x, t, feat)).abs().max()
    assert channels[:4, :4].mean() > 10 * channels[8:, 8:].mean() and out_change > 0
    with pytest.raises(ValueError, match="token map"):
        RCDMDecoder(cfg.model, cond_dim=64, layout=FeatureLayout(64, 0, 0))


@pytest.mark.parametrize("extra", [("diffusion.prediction=v", "diffusion.min_snr_gamma=5"),
                                   ("diffusion.min_snr_gamma=5",)])
def test_v_prediction_and_min_snr_train_and_dpmpp_samples(extra: tuple[str, ...]) -> None:
    decoder, diffusion = _decoder(*extra)
    x0 = torch.rand(4, 3, 16, 16) * 2 - 1
    loss, _ = diffusion.loss(decoder, x0, torch.randn(4, 64))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in decoder.parameters())
    decoder.eval()
    feat = torch.randn(2, 64)
    a = diffusion.sample(decoder, feat, image_size=16, steps=5, sampler="dpmpp",
                         generator=torch.Generator().manual_seed(0))
    again = diffusion.sample(decoder, feat, image_size=16, steps=5, sampler="dpmpp",
                             generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, again)  # deterministic for a seed
    assert a.shape == (2, 3, 16, 16) and a.abs().max() <= 1 and torch.isfinite(a).all()


def test_cosine_learning_rate_ends_with_the_time_cap() -> None:
    from visualizer.train import learning_rate

    cfg = tiny_config("optim.lr_schedule=cosine", "optim.max_minutes=10", "optim.max_steps=100000",
                      "optim.warmup_steps=10", "optim.lr=1e-3")
    assert learning_rate(cfg, 4, 0.0) == pytest.approx(5e-4)  # warm-up
    assert learning_rate(cfg, 500, 300.0) == pytest.approx(5e-4, rel=1e-3)  # half the minutes: half the cosine
    assert learning_rate(cfg, 900, 600.0) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(tiny_config(), 500, 600.0) == tiny_config().optim.lr  # constant: as before
