"""A run planned from the data and the machine: ``torchrun training/pretrain.py --data DIR --budget 30m``.

With ``--data`` and no ``--config``, ``training/pretrain.py``'s ``resolve_config`` asks ``plan_config`` for every
key the user did not set. The plan is printed in one block and written to the run's ``config.yaml`` with a
``plan`` section saying why each value was chosen; any of them can be changed with ``--set`` (an explicit
``--set`` wins, and the choices derived from it follow it: a batch size set by hand still gets its learning rate
from the rule below). Every process of a ``torchrun`` job plans on its own, so nothing here is timed or random.

How each choice is made (``docs/training.md``, "How a run is planned"):

1. **Image size**: the median shorter side of up to 256 sampled images (file headers only, no decoding).
   Images of 64 px and more train as the paper does: 16-px patches at up to 224 px (larger images are resized).
   Smaller ones use the small-image geometry: a 4 x 4 patch grid and no focal views (``configs/fmnist_vit_tiny.yaml``);
   images under 28 px are upsampled by the smallest whole factor that reaches 28 px, because 8-px digits
   collapsed at their native size and trained once upsampled to 32 px.
2. **Model**: the largest of ViT-tiny with 4 blocks, ViT-tiny and ViT-S (the paper's main model) that (a) has
   no more trunk parameters per training image than the paper's ViT-B/16 on ImageNet-1k (~66) and (b) gets at
   least ``MIN_STEPS`` optimiser steps from the budget or the epochs, by the step time ``training/run/machine.py``
   estimates. The smallest is always allowed. Larger models: ``--set model.arch=vit_base``.
3. **Views**: focal views (10, as the paper) at 96/224 of the image size when such a crop holds at least 4 x 4
   patches; crop scales are fractions of the area, so the paper's carry over to any size. Mask ratio: the
   paper's per model (0.15 for ViT-S/16) or the small-image recipe's 0.3 for a 16-patch image. Small images
   holding at most 14 px of detail (``training/run/survey.py``: the smallest of a bicubic round trip, the grid a
   pixel-replicated image was enlarged from, and, for sparse ink, the width of its strokes; 8-px digits, also when
   resampled to 28 or 32 px by any filter or drawn as MNIST's thick anti-aliased strokes) get views that keep
   most of the image: crops of 60-100 % of the area, 15 % masked, no photometric jitter. With the
   official views such a run stalled near log K for its first thousands of steps; with these it learned from the
   start and its trunk more (10 minutes: the paper's CLS feature 90.8 against 87.6 kNN-20, the served feature
   equal within one std; docs/results-notes.md). Fashion-MNIST (28 px) and the rendered glyphs (16-19 px) keep
   the official views: on the glyphs these views made the served feature worse. Folders whose images have plain
   backgrounds of differing grey (the survey's ``background_spread``: the rendered glyphs) get each view's darkest
   and lightest grey redrawn (``augment.levels_p``): otherwise two views share the background level and the
   encoder learns to sort images by it (the glyphs' CLS token told their background quartile 95 % of the time and
   their digit 18.5 %).
4. **Batch per device**: on a GPU the largest power of two whose activations fit in 80 % of its memory (Korthikanti
   et al.'s estimate, ``training/run/machine.py``), up to the paper's global 1,024 and at most an eighth of the
   images; on a CPU the small-image recipe's 64 per step.
5. **Learning rate**: square-root scaling from the paper's reference, ``lr = 1e-3 * sqrt(global batch / 1024)``
   (AdamW's scaling rule, Malladi et al. 2022; at batch 64 it gives 2.5e-4, which beat the unscaled 1e-3 on all
   four measures of this project's recipe search; linear scaling would give 6.25e-5, far below anything tried).
   Warm-up starts at ``min(2e-4, lr)``.
6. **Length**: ``--budget`` or ``--epochs``; warm-up 10 % of the run (at most the paper's 15 epochs); schedules
   end with the run (``horizon_scale`` 1); EMA from ``1 - 1/t`` with t about 2 % of the steps (100-250 steps:
   0.99 to the paper's 0.996), and a checkpoint about every 5 %. The model's size is chosen from the step count
   the machine's estimated step time gives; the EMA and the checkpoint interval are chosen again from the count the
   run's length decided (``Plan.settle``, ``training/run/decide.py``): a budget's, from its own timed steps.
7. **Loader workers**: 0 for in-memory data; else from the cores per process. **Precision**: ``auto`` (on a CPU
   with bf16 units the run times fp32 against bf16 on its first steps; the printed block shows what it measured),
   and on a CPU ``run.cpu_attention`` and ``run.cpu_threads`` ``auto``/0, timed in the same pass.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

from training.config import Config, ConfigError, apply_overrides, build_dataclass
from training.model.vit import ARCHS
from training.run.machine import (
    Machine,
    StepShape,
    activation_bytes_per_image,
    detect_machine,
    encoder_parameters,
    step_flops_per_image,
)
from training.run.precedence import SET_BY_YOU, UNSET, Options, decide
from training.run.survey import LOW_DETAIL, DataSurvey, survey_data

__all__ = ["LOW_DETAIL", "DataSurvey", "Plan", "lr_for_batch", "parse_budget", "plan_config", "plan_run",
           "set_length", "survey_data"]

REFERENCE_BATCH, REFERENCE_LR = 1024, 1e-3  # the paper: global batch 1,024 at lr 1e-3 (ViT-S/16 and ViT-B/16)
PAPER_START_LR = 2e-4
MIN_IMAGE_SIZE = 28  # the small-image recipe's size; smaller images are upsampled to at least this
SMALL_GRID = 4  # patches per side of the small-image geometry (16 tokens)
PATCH = 16  # the paper's patch size
MAX_IMAGE_SIZE = 224  # the paper's view size; larger images are resized to it
MIN_STEPS = 5_000  # a larger model must get at least this many optimiser steps
# Images holding at most LOW_DETAIL px of detail (training/run/survey.py: half the small-image recipe's 28 px) get
# views that keep most of them: crops of at least LOW_DETAIL_CROP of the area, LOW_DETAIL_MASK of the patches
# masked, no colour jitter, grey or blur.
LOW_DETAIL_CROP, LOW_DETAIL_MASK = 0.6, 0.15
# Plain backgrounds whose grey differs by at least this much (std, grey levels; training/run/survey.py) get views
# whose levels are redrawn (``augment.levels_p``)
LEVEL_SPREAD = 4.0
# Keys chosen from the run's step count: first from the estimate below (it sizes the model), then again from the
# count the run's length finally decided (``Plan.settle``: a budget's from its own timed steps)
STEP_KEYS = ("optim.ema_start", "run.checkpoint_every_steps")
PARAMS_PER_IMAGE = 85e6 / 1.28e6  # ViT-B/16's trunk on ImageNet-1k's images
# Model sizes the planner chooses from, smallest first: (arch, depth). Width and heads come from the arch.
TIERS = (("vit_tiny", 4), ("vit_tiny", 12), ("vit_small", 12))


_UNITS = {"s": 1 / 60, "m": 1.0, "min": 1.0, "h": 60.0}


def parse_budget(text: str) -> float:
    """``--budget``: ``30m``, ``2h``, ``1h30m``, ``90s`` or a bare number of minutes -> minutes."""
    matches = re.findall(r"(\d+(?:\.\d*)?|\.\d+)\s*(min|[smh]?)", text.strip().lower())
    if not matches or re.sub(r"(\d+(?:\.\d*)?|\.\d+)\s*(min|[smh]?)", "", text.strip().lower()).strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write e.g. 30m, 2h, 1h30m or 90s")
    minutes = sum(float(number) * _UNITS[unit or "m"] for number, unit in matches)
    if not minutes > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the budget must be positive")
    return minutes


def set_length(raw: dict[str, Any], *, budget_minutes: float | None, epochs: int | None) -> None:
    """``--budget`` / ``--epochs``: the short forms of ``optim.budget_minutes`` / ``optim.epochs``; either replaces
    the length a config states (``--set`` still wins over both)."""
    if budget_minutes is not None and epochs is not None:
        raise ConfigError("give --budget or --epochs, not both")
    optim = raw.setdefault("optim", {})
    if budget_minutes is not None:
        optim.pop("total_steps", None)
        optim["budget_minutes"] = budget_minutes
    elif epochs is not None:
        optim.pop("total_steps", None)
        optim["budget_minutes"] = None
        optim["epochs"] = epochs


def lr_for_batch(global_batch: int) -> float:
    """The learning rate rule: square-root scaling from the paper's 1e-3 at a global batch of 1,024."""
    return REFERENCE_LR * math.sqrt(global_batch / REFERENCE_BATCH)


