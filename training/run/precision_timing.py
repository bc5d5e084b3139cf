"""``auto`` speed settings timed on this run's own steps: the precision, bf16 CPU attention, CPU threads.

bf16 units do not make every step faster: on a 2-core Xeon with AVX512-BF16 but no AMX the demo trained at
341-352 images/s in bf16 against 536-561 in fp32, so the CPU flags only say that bf16 *can* pay; likewise the
attention kernel chosen on a Zen 4 lost on an AMX Xeon, and torch's thread count ignores the loader workers that
share its cores (``training/run/speed_timing.py`` has each setting's candidates). Before the first step
``choose_speed`` therefore runs real optimiser steps of this run (its networks, batch size, views and loader) in
every combination of the candidates: ``WARMUP_STEPS`` untimed ones each (oneDNN primitives, allocator,
compilation), then ``WINDOWS`` timed windows of ``WINDOW_STEPS`` steps each, interleaved A, B, C, C, B, A, ... so
that a noisy moment on a shared machine falls on all and a slow drift cancels. The median window decides. Every rank
times; the ranks gather their windows and all keep the combination the slowest rank runs fastest.

Nothing of the run changes: these are trial steps (``training/run/trial.py``, which budget calibration uses too): the
weights, BatchNorm statistics, AdamW's state and every RNG stream, and here also the attention kernel and the thread
count, are saved before and put back after, so a run with ``auto`` ends with the same weights as the same run with
the chosen settings set explicitly. Timing fp32 and bf16 costs ``timing_steps(2)`` steps (36; 3.5-4 s for the demo
on a 2-core Zen 4, under 1 % of its 10-minute budget), fp32 and bf16 with both kernels ``timing_steps(3)`` (54); its
seconds count against a budget like any start-up work.

Not timed, with the reason said: an explicit value; a single candidate (a GPU, or a CPU without bf16 units, where
``training/run/precision.py``'s flag rule decides); a resumed run (it keeps its checkpoint's settings, so it
continues bit-exactly); and a run too short to pay for the timing (more than ``MAX_COST`` of its steps, or of its
budget at the warm-up steps' pace): the last settings (threads, then attention, then the precision) keep their
flag rule until the rest fits.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from msn_core.hardware import CpuInfo
from training import distributed as dist
from training.model.vit import Attention, use_cpu_attention
from training.run.build import Run
from training.run.length import config_stop_step
from training.run.precision import precision_candidates, resolve_precision
from training.run.precedence import Options, Resumed, decide
from training.run.speed_timing import attention_options, thread_options
from training.run.trial import loader_step, undone, wall_seconds

__all__ = ["Setting", "SpeedChoice", "Timer", "choose_speed", "timing_steps", "use_setting", "wall_timer"]

WARMUP_STEPS = 2  # per candidate, untimed
WINDOWS = 4  # timed windows per candidate
WINDOW_STEPS = 4  # steps per window: 16 timed steps per candidate, as many as budget calibration times
MAX_COST = 0.05  # the most of a run's steps (or budget) the timing may take; shorter runs keep the flag rule


@dataclass(frozen=True)
class Setting:
    """One combination the step can run in; None: the setting does not apply (on a GPU)."""

    precision: str
    attention: str | None = None  # bf16 attention on a CPU: explicit | sdpa
    threads: int | None = None  # torch's intra-op threads on a CPU


# Runs one step (the callable) in the setting and returns its seconds; tests simulate the clock with it.
Timer = Callable[[Setting, Callable[[], None]], float]


def wall_timer(setting: Setting, step: Callable[[], None]) -> float:
    """The step's wall-clock seconds, queued device work included."""
    return wall_seconds(step)


def timing_steps(candidates: int) -> int:
    """Optimiser steps (all undone) that timing ``candidates`` combinations takes."""
    return candidates * (WARMUP_STEPS + WINDOWS * WINDOW_STEPS)


def use_setting(run: Run, setting: Setting) -> None:
    """Run the following steps in ``setting``: the timing tries each combination, then the run keeps one."""
    run.use_precision(setting.precision)
    if setting.attention is not None:
        use_cpu_attention((run.online, run.target), setting.attention)
    if setting.threads is not None:
        torch.set_num_threads(setting.threads)


_FIELDS = {"run.precision": "precision", "run.cpu_attention": "attention", "run.cpu_threads": "threads"}


