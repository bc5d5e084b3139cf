"""The one precedence ladder a speed setting is decided by: set by you, else the machine, else resumed, else a rule.

Every ``auto`` setting the run decides before its loop (``run.precision``, ``run.cpu_attention``, ``run.cpu_threads``;
``training/run/precision_timing.py`` and ``training/run/speed_timing.py``) climbs the same rungs, in this order (the
planner's choices, ``training/run/plan.py``, climb the first and the last):

1. **set by you**: a value other than the setting's ``auto`` wins, with nothing timed;
2. **the machine**: where the machine leaves one value (a GPU's precision, emulated bf16), that one;
3. **resumed**: a resumed run keeps its checkpoint's value, so it continues bit-exactly; a checkpoint that records
   none usable gets a named fallback instead;
4. **the rule**: the candidates worth timing and the value kept when they are not timed.

Each rung's outcome is an :class:`Options` whose ``reason`` is what the plan block and ``config.yaml`` print.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SET_BY_YOU", "UNSET", "Options", "Resumed", "decide"]

SET_BY_YOU = "set by you"  # the reason of every value the user gave (also the planner's: training/run/plan.py)
UNSET = object()  # ``auto`` of a key that has no auto value: the user did not give it (the planner's keys)


@dataclass(frozen=True)
class Options:
    """One setting (config ``key``): the ``candidates`` to time, the ``flag`` value kept when the run is not timed,
    and ``reason``: why there is one candidate, or how the flag value was found (said when the timing is skipped)."""

    key: str
    candidates: tuple[Any, ...]
    flag: Any
    reason: str

    @property
    def timed(self) -> bool:
        return len(self.candidates) > 1

    def fixed(self, why: str) -> Options:
        """These options with only the flag value left, ``why`` said after the flag rule's reason."""
        return Options(self.key, (self.flag,), self.flag, f"{self.reason}: {why}")


@dataclass(frozen=True)
class Resumed:
    """What a resumed checkpoint says of a setting: its ``value`` (None when it records none usable) kept for
    ``kept``, else ``fallback`` for ``missing``."""

    value: Any
    kept: str
    fallback: Any
    missing: str


def decide(key: str, requested: Any, *, auto: Any, rule: Options, machine: Options | None = None,
           resumed: Resumed | None = None) -> Options:
    """``key``'s options by the ladder (module docstring): ``requested`` is the config's value and ``auto`` the one
    that leaves the choice to the run; ``resumed`` is None when the run did not resume."""
    if requested != auto:
        return Options(key, (requested,), requested, SET_BY_YOU)
    if machine is not None:
        return machine
    if resumed is not None:
        if resumed.value is not None:
            return Options(key, (resumed.value,), resumed.value, resumed.kept)
        return Options(key, (resumed.fallback,), resumed.fallback, resumed.missing)
    return rule
