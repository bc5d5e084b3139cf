"""Stalls, read from the run's own logged signals: no labels needed.

A stalled run is not collapsed (``training/run/collapse.py``): its prototypes stay in use and its embeddings spread,
so no collapse condition holds, yet it learns almost nothing and looks healthy on the progress bar. Two signals that
every logged record already carries (``training/model/losses.py`` ``LossTerms.summary``) tell it apart early:

- **the loss against log K**: the cross-entropy of a network that tells the K prototypes apart by nothing is
  log K, and a fresh network with the recipes' 256-d head starts within a few % of it. A learning run pulls the
  loss well below it within its first few hundred steps; a stalled one stays near it. The drop is read in
  fractions of log K, so one threshold serves any K, and from the higher of log K and the run's first records (a
  small head's confident random predictions can start the loss far above log K: coming down from there is
  learning too);
- **the targets' sharpening**: the mean entropy of the (sharpened, balanced) targets, against its value on the
  run's first records. A learning run's targets get sharper as the target encoder learns; a stalled run's do not.
  A healthy run's targets first flatten for a while, so this part alone would not do: it only confirms the loss.

Both are medians over a trailing window of logged records (robust to noisy batches), compared from
``CHECK_FRACTION`` of the planned steps on (at least ``MIN_CHECK_STEPS``), and must hold on ``PATIENCE`` records
spanning ``MIN_SPAN_STEPS``: a stall is reported once, within the first 10 % of any run of 1,100 planned steps or
more. The cause named is the learning rate when it is far below the batch's rule (``training/run/plan.py``: a
config can say nothing truer about a learning rate without labels), else views that keep too little of a small
image holding little detail (official crops, masking or photometric jitter: what stalled the digit folders,
docs/results-notes.md; on the rendered glyphs, with more detail, easier views did worse), else the targets'
temperature. The checks read
floats the monitor has already logged: no device sync of their own. A resumed run is not checked (its start, which
the targets are read against, was in an earlier launch). The runs the thresholds were chosen on, with their signals,
are in docs/training.md ("Stalls").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from training.config import Config
from training.run.plan import LOW_DETAIL, LOW_DETAIL_CROP, LOW_DETAIL_MASK, PAPER_START_LR, lr_for_batch

__all__ = ["Stall", "StallDetector"]

EASY_CROP_MIN, EASY_MASK = LOW_DETAIL_CROP, LOW_DETAIL_MASK  # views that keep most of an image (the plan's)
MAX_LOSS_DROP = 0.03  # stalled while the loss is less than this fraction of log K below log K (or its start) ...
MIN_SHARPENING = 0.02  # ... and the targets' entropy fell less than this fraction of log K below its start
CHECK_FRACTION = 0.05  # checked from this fraction of the planned steps ...
MIN_CHECK_STEPS = 100  # ... and at least this many steps in
WINDOW_FRACTION = 0.5  # the trailing window: this fraction of the steps to the first check ...
MIN_WINDOW_STEPS = 50  # ... at least this many steps
START_RECORDS = 3  # the targets' starting entropy: the median of the run's first records
PATIENCE = 2  # consecutive checks that must agree
MIN_SPAN_STEPS = 10  # ... spanning at least this many steps
LOW_LR = 4.0  # the learning rate is "far below the rule" under rule / LOW_LR


@dataclass(frozen=True)
class Stall:
    """A detected stall: the step it was confirmed at, the likely cause and a message naming the fix."""

    step: int
    cause: str  # "learning_rate" | "views" | "targets"
    message: str

    def record(self) -> dict[str, Any]:
        """The fields added to that step's ``metrics.jsonl`` record."""
        return {"stall": self.cause, "stall_message": self.message}


