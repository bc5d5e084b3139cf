"""DDPM training (epsilon or v prediction, optional learned variance with RCDM's hybrid loss) and sampling.

Noise schedules and the sampling steps are diffusers' ``DDPMScheduler`` / ``DDIMScheduler`` /
``DPMSolverMultistepScheduler`` (DPM-Solver++ 2M: a sample in 10-25 model calls). v-prediction (Salimans & Ho
2022) with Min-SNR-gamma weighting (Hang et al. 2023) is optional: uniform epsilon MSE spends a third of its draws
at nearly pure noise, where the epsilon target says little about the image. The variational-bound
half of the hybrid loss (Nichol & Dhariwal, used by ADM and RCDM with ``learn_sigma``) is not in diffusers and is
written here: the KL between the true posterior q(x_{t-1} | x_t, x_0) and the model's Gaussian, in bits per
dimension, with the model mean detached so the bound trains only the variance; at t = 0 it is the discretised
Gaussian negative log-likelihood of the data.

Training draws timesteps and noise from torch's default generator (checkpointed, so resume is exact); sampling
takes its own ``torch.Generator`` so that a seed fixes the samples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from torch import Tensor, nn

from visualizer.config import DiffusionConfig, RCDMConfig
from visualizer.regression import Regression

__all__ = ["Diffusion", "build_objective", "discretized_gaussian_log_likelihood", "normal_kl"]


def build_objective(cfg: RCDMConfig) -> Diffusion | Regression:
    """The loss and the sampler of ``model.kind``: diffusion (RCDM) or the regression decoder's MSE."""
    if cfg.model.kind == "regression":
        return Regression(cfg.diffusion)
    return Diffusion(cfg.diffusion, learn_sigma=cfg.model.learn_sigma)


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def discretized_gaussian_log_likelihood(x: Tensor, mean: Tensor, log_scale: Tensor) -> Tensor:
    """log P(x) of 8-bit data in [-1, 1] under a Gaussian integrated over each pixel's bin (edges open)."""
    inv_std = torch.exp(-log_scale)
    cdf_plus = torch.special.ndtr(inv_std * (x - mean + 1.0 / 255))
    cdf_min = torch.special.ndtr(inv_std * (x - mean - 1.0 / 255))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