@dataclass(frozen=True)
class SpeedChoice:
    """The settings the run trains in and why (by config key); when timed, each combination's median seconds per
    step, by label."""

    setting: Setting
    requested: dict[str, Any]
    reasons: dict[str, str]
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    label: str = ""  # the chosen combination's key in seconds_per_step
    global_batch: int = 0
    steps: int = 0  # optimiser steps the timing ran and undid
    seconds: float = 0.0  # wall-clock seconds the timing took, warm-up included

    @property
    def precision(self) -> str:
        return self.setting.precision

    @property
    def timed(self) -> bool:
        return bool(self.seconds_per_step)

    @property
    def chosen_seconds_per_step(self) -> float | None:
        """The chosen combination's measured step time (seeds a budget run's length), None when not timed."""
        return self.seconds_per_step.get(self.label)

    def values(self) -> dict[str, Any]:
        """The resolved config value of every setting that applies here, by dotted key."""
        return {key: getattr(self.setting, _FIELDS[key]) for key in self.reasons}

    def images_per_second(self) -> dict[str, float]:
        return {label: self.global_batch / s for label, s in self.seconds_per_step.items()}

    def record(self) -> dict[str, Any]:
        """The measurement, for the ``plan`` section of the run's ``config.yaml``."""
        record: dict[str, Any] = {"requested": dict(self.requested), "chosen": self.values()}
        if self.timed:
            record.update(
                images_per_second={k: round(r, 2) for k, r in self.images_per_second().items()},
                seconds_per_step={k: round(s, 5) for k, s in self.seconds_per_step.items()},
                windows=WINDOWS, window_steps=WINDOW_STEPS, steps=self.steps, seconds=round(self.seconds, 2))
        return record


def choose_speed(run: Run, *, stored: dict[str, Any] | None = None, cpu: CpuInfo | None = None,
                 timer: Timer = wall_timer, threads: int | None = None) -> SpeedChoice:
    """The settings ``run`` trains in. ``stored``: a resumed checkpoint's settings (its ``run`` config section, the
    precision it trained in as ``precision``; None: not resumed); ``cpu`` replaces this machine's CPU reading,
    ``threads`` torch's default thread count. Every rank must call it (the timing's steps and gathers are
    collective)."""
    options = _options(run, stored, cpu, threads)
    requested = {key: getattr(run.cfg.run, key.split(".")[1]) for key in options}
    run_steps = config_stop_step(run.cfg, run.steps_per_epoch)
    if run_steps is not None:
        options = _affordable(options, lambda n: timing_steps(n) <= MAX_COST * run_steps,
                              lambda n: f"{timing_steps(n)} timing steps would be more than {MAX_COST * 100:g} % "
                                        f"of the run's {run_steps}")
    if len(_settings(options)) == 1:
        return SpeedChoice(_settings(options)[0], requested, _reasons(options))
    budget = run.cfg.optim.budget_minutes if run.cfg.optim.total_steps is None else None
    started = time.monotonic()
    with _undone(run):
        options, seconds, steps = _time(run, options, timer, budget_seconds=60 * budget if budget else None)
    spent = time.monotonic() - started
    settings = _settings(options)
    if seconds is None:
        return SpeedChoice(settings[0], requested, _reasons(options), global_batch=run.global_batch, steps=steps,
                           seconds=spent)
    chosen = min(settings, key=seconds.__getitem__)  # a tie keeps the first: fp32, explicit, torch's threads
    labels = {s: _label(s, options) for s in settings}
    detail = (f", timed on this run's steps ({WINDOWS} interleaved windows of {WINDOW_STEPS} steps each; {steps} "
              f"steps, {spent:.1f} s, undone)")
    reasons = _reasons(options)
    for key in [k for k, o in options.items() if o.timed]:
        reasons[key] = _timed_reason(key, options, seconds, chosen, run.global_batch) + detail
        detail = ", timed in the same pass"
    return SpeedChoice(chosen, requested, reasons, {labels[s]: seconds[s] for s in settings}, labels[chosen],
                       run.global_batch, steps, spent)


def _options(run: Run, stored: dict[str, Any] | None, cpu: CpuInfo | None,
             threads: int | None) -> dict[str, Options]:
    """Every setting that applies on this device, by config key, in the order they give way when time is short;
    each decided by the one ladder (``training/run/precedence.py``)."""
    requested, device = run.cfg.run.precision, run.device
    flag = resolve_precision(requested, device, cpu)
    candidates = precision_candidates(requested, device, cpu)
    machine = None  # the machine leaves one precision: nothing to time, whatever a checkpoint says
    if len(candidates) == 1:
        why = ("the GPU supports bf16" if flag == "bf16" else "the GPU has no bf16") if device.type == "cuda" else (
            "no bf16 units on this CPU (AMX or AVX512-BF16): bf16 would be emulated, slower")
        machine = Options("run.precision", (flag,), flag, f"{why}; not timed")
    resumed = None
    if stored is not None:
        kept = stored.get("precision")
        resumed = Resumed(kept if kept in candidates else None, "the resumed checkpoint's precision; not timed "
                          "again, so the run continues bit-exactly", flag, "resumed from a checkpoint that records no "
                          "usable precision: the CPU-flag rule; not timed")
    rule = Options("run.precision", candidates, flag, f"{flag} by the CPU-flag rule (bf16 units); not timed")
    precision = decide("run.precision", requested, auto="auto", rule=rule, machine=machine, resumed=resumed)
    found = [precision, attention_options(run.cfg, device, precision.candidates, stored=stored),
             thread_options(run.cfg, device, stored=stored, default=threads)]
    return {o.key: o for o in found if o is not None}


