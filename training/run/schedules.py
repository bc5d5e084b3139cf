"""Learning-rate, weight-decay, EMA-momentum and sharpening schedules of the official MSN recipe.

The official code keeps these as stateful objects and generators that are stepped once per iteration and
fast-forwarded on resume. Here each is a pure function of the 0-based global iteration ``step``, so a resumed run
reproduces the official values exactly, from any step (not only epoch boundaries).

A run trains ``total_steps`` iterations (``epochs * steps_per_epoch`` in the official code; here also a step count
or a wall-clock budget, decided once in ``training/run/length.py``). All four schedules span a horizon of
``T = int(horizon_scale * total_steps)`` iterations. The official run uses ``horizon_scale = 1.25``, so training
stops at 80 % of every schedule: for ViT-S/16 (800 epochs) the last learning rate is about 9.9e-5, not ``final_lr``,
and the weight decay ends near 0.366, not 0.4. ``horizon_scale = 1`` ends every schedule on the last step.

Step semantics (what the official loop actually applies at 0-based iteration ``i``):

- ``lr`` and ``weight_decay``: the official loop calls ``scheduler.step()`` *before* ``optimizer.step()``, so the
  value used at iteration ``i`` is the scheduler's value after ``i + 1`` steps. The first iteration therefore
  already uses slightly more than ``start_lr``, and ``ref_lr`` is reached at ``i = warmup_steps - 1``.
- ``ema_momentum`` and ``sharpen_temperature``: generators whose ``i``-th item is used at iteration ``i``, so the
  first iteration uses ``ema_start`` / ``sharpen_start`` exactly.

Beyond the horizon (only reachable with ``horizon_scale < 1``, where the official generators would raise
``StopIteration`` and the official cosine would climb back up) every schedule holds its final value.

A budget run may change its length while it runs (``training/run/budget.py``): ``ResizedSchedules`` keeps the
``Schedules`` of the first length and walks them faster or slower from each resize on, so every schedule still ends
with the run and no value jumps. Warm-up stays in real steps. Without a resize it is ``Schedules`` exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ResizedSchedules", "Schedules", "StepHyperparameters", "Stretch"]


@dataclass(frozen=True)
class StepHyperparameters:
    """The values one optimiser step uses: what ``train_step`` needs from the schedules, and nothing else."""

    lr: float
    weight_decay: float
    ema_momentum: float
    sharpen_temperature: float


@dataclass(frozen=True)
class Schedules:
    """Per-iteration hyper-parameters. ``ref_lr`` / ``ref_weight_decay`` are the config's ``lr`` / ``weight_decay``.

    Official ViT-S/16 values (``from_epochs``): ``warmup_epochs=15, start_lr=2e-4, ref_lr=1e-3, final_lr=1e-6,
    ref_weight_decay=0.04, final_weight_decay=0.4, ema_start=0.996, ema_end=1.0``.
    """

    total_steps: int
    warmup_steps: int
    start_lr: float
    ref_lr: float
    final_lr: float
    ref_weight_decay: float
    final_weight_decay: float
    ema_start: float
    ema_end: float
    horizon_scale: float = 1.25
    sharpen_start: float = 0.25
    sharpen_end: float = 0.25

    @classmethod
    def from_epochs(cls, steps_per_epoch: int, epochs: int, warmup_epochs: float, **kwargs) -> Schedules:
        """The official parametrisation: ``epochs`` of ``steps_per_epoch``, warm-up ``int(warmup_epochs * spe)``."""
        if steps_per_epoch < 1 or epochs < 1:
            raise ValueError(f"steps_per_epoch and epochs must be >= 1, got {steps_per_epoch}, {epochs}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        return cls(epochs * steps_per_epoch, int(warmup_epochs * steps_per_epoch), **kwargs)

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.horizon_scale > 0:
            raise ValueError(f"horizon_scale must be > 0, got {self.horizon_scale}")
        if not (self.sharpen_start > 0 and self.sharpen_end > 0):
            raise ValueError(
                f"sharpen temperatures must be > 0, got {self.sharpen_start}, {self.sharpen_end}"
            )

    @property
    def horizon(self) -> int:
        """Schedule length T (official ``T_max``): ``int(horizon_scale * total_steps)``."""
        return int(self.horizon_scale * self.total_steps)

    def at(self, step: int) -> StepHyperparameters:
        """Every schedule's value at 0-based iteration ``step``."""
        return StepHyperparameters(self.lr(step), self.weight_decay(step), self.ema_momentum(step),
                                   self.sharpen_temperature(step))

    def lr(self, step: int) -> float:
        """Learning rate used at 0-based iteration ``step``: linear warmup, then cosine toward ``final_lr``.

        Official ``WarmupCosineSchedule`` after ``step + 1`` calls to ``step()``; the cosine runs over
        ``T - warmup_steps`` iterations and is floored at ``final_lr``.
        """
        t = step + 1
        if t < self.warmup_steps:
            return self.start_lr + t / self.warmup_steps * (self.ref_lr - self.start_lr)
        progress = min(1.0, (t - self.warmup_steps) / max(1, self.horizon - self.warmup_steps))
        cosine = self.final_lr + (self.ref_lr - self.final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(self.final_lr, cosine)

    def weight_decay(self, step: int) -> float:
        """Weight decay used at 0-based iteration ``step``: cosine from ``ref`` to ``final`` over T.

        Official ``CosineWDSchedule`` after ``step + 1`` calls, clamped so it never passes ``final_weight_decay``.
        """
        progress = min(1.0, (step + 1) / max(1, self.horizon))
        ref, final = self.ref_weight_decay, self.final_weight_decay
        wd = final + (ref - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(final, wd) if final <= ref else min(final, wd)

    def ema_momentum(self, step: int) -> float:
        """Target-encoder EMA momentum applied after the optimizer step of iteration ``step``: linear over T."""
        return self._linear(self.ema_start, self.ema_end, step)

    def sharpen_temperature(self, step: int) -> float:
        """Target sharpening temperature used at iteration ``step``: linear over T (constant 0.25 officially)."""
        return self._linear(self.sharpen_start, self.sharpen_end, step)

    def _linear(self, start: float, end: float, step: int) -> float:
        # The official generators divide by the unrounded horizon (ipe * epochs * 1.25), not by int(...).
        increment = (end - start) / (self.total_steps * self.horizon_scale)
        return start + increment * min(step, self.horizon)


@dataclass(frozen=True)
class Stretch:
    """From real step ``start`` on, the schedules are read at ``position + (step - start) * rate``."""

    start: int
    position: float
    rate: float


@dataclass(frozen=True)
class ResizedSchedules:
    """``base`` (the schedules over the first length) after ``resizes``: ``(step, new total)`` pairs in order.

    A resize at step ``s`` to ``T`` steps maps the real steps from ``max(s, warm-up)`` to ``T - 1`` onto what was left
    of the base schedules (up to their last step), linearly: the learning-rate and weight-decay cosines and the EMA ramp
    stretch or shrink to end on step ``T`` and stay continuous. The values are a pure function of the step and the
    resize list, which the checkpoint stores, so a resumed run computes the same values.
    """

    base: Schedules
    resizes: tuple[tuple[int, int], ...] = ()
    stretches: tuple[Stretch, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        stretches: tuple[Stretch, ...] = ()
        previous = self.base.total_steps
        for step, total in self.resizes:
            if step < 0 or total < step:
                raise ValueError(f"resize to {total} steps at step {step}: expected 0 <= step <= total")
            if total != previous:
                stretches = _stretch(stretches, self.base, step, total)
            previous = total
        object.__setattr__(self, "stretches", stretches)

    @property
    def total_steps(self) -> int:
        return self.resizes[-1][1] if self.resizes else self.base.total_steps

    @property
    def warmup_steps(self) -> int:
        return self.base.warmup_steps

    def position(self, step: int) -> float:
        """Where on the base schedules real step ``step`` reads (``step`` itself before any stretch)."""
        return _position(self.stretches, step)

    def at(self, step: int) -> StepHyperparameters:
        return self.base.at(self.position(step))  # type: ignore[arg-type]  # the schedules accept fractional steps

    def resize(self, step: int, total_steps: int) -> ResizedSchedules:
        """These schedules resized at real step ``step`` (the next step to run) to end after ``total_steps``."""
        return ResizedSchedules(self.base, (*self.resizes, (step, total_steps)))


def _position(stretches: tuple[Stretch, ...], step: int) -> float:
    for stretch in reversed(stretches):
        if step >= stretch.start:
            return stretch.position + (step - stretch.start) * stretch.rate
    return step


def _stretch(stretches: tuple[Stretch, ...], base: Schedules, step: int, total: int) -> tuple[Stretch, ...]:
    """The stretches after resizing at ``step`` to ``total``; warm-up keeps its real steps when it can."""
    start = max(step, base.warmup_steps)
    if total <= start:  # the run now ends inside warm-up (or right here): shrink from this step
        start = step
    if total <= start:  # no step left to run
        return stretches
    position, last = _position(stretches, start), base.total_steps - 1
    # real steps start .. total - 1 read the base schedules from here to their last step, total_steps - 1
    stretch = Stretch(start, position, (last - position) / (total - 1 - start)) if total - 1 > start else \
        Stretch(start, last, 0.0)
    return (*(s for s in stretches if s.start < start), stretch)
