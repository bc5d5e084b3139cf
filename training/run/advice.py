"""The keys a stall's advice may set, and what taking it mid-run rebuilds: one table, for the advice and its use.

The stall detector (``training/run/stall.py``) names a likely cause and the config keys that fix it; ``--on-stall
adapt`` takes them mid-run (``training/run/events.py``), which must rebuild whatever the run built from those keys.
Both sides read :data:`ADVICE`: the detector may only advise a key it declares (:func:`advised`), and the switch
rebuilds what it says (:func:`rebuilds`). ``tests/training/test_advice.py`` checks that every key the detector can
advise is here and that every key here is a key of the config.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["ADVICE", "Rebuild", "advised", "rebuilds"]

# views: the run's augmentation (training/run/build.py build_augment); schedules: the learning-rate, weight-decay,
# EMA and sharpening schedules over the same length, warm-up and resizes; step: read off the run's config by every
# step (training/run/step.py), so the new config is all it takes
Rebuild = Literal["views", "schedules", "step"]

ADVICE: Mapping[str, Rebuild] = MappingProxyType({
    "optim.lr": "schedules",
    "optim.start_lr": "schedules",
    "loss.sharpen_start": "schedules",
    "loss.sharpen_end": "schedules",
    "mask.rand_crop_scale": "views",
    "mask.ratio": "step",
    "augment.color_jitter_p": "views",
    "augment.grayscale_p": "views",
    "augment.blur_p": "views",
    "augment.affine_p": "views",
    "augment.stroke_p": "views",
})


def advised(sets: Mapping[str, Any]) -> dict[str, Any]:
    """``sets`` as an advice, refused when it names a key the table does not declare (nothing would rebuild it)."""
    unknown = [key for key in sets if key not in ADVICE]
    if unknown:
        raise KeyError(f"advice names {', '.join(unknown)}, which training/run/advice.py's ADVICE does not declare")
    return dict(sets)


def rebuilds(keys: Iterable[str]) -> frozenset[Rebuild]:
    """What taking an advice of ``keys`` rebuilds (each key must be in the table)."""
    return frozenset(ADVICE[key] for key in advised(dict.fromkeys(keys)))