@dataclass
class Plan:
    """Planned config values (dotted keys) with the reason for each; ``fixed`` are the keys the user set."""

    survey: DataSurvey
    machine: Machine
    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)

    def choose(self, key: str, value: Any, reason: str) -> Any:
        """``value`` for ``key``, unless the user set it: then theirs (and the plan derives from it). The ladder of
        ``training/run/precedence.py``, whose other rungs (the machine, a resumed run) the planner never meets."""
        chosen = decide(key, self.fixed.get(key, UNSET), auto=UNSET, rule=Options(key, (value,), value, reason))
        if key not in self.fixed:
            self.values[key] = value
        self.reasons[key] = chosen.reason
        return chosen.flag

    def settle(self, total_steps: int) -> dict[str, Any]:
        """Choose the step-dependent keys (``STEP_KEYS``) again for the ``total_steps`` the run's length decided (a
        budget's from its timed steps, not the estimate the model was chosen by); returns the values the user did
        not set (``training/run/decide.py`` puts them in the run's config before anything reads them)."""
        _step_choices(self, total_steps)
        return {key: self.values[key] for key in STEP_KEYS if key not in self.fixed}

    def record(self) -> dict[str, Any]:
        """The ``plan`` section of ``config.yaml``: the data, the machine, and why each key has its value."""
        return {"data": self.survey.description, "machine": self.machine.describe(), "why": dict(self.reasons)}

    def describe(self) -> str:
        """The plan in one block, for the log."""
        lines = ["MSN run plan (training/run/plan.py; change any line with --set KEY=VALUE):",
                 f"  data     {self.survey.description}; median side {self.survey.side} px",
                 f"  machine  {self.machine.describe()}"]
        for key, reason in self.reasons.items():
            value = self.fixed.get(key, self.values.get(key))
            lines.append(f"  {key:<26} {value!s:<18} {reason}")
        return "\n".join(lines)


