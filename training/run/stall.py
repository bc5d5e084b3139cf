"""Stalls, read from the run's own logged signals: no labels needed.

A stalled run is not collapsed (``training/run/collapse.py``): its prototypes stay in use and its embeddings spread,
so no collapse condition holds, yet it learns almost nothing and looks healthy on the progress bar.

**With the view probe** (``training/run/view_probe.py``, on by default): the run is learning while the target
encoder tells two views of an image from other images better than it did at the start, that is while the view
margin of its CLS token or of its served feature has risen at least ``MIN_VIEW_GAIN`` above the run's start; a
stall is ``VIEW_PATIENCE`` probes in a row, from ``CHECK_FRACTION`` of the planned steps on, that say it has not.
Calibrated on six runs (``benchmarks/training/stall_cases.py``, docs/results-notes.md "A label-free signal of
learning"): planted learning rates 100x too small moved the margins by at most 0.03 from their start, views too
hard for 28-px digits lowered them for their first 15 % of steps, and every healthy run's better margin had gained
more than 0.1 by its 100th-300th step. The loss alone could not say it: a planted stall on a 2,000-image folder
drifted 3-6 % below log K over its many epochs, past any fixed threshold, and the rendered glyphs plateau 7 % below
it whatever their views.

**Without it** (``run.view_probe_images=0``) two signals every logged record carries
(``training/model/losses.py`` ``LossTerms.summary``) decide, as before the probe:

- **the loss against log K**: the cross-entropy of a network that tells the K prototypes apart by nothing is
  log K, and a fresh network with the recipes' 256-d head starts within a few % of it. A learning run pulls the
  loss well below it within its first few hundred steps; a stalled one stays near it. The drop is read in
  fractions of log K, so one threshold serves any K, and from the higher of log K and the run's first records (a
  small head's confident random predictions can start the loss far above log K: coming down from there is
  learning too);
- **the targets' sharpening**: the mean entropy of the (sharpened, balanced) targets, against its value on the
  run's first records. A learning run's targets get sharper as the target encoder learns; a stalled run's do not.

Both are medians over a trailing window of logged records, compared from ``CHECK_FRACTION`` of the planned steps on
(at least ``MIN_CHECK_STEPS``), and must hold on ``PATIENCE`` records spanning ``MIN_SPAN_STEPS``.

Either way a stall is reported once, within the first 10 % of any run of 1,100 planned steps or more, naming a
likely cause and the ``--set`` that fixes it (``Stall.sets``, keys declared in ``training/run/advice.py``;
``--on-stall adapt`` applies it, ``training/run/adapt.py``): the learning rate when it is far below the batch's
rule (``training/run/plan.py``: a config can say nothing truer about a learning rate without labels), else views
that keep too little of a small image holding little detail (official crops, masking or photometric jitter: what
stalled the digit folders, docs/results-notes.md; on the rendered glyphs, with more detail, easier views did
worse), else the targets' temperature. The checks read floats the monitor has already logged: no device sync of
their own. A resumed run is not checked (its start, which the signals are read against, was in an earlier launch).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from training.config import Config
from training.run.advice import advised
from training.run.plan import LOW_DETAIL, LOW_DETAIL_CROP, LOW_DETAIL_MASK, PAPER_START_LR, lr_for_batch

__all__ = ["Adaptation", "Stall", "StallDetector"]

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
# with the view probe: learning while the view margin (training/run/view_probe.py; CLS or served feature, the larger
# gain) has risen at least this far above the run's start; stalled after VIEW_PATIENCE probes in a row, from the
# first check on, that say not
MIN_VIEW_GAIN = 0.05
VIEW_PATIENCE = 2


@dataclass(frozen=True)
class Stall:
    """A detected stall: the step it was confirmed at, the likely cause and a message naming the fix."""

    step: int
    cause: str  # "learning_rate" | "views" | "targets"
    message: str
    sets: dict[str, Any] = field(default_factory=dict)  # the advice as config keys (``--on-stall adapt`` applies it)

    def record(self) -> dict[str, Any]:
        """The fields added to that step's ``metrics.jsonl`` record."""
        return {"stall": self.cause, "stall_message": self.message}


