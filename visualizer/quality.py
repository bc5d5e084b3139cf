"""A cheap quality figure for a decoder at the end of its training: class consistency of its samples.

The protocol of ``benchmarks/evaluation/rcdm_eval.py`` at a smaller size, so that every run (and the app showing it) carries
one number: a low-shot logistic classifier on the bundle's features (:func:`msn_core.lowshot.fit_logistic`, fitted
on up to ``LABELLED_PER_CLASS`` labelled training images per class) predicts the class of one sample per held-out
image, conditioned on that image's unmasked embedding; the figure is the fraction equal to the conditioning image's
class (chance: 1 / classes). The classifier's accuracy on the held-out originals is its ceiling. Sampling uses the
run's own sampler and step count at guidance 1 (pure conditional), as the app does by default.

Everything torch does happens before cyanure fits (cyanure's OpenMP runtime can slow torch's later work in the same
process), and the global RNG streams are left untouched so that a resumed run stays bit-exact.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from msn_core.lowshot import fit_logistic
from training.api import build_dataset
from visualizer.config import RCDMConfig
from visualizer.diffusion import Diffusion
from visualizer.features import FrozenEncoder, to_uint8

__all__ = ["LABELLED_PER_CLASS", "class_consistency", "describe"]

log = logging.getLogger("msn.visualize")
LABELLED_PER_CLASS = 100  # as rcdm_eval.py's default
MAX_LABELLED = 2000  # many classes: fewer labelled images per class, so the figure stays cheap
BATCH = 64


def _balanced(labels: np.ndarray, per_class: int, rng: np.random.Generator, exclude: np.ndarray) -> np.ndarray:
    """Up to ``per_class`` indices of every class, not in ``exclude``, interleaved (class 0, 1, ..., 0, 1, ...)."""
    allowed = np.ones(len(labels), dtype=bool)
    allowed[exclude] = False
    picks = [rng.permutation(np.flatnonzero((labels == c) & allowed))[:per_class] for c in np.unique(labels)]
    order = sorted((rank, c) for c, idx in enumerate(picks) for rank in range(len(idx)))
    return np.array([picks[c][rank] for rank, c in order], dtype=np.int64)


def _stack(dataset, indices: np.ndarray) -> torch.Tensor:
    return torch.stack([dataset[int(i)][0] for i in indices])


def _embed(encoder: FrozenEncoder, images: torch.Tensor) -> np.ndarray:
    return torch.cat([encoder.embed(images[i:i + 256]) for i in range(0, len(images), 256)]).cpu().numpy()


def class_consistency(decoder: nn.Module, diffusion: Diffusion, encoder: FrozenEncoder, cfg: RCDMConfig, *,
                      load_size: int, step: int) -> dict | None:
    """The figure as a dict (see the module docstring), or ``None`` when ``run.quality_images`` is 0 or the data
    has fewer than two classes."""
    images_wanted = cfg.run.quality_images
    if images_wanted <= 0:
        return None
    started = time.perf_counter()
    data = cfg.data
    train = build_dataset(data.source, root=data.root, split="train", load_size=load_size,
                          synthetic_size=data.synthetic_size, seed=cfg.run.seed)
    train_labels = np.asarray(train.labels)
    classes = np.unique(train_labels)
    if len(classes) < 2:
        return None
    rng = np.random.default_rng(cfg.run.seed)
    per_class = max(1, min(LABELLED_PER_CLASS, MAX_LABELLED // len(classes)))
    labelled = _balanced(train_labels, per_class, rng, np.array([], dtype=np.int64))
    try:  # held-out images; without a held-out split, training images the classifier does not see
        held_out = build_dataset(data.source, root=data.root, split="val" if data.source == "image_folder" else "test",
                                 load_size=load_size, synthetic_size=data.synthetic_size, seed=cfg.run.seed)
        exclude = np.array([], dtype=np.int64)
    except (FileNotFoundError, ValueError):
        held_out, exclude = train, labelled
    held_labels = np.asarray(held_out.labels)
    per_held = -(-images_wanted // len(np.unique(held_labels)))
    chosen = _balanced(held_labels, per_held, rng, exclude)[:images_wanted]
    if len(chosen) == 0:
        return None

    was_training = decoder.training
    decoder.eval()
    devices = [encoder.device] if encoder.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        generator = torch.Generator().manual_seed(cfg.run.seed)
        labelled_feats = _embed(encoder, _stack(train, labelled))
        originals = _stack(held_out, chosen)
        cond = encoder.embed(originals)
        samples = torch.cat([
            to_uint8(diffusion.sample(decoder, chunk, image_size=cfg.model.image_size, guidance_scale=1.0,
                                      generator=generator))
            for chunk in cond.split(BATCH)])
        sample_feats = _embed(encoder, samples)
        original_feats = cond.cpu().numpy()
    decoder.train(was_training)
    classifier = fit_logistic(labelled_feats, train_labels[labelled])  # after every torch call (module docstring)
    truth = held_labels[chosen]
    figure = {
        "class_consistency": round(float(np.mean(classifier.predict(sample_feats) == truth)), 4),
        "classifier_accuracy": round(float(np.mean(classifier.predict(original_feats) == truth)), 4),
        "chance": round(1.0 / len(classes), 4),
        "images": len(chosen), "labelled_images": len(labelled), "mask_ratio": 0.0,
        "sampler": cfg.diffusion.sampler, "sample_steps": cfg.diffusion.sample_steps, "step": int(step),
        "seconds": round(time.perf_counter() - started, 1),
    }
    log.info("decoder quality at step %d: class consistency %.3f (classifier on originals %.3f, chance %.3f)",
             step, figure["class_consistency"], figure["classifier_accuracy"], figure["chance"])
    return figure


def describe(quality: dict | None) -> str:
    """One line for people: the figure, what it was measured on, or ``not measured``."""
    if not quality:
        return "quality not measured"
    return (f"class consistency {quality['class_consistency']:.2f} at step {quality['step']} "
            f"(one sample each for {quality['images']} held-out images, unmasked; the classifier scores "
            f"{quality['classifier_accuracy']:.2f} on the originals, chance {quality['chance']:.2f})")