def plan_config(raw: dict[str, Any], overrides: list[str], machine: Machine | None = None) -> Plan:
    """Plan every key of ``raw`` (the config so far: ``--data``, ``--budget``/``--epochs``) that ``overrides``
    (``--set``) does not set. ``machine``: the machine to plan for (default: this one)."""
    wanted = copy.deepcopy(raw)
    apply_overrides(wanted, overrides)
    data = wanted.get("data", {})
    model = wanted.get("model", {})
    source = data.get("source", "image_folder")
    _length(_flatten(wanted))  # before reading any image: a missing length is the user's first error
    try:
        survey = survey_data(source, data.get("root"), image_root=data.get("image_root"),
                             subset=data.get("subset_file"), synthetic_size=data.get("synthetic_size", 512),
                             synthetic_side=model.get("image_size") or 32)
    except ValueError as err:  # a source that cannot be listed, or no readable image
        raise ConfigError(f"planning from the data: {err}") from None
    machine = machine or detect_machine(wanted.get("run", {}).get("device", "auto"))
    typed = build_dataclass(Config, wanted).to_dict()  # "3e-4" is a number here, as in the run's config
    return plan_run(survey, machine, {key: _lookup(typed, key) for key in _flatten(wanted)})


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def plan_run(survey: DataSurvey, machine: Machine, fixed: dict[str, Any]) -> Plan:
    """The plan for ``survey`` on ``machine``; ``fixed``: the dotted keys the user set, with their values."""
    plan = Plan(survey, machine, fixed=dict(fixed))
    length = _length(fixed)
    candidates = [_Candidate.build(arch, depth, survey, machine, fixed) for arch, depth in _tiers(fixed)]
    chosen = candidates[0]
    for candidate in candidates[1:]:
        if candidate.fits_data(survey) and candidate.steps(length, survey, machine) >= MIN_STEPS:
            chosen = candidate
    chosen.apply(plan, length, survey, machine)
    return plan


