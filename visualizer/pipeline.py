"""Load a trained decoder next to its bundle and sample images from a (masked) picture.

``RCDMPipeline.from_dirs(bundle, decoder_run)`` reads the run's ``checkpoint.pt`` (EMA weights, config) and the
bundle; ``pipeline.sample(image, keep_idx, num_samples=8)`` returns uint8 samples, one conditioning vector repeated
``num_samples`` times, as RCDM does, so what varies between samples is what the representation does not fix.

Guidance other than 1 is refused for a decoder whose checkpoint does not record condition dropout
(``cond_drop_prob`` > 0; older checkpoints lack the field and count as 0): classifier-free guidance mixes in the
unconditional prediction, and such a decoder never learned one (its "unconditional" samples are noise).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from training.api import load_checkpoint
from visualizer.config import MAX_GUIDANCE, RCDMConfig, recorded_config
from visualizer.decoder import build_decoder
from visualizer.diffusion import Diffusion, build_objective
from visualizer.features import FrozenEncoder, to_uint8
from visualizer.quality import describe
from visualizer.regression import Regression

__all__ = ["CHECKPOINT_FORMAT", "RCDMPipeline", "decoder_kind", "decoder_summary", "load_image", "load_run",
           "resolve_checkpoint"]

log = logging.getLogger("msn.visualize")
CHECKPOINT_FORMAT = "rcdm-decoder-checkpoint"
CHECKPOINT_VERSION = 1
MAX_PIXELS = 40_000_000


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    path = Path(path)
    path = path / "checkpoint.pt" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no decoder checkpoint at {path} (train one with `msn-visualize train`)")
    return path


def load_run(path: str | os.PathLike) -> dict:
    """A decoder checkpoint (``RUN_DIR`` or ``RUN_DIR/checkpoint.pt``), checked for format."""
    return load_checkpoint(resolve_checkpoint(path), fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION)


def load_image(path: str | os.PathLike, min_size: int = 1) -> torch.Tensor:
    """Decode an image file as uint8 RGB (1, 3, H, W); raises ValueError with a readable reason."""
    try:
        with Image.open(path) as image:
            if image.width * image.height > MAX_PIXELS:
                raise ValueError(f"image is {image.width}x{image.height}: more than {MAX_PIXELS // 10**6} MP")
            image.load()
            rgb = image.convert("RGB")
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"cannot read {Path(path).name} as an image ({type(exc).__name__}: {exc})") from None
    if min(rgb.size) < min_size:
        raise ValueError(f"image is {rgb.width}x{rgb.height}; the model needs at least {min_size} px per side")
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).unsqueeze(0).contiguous()


@dataclass
class RCDMPipeline:
    encoder: FrozenEncoder  # reads the decoder's conditioning feature (cond.feature)
    decoder: torch.nn.Module  # visualizer.decoder.RCDMDecoder, or visualizer.regression.RegressionDecoder
    diffusion: Diffusion | Regression
    config: RCDMConfig
    step: int
    name: str
    cond_drop_prob: float = 0.0  # as the checkpoint records it (0 when it does not)
    quality: dict | None = None  # visualizer.quality's figure, when the run measured one
    classifier: dict | None = None  # the quality figure's classifier in the conditioning space (visualizer.train)

    @property
    def kind(self) -> str:
        """What the decoder is, for people: a CLS, token-map or regression decoder on its feature."""
        return decoder_kind(self.config, self.encoder.feature, spatial=self.encoder.layout.side > 0)

    @property
    def guidance_trained(self) -> bool:
        """Whether the decoder learned an unconditional branch, i.e. whether guidance other than 1 means anything."""
        return self.cond_drop_prob > 0

    def guidance(self, requested: float | None = None) -> float:
        """The guidance scale to sample with: ``requested``, else the config's (1 for a decoder without an
        unconditional branch). Raises ``ValueError`` for a scale the decoder was not trained for."""
        if requested is None:
            return self.config.diffusion.guidance_scale if self.guidance_trained else 1.0
        scale = float(requested)
        if not self.guidance_trained and scale != 1.0:
            raise ValueError(f"guidance scale {scale:g} needs a decoder trained with condition dropout; {self.name}'s "
                             "decoder was not (its checkpoint records cond_drop_prob 0): use 1")
        if not 0.0 <= scale <= MAX_GUIDANCE:
            raise ValueError(f"guidance scale {scale:g} is outside [0, {MAX_GUIDANCE:g}]")
        return scale

    @classmethod
    def from_dirs(cls, bundle: str | os.PathLike, decoder: str | os.PathLike, *, device: str = "cpu",
                  backend: str | None = None, name: str | None = None) -> RCDMPipeline:
        state = load_run(decoder)
        cfg = recorded_config(state["config"])
        encoder = FrozenEncoder(bundle, backend=backend or cfg.cond.backend, device=device, feature=cfg.cond.feature)
        trained_on = state.get("bundle", {}).get("model_id")
        if trained_on and trained_on != encoder.model_id:
            log.warning("decoder %s was trained on bundle %s, not %s: samples may be meaningless",
                        decoder, trained_on, encoder.model_id)
        if int(state["cond_dim"]) != encoder.dim:
            raise ValueError(f"decoder expects {state['cond_dim']}-d features; the bundle gives {encoder.dim}-d")
        net = build_decoder(cfg.model, encoder.dim, encoder.layout)
        net.load_state_dict(state["ema"])
        net.to(device).eval().requires_grad_(False)
        return cls(encoder, net, build_objective(cfg), cfg, int(state["step"]), name or Path(bundle).name,
                   cond_drop_prob=float(state.get("cond_drop_prob") or 0.0), quality=state.get("quality"),
                   classifier=state.get("classifier"))

    @property
    def image_size(self) -> int:
        return self.decoder.image_size

    def sample(self, image_uint8: torch.Tensor, keep_idx: torch.Tensor | None = None, *, num_samples: int = 4,
               steps: int | None = None, guidance_scale: float | None = None, sampler: str | None = None,
               seed: int = 0) -> torch.Tensor:
        """uint8 (num_samples, 3, S, S) samples conditioned on one image (1, 3, H, W) and its kept patches."""
        feat = self.encoder.embed(image_uint8[:1], keep_idx)
        return self.sample_from_features(feat.expand(num_samples, -1), steps=steps, guidance_scale=guidance_scale,
                                         sampler=sampler, seed=seed)

    def sample_from_features(self, feat: torch.Tensor, *, steps: int | None = None,
                             guidance_scale: float | None = None, sampler: str | None = None,
                             seed: int = 0) -> torch.Tensor:
        scale = self.guidance(guidance_scale)
        generator = torch.Generator().manual_seed(seed)
        images = self.diffusion.sample(self.decoder, feat.to(self.encoder.device), image_size=self.image_size,
                                       steps=steps, sampler=sampler, guidance_scale=scale, generator=generator)
        return to_uint8(images)


def decoder_kind(cfg: RCDMConfig, feature: str, *, spatial: bool) -> str:
    """A decoder's label by what it is conditioned on and how (the app names each decoder so)."""
    if cfg.model.kind == "regression":
        return f"regression decoder on {feature} (MSE, one output: faithful and blurry)"
    if spatial:
        return f"token-map decoder on {feature} (an inpainting view: the patch tokens fix the layout)"
    if feature.startswith("cls"):
        return f"CLS decoder on {feature} (the paper's view: what the representation keeps)"
    return f"decoder on {feature}"


def decoder_summary(pipe: RCDMPipeline) -> str:
    """What the decoder is: its conditioning, its training step, its measured quality, and whether it can be
    guided."""
    kind = pipe.kind
    text = f"{kind[0].upper()}{kind[1:]}: step {pipe.step:,} of {pipe.config.optim.max_steps:,}; "
    text += f"{describe(pipe.quality)}."
    if pipe.guidance_trained:
        return (f"{text} Trained with condition dropout {pipe.cond_drop_prob:g}: guidance 1 samples from the "
                "embedding alone, 0 ignores it (unconditional), above 1 follows it more strictly.")
    return (f"{text} Guidance is fixed at 1 (plain conditional sampling): this decoder was trained without condition "
            "dropout, so it has no unconditional branch to guide with.")