@dataclass(frozen=True)
class StallSettings:
    """What the rule and the advice refer to: the run's prototypes, global batch, peak learning rate, target
    temperatures and how much of an image its views keep (the crop's smallest share of the area, the share of
    patches masked, whether any photometric jitter is on, whether pose and stroke jitter are)."""

    num_prototypes: int
    global_batch: int
    lr: float
    sharpen_start: float
    sharpen_end: float
    crop_min: float = 0.3
    mask_ratio: float = 0.3
    photometric: bool = True
    small_images: bool = True  # under the paper's 64 px: where views were measured to stall a run
    # the images hold little detail (the planner's survey: at most 14 px; True when unknown): the digits, which
    # learned on views that keep more and jitter less; the rendered glyphs (19-28 px) did worse on those and best
    # on views that vary pose and stroke (docs/results-notes.md)
    low_detail: bool = True
    shape_jitter: bool = False

    @classmethod
    def from_config(cls, cfg: Config, global_batch: int, detail: int | None = None) -> StallSettings:
        """``detail``: the side the images' content needs, as the planner's survey measured it (None: unknown)."""
        loss, aug = cfg.loss, cfg.augment
        photometric = max(aug.color_jitter_p, aug.grayscale_p, aug.blur_p, aug.solarize_p) > 0
        return cls(cfg.model.num_prototypes, global_batch, cfg.optim.lr, loss.sharpen_start, loss.sharpen_end,
                   cfg.mask.rand_crop_scale[0], cfg.mask.ratio, photometric, cfg.model.image_size < 64,
                   detail is None or detail <= LOW_DETAIL, aug.affine_p > 0 and aug.stroke_p > 0)

    def hard_views(self) -> bool:
        """Small images whose views keep less of them (or, with more detail, vary less) than the views that got
        the stalled development sets learning."""
        if not self.small_images:
            return False
        keep_less = self.crop_min < EASY_CROP_MIN or self.mask_ratio > EASY_MASK
        return keep_less or (self.photometric if self.low_detail else not self.shape_jitter)


