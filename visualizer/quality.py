"""Cheap quality figures for a decoder at the end of its training: class consistency and feature similarity.

Class consistency is the protocol of ``benchmarks/evaluation/rcdm_eval.py`` at a smaller size, so that every run
(and the app showing it) carries one number: a low-shot logistic classifier on the bundle's features
(:func:`msn_core.lowshot.fit_logistic`, fitted on up to ``LABELLED_PER_CLASS`` labelled training images per class)
predicts the class of one sample per held-out image, conditioned on that image's unmasked embedding; the figure is
the fraction equal to the conditioning image's class (chance: 1 / classes). The classifier's accuracy on the
held-out originals is its ceiling. It needs labels: on unlabelled images (a flat folder) it is ``None`` with a
``class_consistency_reason``, and the log says so, rather than a zero that reads as a bad decoder.

Feature similarity needs no labels: the mean cosine between a sample's embedding and its conditioning image's, beside
the same with another held-out image's (``feature_similarity_other``, the level a decoder that ignores its condition
reaches). Faithfulness and sharpness as ``benchmarks/evaluation/decoder_harness.py`` measures them, on these images
(:mod:`visualizer.measures`): the re-encoded rank of each sample's conditioning image among up to ``GALLERY`` held-out
images, and the samples' high-frequency energy against their sources'. Held-out images come from :mod:`visualizer.data`.
Every figure is in the conditioning feature's space (``cond.feature``). Two things the app's paper figure needs are
recorded too: ``random_pair_distance``, the RMS pixel distance between two held-out images (the unit of a seed
spread), and, from :func:`quality_and_classifier`, the fitted classifier itself, which the checkpoint keeps.
Sampling uses the run's own sampler and step count at guidance 1 (pure conditional), as the app does by default.

Everything torch does happens before cyanure fits (a second guard: the fit itself puts back the OpenMP settings
cyanure changes in torch's runtime, :mod:`msn_core.openmp`), and the global RNG streams are left untouched so that a
resumed run stays bit-exact.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from msn_core.lowshot import fit_logistic
from training.api import eval_transform
from visualizer.config import RCDMConfig
from visualizer.data import DecoderData
from visualizer.diffusion import Diffusion
from visualizer.features import FrozenEncoder, to_uint8
from visualizer.measures import random_pair_distance, recall_at, reencoded_ranks, sharpness_ratio

__all__ = ["LABELLED_PER_CLASS", "balanced", "describe", "measure_quality", "quality_and_classifier"]

log = logging.getLogger("msn.visualize")
LABELLED_PER_CLASS = 100  # as rcdm_eval.py's default
GALLERY = 1000  # held-out images the conditioning image is ranked among
MAX_LABELLED = 2000  # many classes: fewer labelled images per class, so the figure stays cheap
BATCH = 64


def balanced(labels: np.ndarray, per_class: int, rng: np.random.Generator, exclude: np.ndarray) -> np.ndarray:
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


def _picks(data: DecoderData, wanted: int, rng: np.random.Generator) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """``(held, chosen, labelled)``: the held-out dataset, the indices sampled from it and (labelled data only) the
    training indices the classifier fits on; without a held-out set, training images the classifier does not see."""
    held = data.held_out if data.held_out is not None else data.train
    none = np.array([], dtype=np.int64)
    if not data.labelled:
        return held, np.sort(rng.permutation(len(held))[:wanted]), none
    train_labels = np.asarray(data.train.labels)
    per_class = max(1, min(LABELLED_PER_CLASS, MAX_LABELLED // len(np.unique(train_labels))))
    labelled = balanced(train_labels, per_class, rng, none)
    held_labels = np.asarray(held.labels)
    per_held = -(-wanted // len(np.unique(held_labels)))
    chosen = balanced(held_labels, per_held, rng, labelled if held is data.train else none)[:wanted]
    return held, chosen, labelled


def decoder_view(images_uint8: torch.Tensor, size: int) -> torch.Tensor:
    """Images at the decoder's resolution, 0-255 (what its samples are compared with; the decoder's targets)."""
    return eval_transform(images_uint8, resize=size, crop=size, mean=[0.0] * 3, std=[1.0 / 255] * 3)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return round(float(np.mean(np.sum(a * b, axis=1))), 4)


def measure_quality(decoder: nn.Module, diffusion: Diffusion, encoder: FrozenEncoder, cfg: RCDMConfig,
                    data: DecoderData, *, step: int) -> dict | None:
    """The figures as a dict (see the module docstring), or ``None`` when ``run.quality_images`` is 0."""
    return quality_and_classifier(decoder, diffusion, encoder, cfg, data, step=step)[0]


def quality_and_classifier(decoder: nn.Module, diffusion: Diffusion, encoder: FrozenEncoder, cfg: RCDMConfig,
                           data: DecoderData, *, step: int) -> tuple[dict | None, dict | None]:
    """:func:`measure_quality`'s figure and the classifier it fitted (``None`` without labels), as a checkpoint
    keeps it: ``coef`` (d, k) float32 in the conditioning feature's space, ``classes``, ``names`` (the class
    names where the data has them), ``feature``."""
    if cfg.run.quality_images <= 0:
        return None, None
    started = time.perf_counter()
    rng = np.random.default_rng(cfg.run.seed)
    held, chosen, labelled = _picks(data, cfg.run.quality_images, rng)
    train_labels = np.asarray(data.train.labels) if data.labelled else None
    classes = np.unique(train_labels) if train_labels is not None else np.array([])
    reason = None
    if train_labels is None:
        which = "training" if getattr(data.train, "labels", None) is None else "held-out"
        reason = f"no labels: the {which} images have none, and class consistency needs them"
    elif len(classes) < 2:
        reason = "one class only: class consistency needs two or more"
    if len(chosen) == 0:
        return None, None

    was_training = decoder.training
    decoder.eval()
    devices = [encoder.device] if encoder.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        generator = torch.Generator().manual_seed(cfg.run.seed)
        labelled_feats = _embed(encoder, _stack(data.train, labelled)) if reason is None else None
        sources = _stack(held, chosen)
        cond = encoder.embed(sources)
        others = np.setdiff1d(np.arange(min(len(held), GALLERY + len(chosen))), chosen)[: GALLERY - len(chosen)]
        gallery_feats = np.concatenate([cond.cpu().numpy(), _embed(encoder, _stack(held, others))]) \
            if len(others) else cond.cpu().numpy()
        samples = torch.cat([
            to_uint8(diffusion.sample(decoder, chunk, image_size=cfg.model.image_size, guidance_scale=1.0,
                                      generator=generator))
            for chunk in cond.split(BATCH)])
        sample_feats = _embed(encoder, samples)
        original_feats = cond.cpu().numpy()
        ranks = reencoded_ranks(sample_feats, np.arange(len(chosen)), gallery_feats)
        size = cfg.model.image_size
        originals = decoder_view(sources, size).float().mean(dim=1).numpy()
        sharp = sharpness_ratio(samples.float().mean(dim=1).numpy(), originals)
        pair_distance = random_pair_distance(originals)  # the app's unit for the spread of one image's samples
    decoder.train(was_training)
    figure: dict = {"class_consistency": None, "class_consistency_reason": reason}
    record = None
    if reason is None:
        classifier = fit_logistic(labelled_feats, train_labels[labelled])  # after every torch call (docstring)
        names = getattr(data.train, "classes", None)
        record = {"coef": torch.from_numpy(np.asarray(classifier.coef, dtype=np.float32)),
                  "classes": [c.item() if hasattr(c, "item") else c for c in classifier.classes],
                  "names": list(names) if names else None, "feature": encoder.feature}
        truth = np.asarray(held.labels)[chosen]
        figure = {
            "class_consistency": round(float(np.mean(classifier.predict(sample_feats) == truth)), 4),
            "classifier_accuracy": round(float(np.mean(classifier.predict(original_feats) == truth)), 4),
            "chance": round(1.0 / len(classes), 4), "labelled_images": len(labelled)}
    figure.update({
        "median_rank": float(np.median(ranks)), "r_at_10": round(recall_at(ranks, 10), 4),
        "feature": encoder.feature, "random_pair_distance": round(pair_distance, 4),
        "gallery": len(gallery_feats), "sharpness_ratio": round(sharp, 3),
        "feature_similarity": _cosine(sample_feats, original_feats),
        "feature_similarity_other": _cosine(sample_feats, np.roll(original_feats, 1, axis=0))
        if len(chosen) > 1 else None,
        "images": len(chosen), "held_out": data.held_out_from, "mask_ratio": 0.0,
        "sampler": cfg.diffusion.sampler, "sample_steps": cfg.diffusion.sample_steps, "step": int(step),
        "seconds": round(time.perf_counter() - started, 1),
    })
    log.info("decoder quality at step %d: %s", step, describe(figure))
    return figure, record


def describe(quality: dict | None) -> str:
    """One line for people: the figures and what they were measured on, or ``quality not measured``."""
    if not quality:
        return "quality not measured"
    on = f"one sample each for {quality['images']} held-out images, unmasked, at step {quality['step']}"
    if quality.get("class_consistency") is None:
        text = f"class consistency not measured ({quality.get('class_consistency_reason')}; {on})"
    else:
        text = (f"class consistency {quality['class_consistency']:.2f} ({on}; the classifier scores "
                f"{quality['classifier_accuracy']:.2f} on the originals, chance {quality['chance']:.2f})")
    if quality.get("median_rank") is not None:
        text += (f"; re-encoded, its image ranks {quality['median_rank']:.0f} (median) of {quality['gallery']} "
                 f"held-out images, R@10 {quality['r_at_10']:.2f}; sharpness {quality['sharpness_ratio']:.2f} of "
                 "the originals'")
    if quality.get("feature_similarity") is not None:
        other = quality.get("feature_similarity_other")
        text += (f"; feature similarity {quality['feature_similarity']:.2f} to the conditioning image"
                 + (f" vs {other:.2f} to another" if other is not None else ""))
    return text
