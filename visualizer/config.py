"""RCDM decoder config: typed dataclasses filled from YAML and ``--set key=value`` overrides.

The parsing rules are pretraining's (``training.config``): unknown keys and mistyped values are errors that name
the key. Defaults are a small 32 px decoder; ``configs/rcdm_*.yaml`` state what differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from msn_core.features import FeatureError, parse_feature
from msn_core.sources import FILE_SOURCES, SOURCES
from training.api import ConfigError, build_dataclass, read_raw_config

__all__ = ["FEATURE_ALIASES", "MAX_GUIDANCE", "ConfigError", "RCDMConfig", "config_from_dict", "dump_config",
           "load_config", "recorded_config"]

MAX_GUIDANCE = 10.0  # classifier-free guidance scales beyond this only saturate samples
FEATURE_ALIASES = {"token_map": "cls_patch_tokens"}  # cond.feature names for what a feature is used as


@dataclass
class ModelConfig:
    # rcdm: the diffusion decoder. regression: a plain decoder trained with MSE from the same feature, one output
    # per condition (visualizer.regression; faithful and blurry: the decoder harness's reference)
    kind: str = "rcdm"
    image_size: int = 32  # resolution the decoder generates
    channels: int = 3  # 1 for grey data (Fashion-MNIST): one generated channel, shown as grey RGB
    block_out_channels: list[int] = field(default_factory=lambda: [64, 128, 128])
    attention: list[bool] = field(default_factory=lambda: [False, True, True])  # self-attention per level
    layers_per_block: int = 1
    attention_head_dim: int = 32
    resblock_updown: bool = True  # RCDM/ADM: down/upsample with a ResNet block instead of a strided conv
    norm_num_groups: int = 32
    dropout: float = 0.0
    learn_sigma: bool = False  # RCDM: predict the variance too (6 output channels) and train the hybrid loss
    cond_norm: bool = True  # LayerNorm (no affine) on the MSN feature before the projection
    # A spatial feature's token map (CLS + patch tokens, msn_core.features.FeatureLayout) enters where it belongs:
    # projected to this many channels per place, upsampled to the image and given to the UNet beside x_t (0: the
    # whole feature is one flat vector, RCDM's way).
    map_channels: int = 0
    global_mlp: bool = False  # the global path (CLS) through Linear-SiLU-Linear instead of one Linear


@dataclass
class DiffusionConfig:
    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"  # linear (RCDM) | squaredcos_cap_v2
    vb_weight: float = 1.0  # weight of the variational-bound term of the hybrid loss (learn_sigma only)
    # >0 trains a null embedding for classifier-free guidance; a decoder trained with 0 samples at guidance 1 only
    cond_drop_prob: float = 0.0
    sampler: str = "ddim"  # ddim (eta 0) | ddpm (ancestral, uses the learned variance) | dpmpp (DPM-Solver++ 2M)
    sample_steps: int = 50
    prediction: str = "epsilon"  # epsilon | v (v-prediction: the target stays informative at low SNR)
    # Min-SNR-gamma loss weighting (Hang et al. 2023): caps the weight of the easy low-noise draws; 0 = uniform
    min_snr_gamma: float = 0.0
    guidance_scale: float = 1.0  # 1 = plain conditional sampling


@dataclass
class DataConfig:
    # fashion-mnist | synthetic, or images on disk under root: auto (what --data DIR sets) | folder | image_folder |
    # file_list | glob, listed as pretraining lists them (msn_core.sources); labels are optional
    source: str = "fashion-mnist"
    root: str | None = None
    # images held out of training for the quality figure when the source has no val/test split (at most a tenth
    # of it; visualizer.data); 0 trains on every image
    holdout_images: int = 50
    load_size: int | None = None  # decode size; None: max(decoder size, encoder resize)
    batch_size: int = 64  # per process
    num_workers: int = 1
    hflip: bool = True  # the same flip for the decoder target and the encoder input, as RCDM
    synthetic_size: int = 512


@dataclass
class CondConfig:
    # What the decoder is conditioned on, read from the bundle's encoder in the same forward pass as the feature it
    # serves, whatever that is: cls_post_norm (the default, the paper's: the target encoder's [CLS] output, after
    # the final LayerNorm), token_map (the CLS and the patch tokens' map, cls_patch_tokens: an inpainting view,
    # whose samples reproduce the image), served (the bundle's own feature), or any name of msn_core.features.
    feature: str = "cls_post_norm"
    backend: str = "torch"  # torch (encoder.safetensors) | onnx (model.onnx: the served feature, or the CLS in it)
    mask_prob: float = 0.5  # fraction of training images whose encoder input is masked
    mask_ratio_min: float = 0.0  # masked images drop a ratio drawn uniformly in [min, max]
    mask_ratio_max: float = 0.9


@dataclass
class OptimConfig:
    lr: float = 2.0e-4
    weight_decay: float = 0.0
    warmup_steps: int = 100
    max_steps: int = 3000
    # Wall-clock cap of one invocation, in minutes (None: none). The learning rate is constant after warm-up, so
    # stopping early leaves a usable (less trained) decoder, and --resume continues towards max_steps.
    max_minutes: float | None = None
    # constant after warm-up, or cosine to 0 at max_steps or at max_minutes, whichever comes first (the decay then
    # ends with the time cap; a resumed run restarts the decay over its own minutes)
    lr_schedule: str = "constant"
    ema_decay: float = 0.999
    clip_grad: float = 1.0


@dataclass
class RunConfig:
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 where the hardware has it: training.run.precision) | fp32 | bf16
    log_every_steps: int = 25
    checkpoint_every_steps: int = 250
    sample_every_steps: int = 500  # 0: only at the end
    grid_images: int = 6  # conditioning images in the sample grid
    grid_samples: int = 4  # samples per conditioning image
    grid_mask_ratio: float = 0.7
    # Held-out images whose samples are classified at the end of each invocation (visualizer.quality: the class
    # consistency the app shows); 0 skips it.
    quality_images: int = 50
    progress_bar: bool = True


@dataclass
class RCDMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cond: CondConfig = field(default_factory=CondConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RCDMConfig:
    """Defaults, then the YAML file, then ``key=value`` overrides (values parsed as YAML)."""
    return config_from_dict(read_raw_config(path, overrides))


def config_from_dict(raw: dict[str, Any]) -> RCDMConfig:
    cfg = build_dataclass(RCDMConfig, raw)
    validate(cfg)
    return cfg


def recorded_config(raw: dict[str, Any]) -> RCDMConfig:
    """A run's recorded config (its checkpoint's or ``config.yaml``): one written before ``cond.feature`` existed
    conditioned its decoder on the bundle's served feature, and still means that."""
    cond = dict(raw.get("cond") or {})
    cond.setdefault("feature", "served")
    return config_from_dict({**raw, "cond": cond})


