"""Collapse, read from the run's own logged signals: no labels needed.

MSN matches each anchor's soft assignment to the K prototypes with its target's (sharpened, Sinkhorn-balanced)
assignment. That objective has three degenerate solutions, each visible in the statistics every logged step
already carries (``training/model/losses.py`` ``LossTerms.summary``, ``training/run/step.py``):

- **uniform targets**: every target, and then every prediction, spreads evenly over all prototypes. The loss sits
  at log K and nothing is learnt, yet the loss looks flat rather than broken. Measured by the information the
  anchor's assignment carries about its image: the entropy of the mean prediction minus the mean per-sample
  entropy (``prototype_usage_entropy - entropy``, nats; a batch of B images can carry at most log B). A healthy
  run passes through a near-uniform phase too, early, when the sharpened targets of the random network flatten
  out, but its information stops falling there and climbs; a collapsed run's keeps falling towards 0. 8 px
  digits trained with the 28 px recipe did this: uniform within a few hundred steps, "finished successfully";
- **one prototype**: every image is assigned to the same few prototypes (the entropy of the mean prediction, or
  of the mean target, falls towards 0; read against log min(B, K), the most a batch of B can show): the classic
  collapse that me-max and Sinkhorn exist to prevent;
- **one embedding**: every image maps to (nearly) the same target embedding (``embedding_spread`` towards 0).

A condition must hold on ``PATIENCE`` consecutive logged records spanning at least ``MIN_SPAN_STEPS`` steps, so
one noisy batch never trips it. Each kind is reported once, with the likely cause and the settings to change.
The thresholds are fractions of log K or nats of information, not constants of a dataset; how early they fire on a
collapsing run and that they stay quiet on healthy ones is measured by ``benchmarks/training/collapse_check.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from training.config import Config

__all__ = ["Collapse", "CollapseDetector"]

# Below this many nats of information in the anchors' assignments (about their images), targets count as uniform.
MIN_INFORMATION = 0.005
UNIFORM_TARGETS = 0.9  # ... and the targets' mean per-sample entropy must be above this fraction of log K
MIN_PROTOTYPE_USAGE = 0.15  # entropy of the mean prediction or target / log min(batch, K)
MIN_EMBEDDING_SPREAD = 0.1  # std of normalised embeddings * sqrt(d); ~1 for well-spread embeddings
PATIENCE = 2  # consecutive logged records
MIN_SPAN_STEPS = 10  # ... spanning at least this many steps


@dataclass(frozen=True)
class Collapse:
    """A detected collapse: the step it was confirmed at, its kind and a message naming cause and remedy."""

    step: int
    kind: str  # "uniform_targets" | "one_prototype" | "one_embedding"
    message: str

    def record(self) -> dict[str, Any]:
        """The fields added to that step's ``metrics.jsonl`` record."""
        return {"collapse": self.kind, "collapse_message": self.message}


@dataclass(frozen=True)
class RunGeometry:
    """What the advice refers to: the view and prototype settings of the run."""

    image_size: int
    patch_size: int
    num_prototypes: int
    batch_size: int  # per rank: a batch of B uses at most B prototypes as argmax, so usage is read against log B
    sharpen_temperature: float
    me_max_weight: float
    lr: float

    @classmethod
    def from_config(cls, cfg: Config) -> RunGeometry:
        m = cfg.model
        return cls(m.image_size, m.patch_size, m.num_prototypes, cfg.data.batch_size, cfg.loss.sharpen_end,
                   cfg.loss.me_max_weight, cfg.optim.lr)


class CollapseDetector:
    """Feed it every logged record (``update``); it returns a ``Collapse`` the first time each kind is confirmed."""

    def __init__(self, geometry: RunGeometry, *, patience: int = PATIENCE, min_span_steps: int = MIN_SPAN_STEPS):
        self.geometry = geometry
        self.log_k = math.log(geometry.num_prototypes)
        self.log_usable = math.log(max(2, min(geometry.num_prototypes, geometry.batch_size)))
        self.patience, self.min_span_steps = patience, min_span_steps
        self.streaks: dict[str, list[int]] = {}  # kind -> steps of the current run of records showing it
        self.reported: set[str] = set()

    def signals(self, record: dict[str, Any]) -> dict[str, float]:
        """The normalised quantities the conditions read (missing statistics read as healthy)."""
        log_k = self.log_k
        usage = record.get("prototype_usage_entropy", log_k)
        return {
            "information": usage - record.get("entropy", 0.0),
            "target_uniformity": record.get("target_entropy", 0.0) / log_k,
            "prototype_usage": min(usage, record.get("target_usage_entropy", log_k)) / self.log_usable,
            "embedding_spread": record.get("embedding_spread", 1.0),
        }

    def conditions(self, s: dict[str, float]) -> dict[str, bool]:
        return {
            "uniform_targets": s["information"] < MIN_INFORMATION and s["target_uniformity"] > UNIFORM_TARGETS,
            "one_prototype": s["prototype_usage"] < MIN_PROTOTYPE_USAGE,
            "one_embedding": s["embedding_spread"] < MIN_EMBEDDING_SPREAD,
        }

    def update(self, step: int, record: dict[str, Any]) -> Collapse | None:
        s = self.signals(record)
        found = None
        for kind, holds in self.conditions(s).items():
            streak = self.streaks.setdefault(kind, [])
            if not holds:
                streak.clear()
                continue
            streak.append(step)
            confirmed = len(streak) >= self.patience and streak[-1] - streak[0] >= self.min_span_steps
            if confirmed and kind not in self.reported and found is None:
                self.reported.add(kind)
                found = Collapse(step, kind, self.message(kind, step, s))
        return found

    def message(self, kind: str, step: int, s: dict[str, float]) -> str:
        g = self.geometry
        if kind == "uniform_targets":
            what = (f"the targets are uniform (their entropy is {100 * s['target_uniformity']:.1f} % of log K, and "
                    f"the predictions tell the images apart by {s['information']:.4f} nats), so there is nothing "
                    "to match and the encoder stops learning")
            patches = g.image_size // g.patch_size
            if g.image_size <= 16:
                cause = (f"the images are too small for the views (model.image_size={g.image_size}, "
                         f"{g.patch_size}-px patches, {patches}x{patches} per view): upsample them, e.g. "
                         "--set model.image_size=32 (the patch grid follows model.patches_per_side), or ")
            else:
                cause = "the views may be too hard to match (crop scale, mask.ratio, augment strength): "
            advice = (f"{cause}sharpen the targets more (loss.sharpen_start/sharpen_end below "
                      f"{g.sharpen_temperature:g}) or use fewer prototypes (model.num_prototypes, now "
                      f"{g.num_prototypes})")
        elif kind == "one_prototype":
            what = (f"the predictions fall on a few of the {g.num_prototypes} prototypes (the entropy of their mean "
                    f"is {100 * s['prototype_usage']:.1f} % of what the batch could show)")
            advice = (f"raise loss.me_max_weight (now {g.me_max_weight:g}), keep loss.use_sinkhorn on, or lower "
                      f"optim.lr (now {g.lr:g})")
        else:
            what = (f"every image maps to nearly the same embedding (spread {s['embedding_spread']:.3f}, ~1 when "
                    "healthy)")
            advice = (f"lower optim.lr (now {g.lr:g}), raise optim.ema_start, or check that the views differ "
                      "(augment settings)")
        return f"step {step}: training has collapsed: {what}. To try: {advice}."