def _settings(options: dict[str, Options]) -> list[Setting]:
    """Every combination worth timing; attention varies only in bf16 (fp32 attention is always SDPA)."""
    attention, threads = options.get("run.cpu_attention"), options.get("run.cpu_threads")
    return [Setting(p, a, t) for p in options["run.precision"].candidates
            for a in ((attention.candidates if p == "bf16" else (attention.flag,)) if attention else (None,))
            for t in (threads.candidates if threads else (None,))]


def _affordable(options: dict[str, Options], fits: Callable[[int], bool],
                why: Callable[[int], str]) -> dict[str, Options]:
    """``options`` with the last timed settings kept at their flag value until timing the rest ``fits``."""
    options = dict(options)
    for key in reversed(list(options)):
        count = len(_settings(options))
        if count == 1 or fits(count):
            break
        if options[key].timed:
            options[key] = options[key].fixed(why(count))
    return options


def _reasons(options: dict[str, Options]) -> dict[str, str]:
    return {key: o.reason for key, o in options.items()}


def _show(key: str, value: Any) -> str:
    return f"{value} thread{'s' * (value != 1)}" if key == "run.cpu_threads" else str(value)


def _rate(images_per_second: float) -> str:
    return f"{images_per_second:.0f}" if images_per_second >= 100 else f"{images_per_second:.3g}"


def _label(setting: Setting, options: dict[str, Options]) -> str:
    """The combination in the words of what varies: ``fp32``, ``bf16 sdpa``, ``bf16 sdpa 1 thread``."""
    parts = [setting.precision] if options["run.precision"].timed else []
    if "run.cpu_attention" in options and options["run.cpu_attention"].timed and setting.precision == "bf16":
        parts.append(str(setting.attention))
    if "run.cpu_threads" in options and options["run.cpu_threads"].timed:
        parts.append(_show("run.cpu_threads", setting.threads))
    return " ".join(parts)


def _timed_reason(key: str, options: dict[str, Options], seconds: dict[Setting, float], chosen: Setting,
                  batch: int) -> str:
    """The timed setting's values side by side, each at its best combination's images/s."""
    best: dict[Any, float] = {}
    for setting, s in seconds.items():
        if key != "run.cpu_attention" or setting.precision == "bf16":
            value = getattr(setting, _FIELDS[key])
            best[value] = min(best.get(value, s), s)
    rates = [f"{_show(key, v)} {_rate(batch / best[v])}" for v in options[key].candidates]
    listed = " and ".join([", ".join(rates[:-1]), rates[-1]])
    if key == "run.cpu_attention" and chosen.precision != "bf16":
        return f"not used: the run trains in {chosen.precision} (SDPA); in bf16 {listed} images/s"
    return f"the {'faster' if len(rates) == 2 else 'fastest'} of {listed} images/s"


def _time(run: Run, options: dict[str, Options], timer: Timer, *,
          budget_seconds: float | None) -> tuple[dict[str, Options], dict[Setting, float] | None, int]:
    """The options left once the warm-up's pace is known (a budget may not pay for them all), each combination's
    median window (seconds per step, the slowest rank's; None when none is left to compare), and the steps run."""
    step = loader_step(run)  # training/run/trial.py
    steps = 0

    def timed(setting: Setting) -> float:
        nonlocal steps
        use_setting(run, setting)
        steps += 1
        return timer(setting, step)

    warm = {}
    for _ in range(WARMUP_STEPS):
        for setting in _settings(options):
            warm[setting] = timed(setting)  # the last warm-up step of each: its pace after start-up
    pace = max(max(rank.values()) for rank in dist.all_gather_object(warm))
    if budget_seconds is not None:
        options = _affordable(options, lambda n: pace * WINDOWS * WINDOW_STEPS * n <= MAX_COST * budget_seconds,
                              lambda n: f"timing would take ~{pace * WINDOWS * WINDOW_STEPS * n:.1f} s, more than "
                                        f"{MAX_COST * 100:g} % of the {budget_seconds / 60:g}-minute budget")
    settings = _settings(options)
    if len(settings) == 1:
        return options, None, steps
    windows: dict[Setting, list[float]] = {setting: [] for setting in settings}
    for w in range(WINDOWS):
        for setting in settings if w % 2 == 0 else settings[::-1]:  # A B, B A, ...: drift falls on all
            windows[setting].append(sum(timed(setting) for _ in range(WINDOW_STEPS)) / WINDOW_STEPS)
    ranks = dist.all_gather_object(windows)
    return options, {setting: statistics.median(max(rank[setting][w] for rank in ranks) for w in range(WINDOWS))
                     for setting in settings}, steps


@contextmanager
def _undone(run: Run) -> Iterator[None]:
    """Trial steps (``training/run/trial.py``: weights and buffers, AdamW's state, the RNG streams put back) that
    also put back the settings they tried: the precision, the attention kernels and torch's threads."""
    modules = (run.online, run.target)
    kernels = [(m, m.cpu_bf16_kernel) for module in modules for m in module.modules() if isinstance(m, Attention)]
    precision, threads = run.precision, torch.get_num_threads()
    try:
        with undone(modules, run.optimizer, run.mask_generator):
            yield
    finally:
        run.use_precision(precision)
        for attention, kernel in kernels:
            attention.cpu_bf16_kernel = kernel
        torch.set_num_threads(threads)