def validate(cfg: RCDMConfig) -> None:
    m, d, c = cfg.model, cfg.diffusion, cfg.cond
    levels = len(m.block_out_channels)
    if len(m.attention) != levels:
        raise ConfigError(f"model.attention has {len(m.attention)} entries, block_out_channels {levels}")
    if m.channels not in (1, 3):
        raise ConfigError(f"model.channels={m.channels}: expected 1 (grey) or 3 (RGB)")
    if m.image_size % 2 ** (levels - 1):
        raise ConfigError(f"model.image_size={m.image_size} must be divisible by 2**{levels - 1}")
    if any(ch % m.norm_num_groups for ch in m.block_out_channels):
        raise ConfigError(f"model.block_out_channels must be multiples of norm_num_groups={m.norm_num_groups}")
    if d.beta_schedule not in ("linear", "squaredcos_cap_v2"):
        raise ConfigError(f"diffusion.beta_schedule={d.beta_schedule!r}: expected linear or squaredcos_cap_v2")
    if d.sampler not in ("ddim", "ddpm", "dpmpp"):
        raise ConfigError(f"diffusion.sampler={d.sampler!r}: expected ddim, ddpm or dpmpp")
    if d.prediction not in ("epsilon", "v"):
        raise ConfigError(f"diffusion.prediction={d.prediction!r}: expected epsilon or v")
    if d.prediction == "v" and m.learn_sigma:
        raise ConfigError("diffusion.prediction=v with model.learn_sigma: the hybrid loss is written for epsilon")
    if d.min_snr_gamma < 0 or m.map_channels < 0:
        raise ConfigError("diffusion.min_snr_gamma and model.map_channels must be >= 0")
    if cfg.optim.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"optim.lr_schedule={cfg.optim.lr_schedule!r}: expected constant or cosine")
    if not 1 <= d.sample_steps <= d.num_train_timesteps:
        raise ConfigError(f"diffusion.sample_steps must be in [1, {d.num_train_timesteps}]")
    if not 0.0 <= d.cond_drop_prob < 1.0:
        raise ConfigError("diffusion.cond_drop_prob must be in [0, 1)")
    if not (0.0 <= c.mask_ratio_min <= c.mask_ratio_max < 1.0 and 0.0 <= c.mask_prob <= 1.0):
        raise ConfigError("cond: need 0 <= mask_ratio_min <= mask_ratio_max < 1 and mask_prob in [0, 1]")
    if c.backend not in ("torch", "onnx"):
        raise ConfigError(f"cond.backend={c.backend!r}: expected torch or onnx")
    if c.feature not in FEATURE_ALIASES and c.feature != "served":
        try:
            parse_feature(c.feature)
        except FeatureError as exc:
            raise ConfigError(f"cond.feature={c.feature!r}: {exc}, or token_map or served") from None
    if m.kind not in ("rcdm", "regression"):
        raise ConfigError(f"model.kind={m.kind!r}: expected rcdm or regression")
    if m.kind == "regression" and (d.cond_drop_prob > 0 or m.learn_sigma):
        raise ConfigError("model.kind=regression has one output and no unconditional branch: set "
                          "diffusion.cond_drop_prob=0 and model.learn_sigma=false")
    if cfg.data.source not in SOURCES:
        raise ConfigError(f"data.source={cfg.data.source!r}: expected {', '.join(SOURCES)}")
    if cfg.data.source in FILE_SOURCES and not cfg.data.root:
        raise ConfigError(f"data.root is required when data.source={cfg.data.source} (on the command line: --data DIR)")
    if cfg.data.holdout_images < 0:
        raise ConfigError(f"data.holdout_images={cfg.data.holdout_images}: expected 0 (hold none out) or more images")
    if cfg.run.precision not in ("auto", "fp32", "bf16") or cfg.run.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("run.precision must be auto|fp32|bf16 and run.device auto|cpu|cuda")
    if cfg.optim.max_minutes is not None and cfg.optim.max_minutes <= 0:
        raise ConfigError(f"optim.max_minutes={cfg.optim.max_minutes}: expected a positive number of minutes or null")
    if not 0.0 <= cfg.run.grid_mask_ratio < 1.0:
        raise ConfigError("run.grid_mask_ratio must be in [0, 1)")
    if cfg.run.quality_images < 0:
        raise ConfigError(f"run.quality_images={cfg.run.quality_images}: expected 0 (skip) or more images")
    if not 0.0 <= d.guidance_scale <= MAX_GUIDANCE:
        raise ConfigError(f"diffusion.guidance_scale must be in [0, {MAX_GUIDANCE:g}]")


def dump_config(cfg: RCDMConfig, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