class StallDetector:
    """Feed it every logged record (``update``); it returns a ``Stall`` once, when a stall is confirmed."""

    def __init__(self, settings: StallSettings, *, total_steps: int, start_step: int = 0):
        self.settings = settings
        self.log_k = math.log(settings.num_prototypes)
        self.check_from = max(MIN_CHECK_STEPS, math.ceil(CHECK_FRACTION * total_steps))
        self.window_steps = max(MIN_WINDOW_STEPS, int(WINDOW_FRACTION * self.check_from))
        self.active = start_step == 0
        self.window: deque[tuple[int, float, float, float]] = deque()  # (step, loss, target entropy, entropy)
        self.start: list[tuple[float, float, float]] = []  # the first records' (loss, target entropy, entropy)
        self.streak: list[int] = []
        self.reported = False

    def update(self, step: int, record: dict[str, Any]) -> Stall | None:
        if not self.active or self.reported:
            return None
        try:
            values = (float(record["loss"]), float(record["target_entropy"]), float(record["entropy"]))
        except (KeyError, TypeError, ValueError):
            return None  # a record without the statistics: nothing to read
        if not all(map(math.isfinite, values)):
            return None
        if len(self.start) < START_RECORDS:
            self.start.append(values)
        self.window.append((step, *values))
        while self.window[0][0] <= step - self.window_steps:
            self.window.popleft()
        if step < self.check_from or len(self.window) < 2:
            return None
        s = self.signals()
        if s["loss_drop"] >= MAX_LOSS_DROP or s["sharpening"] >= MIN_SHARPENING:
            self.streak.clear()
            return None
        self.streak.append(step)
        if len(self.streak) < PATIENCE or self.streak[-1] - self.streak[0] < MIN_SPAN_STEPS:
            return None
        self.reported = True
        cause = ("learning_rate" if self.lr_far_below_rule() else "views" if self.settings.hard_views()
                 else "targets")
        return Stall(step, cause, self.message(cause, step, s))

    def signals(self) -> dict[str, float]:
        """The window's medians, read against log K and against the run's first records."""
        loss = statistics.median(v[1] for v in self.window)
        target_entropy = statistics.median(v[2] for v in self.window)
        entropy = statistics.median(v[3] for v in self.window)
        start_loss, start_target, start_entropy = (statistics.median(v[i] for v in self.start) for i in range(3))
        reference = max(self.log_k, start_loss)
        return {"loss": loss, "loss_drop": (reference - loss) / self.log_k, "target_entropy": target_entropy,
                "start_target_entropy": start_target, "sharpening": (start_target - target_entropy) / self.log_k,
                "entropy": entropy, "start_entropy": start_entropy}

    def rule_lr(self) -> float:
        return float(f"{lr_for_batch(self.settings.global_batch):.3g}")

    def lr_far_below_rule(self) -> bool:
        return self.settings.lr < self.rule_lr() / LOW_LR

    def message(self, cause: str, step: int, s: dict[str, float]) -> str:
        g = self.settings
        what = (f"the loss is {s['loss']:.2f} and has come down by only {100 * s['loss_drop']:.1f} % of log K = "
                f"{self.log_k:.2f} from its start (a learning run's comes down by {100 * MAX_LOSS_DROP:g} % or more "
                f"by now), and the targets have not sharpened (their entropy went from "
                f"{s['start_target_entropy']:.2f} to {s['target_entropy']:.2f} nats)")
        if cause == "learning_rate":
            rule = self.rule_lr()
            still = abs(s["start_entropy"] - s["entropy"]) < 0.01 * self.log_k
            why = (f"the learning rate is far too small: optim.lr={g.lr:g} is {rule / g.lr:.0f}x below "
                   f"1e-3 x sqrt({g.global_batch} / 1024) = {rule:g} for this global batch"
                   + (f"; the predictions have hardly moved (entropy {s['start_entropy']:.3f} -> "
                      f"{s['entropy']:.3f} nats)" if still else ""))
            fix = f"--set optim.lr={rule:g} optim.start_lr={min(PAPER_START_LR, rule):g}"
        elif cause == "views" and g.low_detail:
            why = (f"two views of an image share too little for one to predict the other's prototypes (crops from "
                   f"{g.crop_min:.0%} of the area, {g.mask_ratio:.0%} of the patches masked"
                   + (", photometric jitter" if g.photometric else "") + "); on small images with little detail "
                   "such runs stalled, and views keeping more of the image learned")
            fix = (f"--set mask.rand_crop_scale=[{EASY_CROP_MIN},1.0] mask.ratio={EASY_MASK} augment.color_jitter_p=0 "
                   "augment.grayscale_p=0 augment.blur_p=0")
        elif cause == "views":
            why = (f"views that crop from {g.crop_min:.0%} of the area and mask {g.mask_ratio:.0%} of the patches"
                   + ("" if g.shape_jitter else " and do not vary pose or stroke") + "; on small rendered glyphs "
                   "(digits in 12 fonts) views that keep more of the image and rotate, shear, thicken and thin it "
                   "gave the best features, though their loss stays near log K too")
            fix = (f"--set mask.rand_crop_scale=[{EASY_CROP_MIN},1.0] mask.ratio={EASY_MASK} augment.affine_p=0.8 "
                   "augment.stroke_p=0.8")
        else:
            sharper = float(f"{0.6 * min(g.sharpen_start, g.sharpen_end):.2g}")
            why = (f"the targets do not sharpen at temperature {g.sharpen_end:g} over {g.num_prototypes} "
                   "prototypes, so there is little to match")
            fix = (f"--set loss.sharpen_start={sharper:g} loss.sharpen_end={sharper:g} (sharper targets); if the "
                   f"loss still stays near log K, a larger optim.lr (now {g.lr:g})")
        return f"step {step}: training has stalled: {what}. Likely cause: {why}. To try: {fix}."