def _length(fixed: dict[str, Any]) -> tuple[str, float]:
    for key in ("optim.budget_minutes", "optim.total_steps", "optim.epochs"):
        if fixed.get(key) is not None:
            return key, float(fixed[key])
    raise ConfigError("a run planned from --data needs a length: --budget (e.g. --budget 30m) or --epochs N")


def _tiers(fixed: dict[str, Any]) -> list[tuple[str, int]]:
    arch, depth = fixed.get("model.arch"), fixed.get("model.depth")
    if arch is not None or depth is not None:  # the user chose the model
        arch = arch or "vit_tiny"
        if arch not in ARCHS:
            raise ValueError(f"model.arch={arch!r}: the planner knows {', '.join(ARCHS)}")
        return [(arch, depth or ARCHS[arch][1])]
    return list(TIERS)


@dataclass
class _Candidate:
    """One model size with the geometry, batch and step time that go with it on this data and machine."""

    arch: str
    depth: int
    shape: StepShape
    small: bool  # the small-image geometry (4 x 4 patches, no focal views)
    batch: int  # per device
    batch_reason: str

    @classmethod
    def build(cls, arch: str, depth: int, survey: DataSurvey, machine: Machine, fixed: dict[str, Any]) -> _Candidate:
        width, _, heads = ARCHS[arch]
        width, heads = fixed.get("model.embed_dim") or width, fixed.get("model.num_heads") or heads
        size = fixed.get("model.image_size") or _working_size(survey.side, small=(arch, depth) == TIERS[0])
        small = size < SMALL_GRID * PATCH or (arch, depth) == TIERS[0]
        if small:
            size = fixed.get("model.image_size") or min(size, SMALL_GRID * PATCH)
            patch, num_focal, focal, ratio = size // SMALL_GRID, 0, 0, 0.3
        else:
            patch = PATCH
            focal = max(patch, round(size * 96 / 224 / patch) * patch)
            num_focal = 10 if focal // patch >= 4 else 0
            ratio = 0.3 if width >= 768 else 0.15
        hidden = 2048 if width >= 384 else 1024
        shape = StepShape(width, depth, heads, patch, size, ratio, num_focal, focal, hidden)
        batch, reason = _batch(shape, machine, survey, fixed)
        return cls(arch, depth, shape, small, batch, reason)

    def fits_data(self, survey: DataSurvey) -> bool:
        return encoder_parameters(self.shape.embed_dim, self.depth) <= PARAMS_PER_IMAGE * survey.num_images

    def step_seconds(self, machine: Machine) -> float:
        return machine.step_seconds(self.batch * step_flops_per_image(self.shape))

    def steps(self, length: tuple[str, float], survey: DataSurvey, machine: Machine) -> int:
        key, value = length
        if key == "optim.budget_minutes":
            return int(0.95 * 60 * value / self.step_seconds(machine))  # ~5 % for building and calibration
        if key == "optim.total_steps":
            return int(value)
        return int(value * max(1, survey.num_images // (self.batch * machine.device_count)))

    def apply(self, plan: Plan, length: tuple[str, float], survey: DataSurvey, machine: Machine) -> None:
        s, native = self.shape, survey.side
        ch = plan.choose
        trunk = f"{encoder_parameters(s.embed_dim, self.depth) / 1e6:.1f}M trunk parameters"
        ch("model.arch", self.arch, f"largest model the data and the budget support ({trunk})")
        ch("model.depth", self.depth, "4 blocks: the small-image recipe" if self.depth == 4 else "as the arch")
        size = ch("model.image_size", s.image_size,
                  f"upsampled from {native} px (x{s.image_size / native:.2g}): views collapse below "
                  f"{MIN_IMAGE_SIZE} px" if s.image_size > native else
                  f"median side {native} px" + (f", resized to {s.image_size}" if s.image_size < native else ""))
        if self.small:
            if "model.patch_size" not in plan.fixed:
                ch("model.patches_per_side", SMALL_GRID, "4 x 4 patches: the small-image recipe's 16 tokens")
            ch("data.load_size", None, "decoded at the image size: no margin to crop at this size")
            ch("data.eval_resize_ratio", 1.0, "small images are not centre-cropped")
            ch("model.feature", "cls_patch_tokens", "the small-image recipe's served feature")
        else:
            ch("model.patch_size", s.patch_size, "the paper's 16-px patches")
            ch("data.load_size", round(size * 256 / 224), "the paper's 256/224 resize margin")
            ch("model.feature", "cls_pre_norm", "the paper's frozen feature")
        ch("model.head_hidden_dim", s.head_hidden_dim, "2,048 as the paper from ViT-S up, 1,024 below")
        ch("mask.num_focal", s.num_focal, "the paper's 10 focal views" if s.num_focal else
           "no focal views: a focal crop would hold fewer than 4 x 4 patches")
        if s.num_focal:
            ch("mask.focal_size", s.focal_size, "96/224 of the image size, as the paper")
        if self.small and survey.low_detail:
            _low_detail_views(plan, survey)
        else:
            ch("mask.ratio", s.mask_ratio, "the small-image recipe (16 patches)" if self.small else
               "the paper's ratio for this model")
        if survey.background_spread is not None and survey.background_spread >= LEVEL_SPREAD:
            ch("augment.levels_p", 1.0, f"plain backgrounds whose grey differs from image to image (std "
               f"{survey.background_spread:g} of 255): each view's levels are redrawn, or the encoder sorts images "
               "by their background")
        batch = ch("data.batch_size", self.batch, self.batch_reason)
        global_batch = batch * machine.device_count
        lr = ch("optim.lr", float(f"{lr_for_batch(global_batch):.3g}"),
                f"1e-3 x sqrt({global_batch} / 1024): square-root scaling from the paper's reference")
        ch("optim.start_lr", min(PAPER_START_LR, lr), "the paper's 2e-4, at most the peak")
        steps = self.steps(length, survey, machine)
        if length[0] == "optim.epochs":
            ch("optim.warmup_epochs", min(15.0, 0.1 * length[1]), "10 % of the run, at most the paper's 15 epochs")
        else:
            ch("optim.epochs", 1, "with a budget or a step count: the unit of the warm-up share below")
            ch("optim.warmup_epochs", 0.1, "warm-up: 10 % of the run")
        ch("optim.horizon_scale", 1.0, "schedules end with the run (the paper's 1.25 stops them at 80 %)")
        _step_choices(plan, steps)  # from the estimate here; from the decided length in Plan.settle
        workers = 0 if survey.in_memory else (
            min(10, max(1, machine.cpu_cores // machine.device_count - 1)) if machine.device_type == "cuda"
            else max(1, machine.cpu_cores // (4 * machine.device_count)))
        ch("data.num_workers", workers, "in-memory data: no decoding" if survey.in_memory else
           f"decoding from {machine.cpu_cores} cores shared by {machine.device_count} process(es)")
        if survey.mean is not None:
            ch("data.mean", survey.mean, "measured on sampled images")
            ch("data.std", survey.std, "measured on sampled images")
        ch("run.precision", "auto", "fp32 or bf16, whichever this run's first steps run faster (bf16 units on this "
           "CPU; training/run/precision_timing.py)" if machine.device_type == "cpu" and machine.bf16 else
           f"{machine.precision} on this machine (training/run/precision.py)")
        if machine.device_type == "cpu":  # the plan block shows what the timing chose (training/pretrain.py)
            ch("run.cpu_attention", "auto", "bf16 attention: explicit or SDPA, timed with the precision "
               "(training/run/speed_timing.py)")
            ch("run.cpu_threads", 0, "torch's threads: its default, timed against one fewer when loader workers "
               "share the cores")


def _step_choices(plan: Plan, steps: int) -> None:
    """The choices made from the run's step count (``STEP_KEYS``; module docstring, 6.)."""
    horizon = min(250, max(100, round(0.02 * steps)))
    plan.choose("optim.ema_start", round(1 - 1 / horizon, 4),
                f"EMA averaging over ~{horizon} steps, 2 % of the ~{steps:,} planned (0.99 to 0.996)")
    plan.choose("run.checkpoint_every_steps", min(2500, max(100, int(round(steps / 20, -2)))),
                "about every 5 % of the run")


def _low_detail_views(plan: Plan, survey: DataSurvey) -> None:
    """Views that keep most of an image with little detail (module docstring, 3.): the official crops, masking and
    photometric jitter leave two views of an 8-px digit too little in common, and the run stalls at log K."""
    detail = survey.describe_detail()
    ch = plan.choose
    ch("mask.rand_crop_scale", [LOW_DETAIL_CROP, 1.0],
       f"{detail}: a crop keeps at least {LOW_DETAIL_CROP * 100:.0f} % of the image (0.3 cuts a stroke fragment)")
    ch("mask.ratio", LOW_DETAIL_MASK, f"{detail}: 15 % of the 16 patches is masked, not 30 %")
    for key in ("augment.color_jitter_p", "augment.grayscale_p", "augment.blur_p"):
        ch(key, 0.0, f"{detail}: no photometric jitter to blur or wash out what there is")


def _working_size(side: int, *, small: bool) -> int:
    """The trained image size for images whose shorter side is ``side`` (see the module docstring, 1.)."""
    if side < MIN_IMAGE_SIZE:
        side *= math.ceil(MIN_IMAGE_SIZE / side)
    if side < SMALL_GRID * PATCH or small:
        return max(MIN_IMAGE_SIZE, SMALL_GRID * round(side / SMALL_GRID))
    return min(MAX_IMAGE_SIZE, PATCH * (side // PATCH))


def _batch(shape: StepShape, machine: Machine, survey: DataSurvey, fixed: dict[str, Any]) -> tuple[int, str]:
    """Images per device per step, and why."""
    if fixed.get("data.batch_size"):
        return int(fixed["data.batch_size"]), SET_BY_YOU
    cap = max(2, min(REFERENCE_BATCH, survey.num_images // 8) // machine.device_count)
    if machine.device_type == "cpu":
        return _power_of_two(min(64 // machine.device_count, cap)), "the small-image recipe's 64 per step on CPUs"
    params = encoder_parameters(shape.embed_dim, shape.depth) + 3 * shape.head_hidden_dim ** 2
    free = 0.8 * machine.device_memory_gib * 2**30 - 20 * params - 2 * 2**30  # weights, grads, AdamW, target
    fit = int(free // activation_bytes_per_image(shape, machine.bf16))
    batch = _power_of_two(min(fit, cap))
    limit = "the paper's global 1,024" if batch * machine.device_count >= REFERENCE_BATCH else (
        "an eighth of the images" if batch == _power_of_two(cap) and fit >= cap else "what fits in memory")
    return batch, f"{limit} ({fit:,} would fit in {machine.device_memory_gib:.0f} GiB)"


def _power_of_two(n: int) -> int:
    return max(2, 2 ** int(math.log2(max(n, 2))))