class Diffusion:
    """Noise schedule, training loss and samplers for one :class:`~visualizer.decoder.RCDMDecoder`."""

    def __init__(self, cfg: DiffusionConfig, *, learn_sigma: bool) -> None:
        self.cfg, self.learn_sigma = cfg, learn_sigma
        prediction = "v_prediction" if cfg.prediction == "v" else "epsilon"
        schedule = {"num_train_timesteps": cfg.num_train_timesteps, "beta_schedule": cfg.beta_schedule,
                    "beta_start": 1e-4, "beta_end": 0.02, "prediction_type": prediction,
                    "timestep_spacing": "trailing"}  # trailing: few-step sampling starts at t = T-1
        self.ddpm = DDPMScheduler(variance_type="learned_range" if learn_sigma else "fixed_small", clip_sample=True,
                                  **schedule)
        self.ddim = DDIMScheduler(set_alpha_to_one=True, clip_sample=True, **schedule)
        self.dpmpp = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
                                                 lower_order_final=True, **schedule)
        betas = self.ddpm.betas.double()
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
        posterior_var = betas * (1.0 - prev) / (1.0 - alphas_cumprod)
        self._tables = {
            "snr": alphas_cumprod / (1.0 - alphas_cumprod),
            "sqrt_ac": alphas_cumprod.sqrt(),
            "sqrt_1m_ac": (1.0 - alphas_cumprod).sqrt(),
            "coef_x0": betas * prev.sqrt() / (1.0 - alphas_cumprod),
            "coef_xt": (1.0 - prev) * (1.0 - betas).sqrt() / (1.0 - alphas_cumprod),
            "log_var_min": torch.log(torch.cat([posterior_var[1:2], posterior_var[1:]])),  # clipped at t=0
            "log_var_max": torch.log(betas),
        }

    def _at(self, name: str, t: Tensor) -> Tensor:
        return self._tables[name].to(t.device)[t].float()[:, None, None, None]

    # ------------------------------------------------------------------------------------------- training

    def loss(self, model: nn.Module, x0: Tensor, feat: Tensor, drop: Tensor | None = None) -> tuple[Tensor, dict]:
        """Epsilon (or v) MSE on uniform timesteps, Min-SNR weighted when ``min_snr_gamma`` > 0 (+ ``vb_weight`` x
        VB term when the variance is learned)."""
        t = torch.randint(0, self.cfg.num_train_timesteps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        x_t = self._at("sqrt_ac", t) * x0 + self._at("sqrt_1m_ac", t) * noise
        out = model(x_t, t, feat, drop).float()
        channels = x0.shape[1]
        eps = out[:, :channels]
        v = self.cfg.prediction == "v"
        target = self._at("sqrt_ac", t) * noise - self._at("sqrt_1m_ac", t) * x0 if v else noise
        gamma = self.cfg.min_snr_gamma
        if gamma > 0:
            snr = self._at("snr", t).flatten()
            weight = snr.clamp(max=gamma) / (snr + 1.0 if v else snr)
            mse = (weight * ((eps - target) ** 2).mean(dim=(1, 2, 3))).mean()
        else:
            mse = F.mse_loss(eps, target)
        stats = {"mse": mse.item()}
        if not self.learn_sigma:
            return mse, stats
        vb = self._vb_bits(out[:, channels:], eps.detach(), x0, x_t, t)
        stats["vb"] = vb.item()
        return mse + self.cfg.vb_weight * vb, stats

    def _vb_bits(self, v: Tensor, eps: Tensor, x0: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        true_mean = self._at("coef_x0", t) * x0 + self._at("coef_xt", t) * x_t
        true_log_var = self._at("log_var_min", t)
        x0_pred = (x_t - self._at("sqrt_1m_ac", t) * eps) / self._at("sqrt_ac", t)
        model_mean = self._at("coef_x0", t) * x0_pred + self._at("coef_xt", t) * x_t
        frac = (v + 1.0) / 2.0  # learned_range: interpolate log-variance between beta~_t and beta_t
        model_log_var = frac * self._at("log_var_max", t) + (1.0 - frac) * true_log_var
        kl = normal_kl(true_mean, true_log_var.expand_as(x0), model_mean, model_log_var).mean(dim=(1, 2, 3))
        nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var).mean(dim=(1, 2, 3))
        return (torch.where(t == 0, nll, kl) / math.log(2.0)).mean()

    # ------------------------------------------------------------------------------------------- sampling

    @torch.no_grad()
    def sample(self, model: nn.Module, feat: Tensor, *, image_size: int, steps: int | None = None,
               sampler: str | None = None, guidance_scale: float | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        """One image per row of ``feat`` (B, D), in [-1, 1], shape (B, 3, S, S); a grey decoder's
        (``model.channels == 1``) samples are repeated as grey RGB.

        ``sampler``: ``ddim`` (deterministic, eta 0), ``ddpm`` (ancestral, learned variance if trained) or ``dpmpp``
        (DPM-Solver++ 2M, deterministic, 10-25 steps);
        ``guidance_scale`` > 1 mixes in the null-conditioned prediction (classifier-free guidance). DDIM re-derives
        epsilon from the clipped x0 estimate, as ADM/RCDM's sampler does; diffusers' default keeps the unclipped
        epsilon, which on a young decoder turns every sample into noise.
        """
        steps = steps or self.cfg.sample_steps
        sampler = sampler or self.cfg.sampler
        scale = self.cfg.guidance_scale if guidance_scale is None else guidance_scale
        if sampler not in ("ddim", "ddpm", "dpmpp"):
            raise ValueError(f"sampler must be 'ddim', 'ddpm' or 'dpmpp', got {sampler!r}")
        if not 1 <= steps <= self.cfg.num_train_timesteps:
            raise ValueError(f"steps must be in [1, {self.cfg.num_train_timesteps}], got {steps}")
        base = {"ddim": self.ddim, "ddpm": self.ddpm, "dpmpp": self.dpmpp}[sampler]
        scheduler = type(base).from_config(base.config)  # a private copy: concurrent requests set other steps
        scheduler.set_timesteps(steps)
        channels = getattr(model, "channels", 3)
        device, batch = feat.device, feat.shape[0]
        x = torch.randn(batch, channels, image_size, image_size, generator=generator).to(device)
        guided = scale != 1.0
        if guided:
            feat = torch.cat([feat, feat])
            drop = torch.cat([torch.zeros(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool)]).to(device)
        for t in scheduler.timesteps:
            t_batch = torch.full((feat.shape[0],), int(t), device=device, dtype=torch.long)
            out = model(torch.cat([x, x]) if guided else x, t_batch, feat, drop if guided else None).float()
            if guided:
                cond, uncond = out.chunk(2)
                eps = uncond[:, :channels] + scale * (cond[:, :channels] - uncond[:, :channels])
                out = torch.cat([eps, cond[:, channels:]], dim=1)
            if sampler == "ddim":
                x = scheduler.step(out[:, :channels], t, x, eta=0.0, use_clipped_model_output=True).prev_sample
            elif sampler == "dpmpp":
                x = scheduler.step(out[:, :channels], t, x).prev_sample
            else:
                model_out = out if self.learn_sigma else out[:, :channels]
                x = scheduler.step(model_out, t, x, generator=generator).prev_sample
        return x.clamp(-1.0, 1.0).expand(-1, 3, -1, -1)