@dataclass(frozen=True)
class Adaptation:
    """A stall's advice taken (``--on-stall adapt``, ``training/run/adapt.py``): the switch a run made at ``step``
    for ``cause``, the config keys ``sets`` (dotted key -> value)."""

    step: int
    cause: str
    sets: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "cause": self.cause, "sets": dict(self.sets)}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Adaptation | None:
        if not record:
            return None
        return cls(int(record["step"]), str(record["cause"]), dict(record["sets"]))

    def describe(self) -> str:
        sets = " ".join(f"{key}={value}" for key, value in self.sets.items())
        return f"step {self.step}: run.on_stall=adapt: switching to the advice for '{self.cause}': {sets}"


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
        self.probes: list[tuple[int, float, float]] = []  # (step, view margin, its start): the view probe's records
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
        probed = _view_margin(record)
        if probed is not None:
            self.probes.append((step, *probed))
        if len(self.start) < START_RECORDS:
            self.start.append(values)
        self.window.append((step, *values))
        while self.window[0][0] <= step - self.window_steps:
            self.window.popleft()
        if step < self.check_from:
            return None
        s = self.signals()
        if self.probes:  # the view probe decides (training/run/view_probe.py): at its records only
            if probed is None:
                return None
            if self.view_gain() >= MIN_VIEW_GAIN:
                self.streak.clear()
                return None
            self.streak.append(step)
            if len(self.streak) < VIEW_PATIENCE:
                return None
        else:  # no view probe: the loss and the targets' sharpening
            if len(self.window) < 2:
                return None
            if s["loss_drop"] >= MAX_LOSS_DROP or s["sharpening"] >= MIN_SHARPENING:
                self.streak.clear()
                return None
            self.streak.append(step)
            if len(self.streak) < PATIENCE or self.streak[-1] - self.streak[0] < MIN_SPAN_STEPS:
                return None
        self.reported = True
        cause = ("learning_rate" if self.lr_far_below_rule() else "views" if self.settings.hard_views()
                 else "targets")
        why, sets = self.advice(cause, s)
        return Stall(step, cause, self.message(cause, step, s, why, sets), sets)

    def view_gain(self) -> float:
        """How far the latest probe's view margin rose above the run's start (in the margin's own units)."""
        _, margin, start = self.probes[-1]
        return margin - start

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

    def advice(self, cause: str, s: dict[str, float]) -> tuple[str, dict[str, Any]]:
        """Why ``cause`` is likely, and the config keys that fix it (what the message's ``--set`` says), each one
        declared in ``training/run/advice.py``'s table of what taking it rebuilds."""
        g = self.settings
        if cause == "learning_rate":
            rule = self.rule_lr()
            still = abs(s["start_entropy"] - s["entropy"]) < 0.01 * self.log_k
            why = (f"the learning rate is far too small: optim.lr={g.lr:g} is {rule / g.lr:.0f}x below "
                   f"1e-3 x sqrt({g.global_batch} / 1024) = {rule:g} for this global batch"
                   + (f"; the predictions have hardly moved (entropy {s['start_entropy']:.3f} -> "
                      f"{s['entropy']:.3f} nats)" if still else ""))
            return why, advised({"optim.lr": rule, "optim.start_lr": min(PAPER_START_LR, rule)})
        if cause == "views" and g.low_detail:
            why = (f"two views of an image share too little for one to predict the other's prototypes (crops from "
                   f"{g.crop_min:.0%} of the area, {g.mask_ratio:.0%} of the patches masked"
                   + (", photometric jitter" if g.photometric else "") + "); on small images with little detail "
                   "such runs stalled, and views keeping more of the image learned")
            return why, advised({"mask.rand_crop_scale": [EASY_CROP_MIN, 1.0], "mask.ratio": EASY_MASK,
                                 "augment.color_jitter_p": 0.0, "augment.grayscale_p": 0.0, "augment.blur_p": 0.0})
        if cause == "views":
            why = (f"views that crop from {g.crop_min:.0%} of the area and mask {g.mask_ratio:.0%} of the patches"
                   + ("" if g.shape_jitter else " and do not vary pose or stroke") + "; on small rendered glyphs "
                   "(digits in 12 fonts) views that keep more of the image and rotate, shear, thicken and thin it "
                   "gave the best features, though their loss stays near log K too")
            return why, advised({"mask.rand_crop_scale": [EASY_CROP_MIN, 1.0], "mask.ratio": EASY_MASK,
                                 "augment.affine_p": 0.8, "augment.stroke_p": 0.8})
        sharper = float(f"{0.6 * min(g.sharpen_start, g.sharpen_end):.2g}")
        why = (f"the targets do not sharpen at temperature {g.sharpen_end:g} over {g.num_prototypes} "
               "prototypes, so there is little to match")
        return why, advised({"loss.sharpen_start": sharper, "loss.sharpen_end": sharper})

    def what(self, s: dict[str, float]) -> str:
        """What was seen: the view probe's margin against its start when there is one, and the loss."""
        loss = (f"the loss is {s['loss']:.2f}, {100 * s['loss_drop']:.1f} % of log K = {self.log_k:.2f} below its "
                f"start, and the targets' entropy went from {s['start_target_entropy']:.2f} to "
                f"{s['target_entropy']:.2f} nats")
        if not self.probes:
            return (f"{loss}: a learning run's loss comes down by {100 * MAX_LOSS_DROP:g} % or more by now, or its "
                    "targets sharpen")
        _, margin, start = self.probes[-1]
        return (f"the target encoder does not tell two views of an image from other images any better than at the "
                f"start (view margin {margin:.2f} against {start:.2f}: a learning run's has risen by "
                f"{MIN_VIEW_GAIN:g} or more by now; {VIEW_PATIENCE} probes in a row); {loss}")

    def message(self, cause: str, step: int, s: dict[str, float], why: str, sets: dict[str, Any]) -> str:
        fix = "--set " + " ".join(f"{key}={_typed(value)}" for key, value in sets.items())
        if cause == "targets":
            fix += (f" (sharper targets); if the loss still stays near log K, a larger optim.lr (now "
                    f"{self.settings.lr:g})")
        return f"step {step}: training has stalled: {self.what(s)}. Likely cause: {why}. To try: {fix}."


def _typed(value: Any) -> str:
    """A value as ``--set`` takes it: lists without spaces, floats in their short form."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _view_margin(record: dict[str, Any]) -> tuple[float, float] | None:
    """(view margin, its start) of a record the view probe wrote, else None: of the CLS token or of the served
    feature, whichever has gained more (the demo's CLS margin dips below its start for its first ~4 % of steps
    while its served feature's already rises; a stalled run's moves in neither)."""
    pairs = []
    for kind in ("_cls", ""):
        try:
            pair = float(record[f"view_margin{kind}"]), float(record[f"view_margin{kind}_start"])
        except (KeyError, TypeError, ValueError):
            continue
        if all(map(math.isfinite, pair)):
            pairs.append(pair)
    return max(pairs, key=lambda pair: pair[0] - pair[1]) if pairs else None
