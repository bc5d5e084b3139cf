"""The paper's figure: original | masked input | N samples from the masked image's representation, and what varies.

MSN's Fig. 1 (after RCDM) samples a decoder conditioned on the [CLS] representation of an image with 70 % of its
patches masked: what the samples share is what the representation encodes, what differs between them is what it
discards. :func:`paper_figure` draws that row for each decoder it is given (a CLS decoder, and beside it, labelled
so, a token-map decoder's inpainting view or a regression decoder's one output) and says under it, per decoder, what
was measured on these very samples:

- what varies: the samples' mean pairwise RMS pixel distance (:func:`visualizer.measures.spread`), as a fraction of
  the distance between two random held-out images that the run's quality figure recorded (``random_pair_distance``):
  0 means one image repeated, 1 as different as two unrelated images;
- what stays: the class the run's low-shot classifier (in the conditioning feature's space, kept in the checkpoint)
  finds in each re-encoded sample, against the class it finds in the unmasked original and in the masked
  condition itself; and the mean cosine between the samples' re-encoded features and the masked condition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from msn_core.lowshot import LinearClassifier
from visualizer.measures import spread
from visualizer.pipeline import RCDMPipeline
from visualizer.render import grid_image, masked_view, to_hwc

__all__ = ["FigureRow", "figure_row", "paper_figure"]

CELL_PX = 96


@dataclass
class FigureRow:
    """One decoder's samples for one masked image and what they keep."""

    kind: str  # the decoder, for people (RCDMPipeline.kind)
    samples: torch.Tensor  # uint8 (N, 3, S, S)
    kept: int  # patches kept of ``patches``
    patches: int
    spread: float  # RMS pixel distance between two samples, in [0, 1] grey units
    spread_fraction: float | None  # ``spread`` / the distance between two random held-out images
    original_class: str | None  # the classifier on the unmasked original, the masked condition and the samples
    condition_class: str | None
    sample_classes: list[str] | None
    similarity: float  # mean cosine of the re-encoded samples to the masked condition

    def line(self) -> str:
        """What varies and what stays, in one line of Markdown."""
        n = len(self.samples)
        varies = f"the {n} samples differ by RMS {self.spread:.3f}"
        if self.spread_fraction is not None:
            varies += f", {self.spread_fraction:.2f} of the distance between two random images"
        if self.sample_classes is None:
            stays = "class not measured (the decoder's run has no labelled classifier)"
        else:
            same = sum(c == self.original_class for c in self.sample_classes)
            stays = (f"the original's class *{self.original_class}* in {same} of {n} samples (the masked image's "
                     f"representation alone: *{self.condition_class}*)")
        return (f"**{self.kind}**, {self.kept}/{self.patches} patches kept. What varies: {varies}. What stays: "
                f"{stays}; re-encoded, the samples are at cosine {self.similarity:.2f} to the masked image's "
                "representation.")


def _classifier(pipe: RCDMPipeline) -> LinearClassifier | None:
    record = pipe.classifier
    if not record or record.get("feature", pipe.encoder.feature) != pipe.encoder.feature:
        return None
    coef = record["coef"]
    coef = coef.numpy() if isinstance(coef, torch.Tensor) else np.asarray(coef)
    return LinearClassifier(coef, np.asarray(record["classes"]))


def _name(pipe: RCDMPipeline, label) -> str:
    names = (pipe.classifier or {}).get("names")
    if names and isinstance(label, (int, np.integer)) and 0 <= int(label) < len(names):
        return str(names[int(label)])
    return str(label)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float().expand_as(a), dim=1).mean())


def figure_row(pipe: RCDMPipeline, image_uint8: torch.Tensor, keep_idx: torch.Tensor | np.ndarray, *,
               num_samples: int, steps: int | None = None, guidance: float | None = None,
               seed: int = 0) -> FigureRow:
    """``num_samples`` samples of ``pipe`` from one image (1, 3, H, W) with ``keep_idx`` kept, and their figures."""
    keep = torch.as_tensor(np.asarray(keep_idx), dtype=torch.int64)
    samples = pipe.sample(image_uint8, keep, num_samples=num_samples, steps=steps, guidance_scale=guidance,
                          seed=seed)
    condition, original = pipe.encoder.embed(image_uint8[:1], keep), pipe.encoder.embed(image_uint8[:1])
    feats = pipe.encoder.embed(samples)
    pixels = samples.float().mean(dim=1).numpy() / 255.0
    px = spread(pixels)
    reference = (pipe.quality or {}).get("random_pair_distance")
    classifier = _classifier(pipe)
    classes = None
    if classifier is not None:
        labels = classifier.predict(torch.cat([original, condition, feats]).cpu().numpy())
        classes = [_name(pipe, c) for c in labels]
    return FigureRow(kind=pipe.kind, samples=samples, kept=len(keep), patches=pipe.encoder.num_patches, spread=px,
                     spread_fraction=px / reference if reference else None,
                     original_class=classes[0] if classes else None, condition_class=classes[1] if classes else None,
                     sample_classes=classes[2:] if classes else None, similarity=_cosine(feats, condition))


def paper_figure(rows: list[FigureRow], view: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, str]:
    """The picture (one row per decoder: original | masked input | samples; ``view`` is the encoder's view, ``keep``
    the (grid, grid) keep bitmap) and the Markdown under it, one line per decoder in the same order."""
    masked = masked_view(view, keep)
    picture = grid_image([[view, masked] + [to_hwc(s) for s in row.samples] for row in rows], cell=CELL_PX)
    note = "  \n".join(f"Row {i + 1}: {row.line()}" for i, row in enumerate(rows))
    head = "Columns: the original (as the encoder sees it), the masked input, then the samples.  \n"
    return np.asarray(picture), head + note
