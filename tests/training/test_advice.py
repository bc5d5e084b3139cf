"""The advice table (training/run/advice.py): every key a stall may advise is declared with what taking it rebuilds,
every declared key is a key of the config, and a switch applied as a run event rebuilds what the table says."""

from __future__ import annotations

import pytest
import torch

from training import distributed as dist
from training.config import Config, FrozenConfigError, freeze, load_config, with_keys
from training.run.advice import ADVICE, advised, rebuilds
from training.run.build import build_run
from training.run.checkpoints import Checkpoints
from training.run.events import RunEvents
from training.run.length import schedule_run
from training.run.stall import Adaptation, StallDetector, StallSettings
from training.run.state import TrainState

from .test_precision import TINY

SIGNALS = {"start_entropy": 6.74, "entropy": 6.73}  # what advice() reads of the signals


def _every_advice() -> list[dict]:
    """The advice of every cause the detector can name, for images with little detail and with more, with and
    without pose and stroke jitter."""
    found = []
    for low_detail in (True, False):
        for shape_jitter in (True, False):
            settings = StallSettings(num_prototypes=1024, global_batch=64, lr=2.5e-6, sharpen_start=0.25,
                                     sharpen_end=0.25, low_detail=low_detail, shape_jitter=shape_jitter)
            detector = StallDetector(settings, total_steps=2850)
            found += [detector.advice(cause, SIGNALS)[1] for cause in ("learning_rate", "views", "targets")]
    return found


def test_every_advised_key_is_declared_and_every_declared_key_is_a_config_key():
    advice = _every_advice()
    advised_keys = {key for sets in advice for key in sets}
    assert advised_keys <= set(ADVICE)
    assert advised_keys == set(ADVICE), f"declared but never advised: {set(ADVICE) - advised_keys}"
    config = Config().to_dict()
    for key in ADVICE:
        section, _, name = key.partition(".")
        assert name in config.get(section, {}), f"{key} is not a config key"
    base = load_config(None, ["data.source=synthetic"])
    for sets in advice:  # every advice is a valid --set of the config
        with_keys(base, sets)


def test_the_table_says_what_each_switch_rebuilds_and_refuses_what_it_does_not_declare():
    assert rebuilds(["optim.lr", "optim.start_lr"]) == {"schedules"}
    assert rebuilds(["mask.rand_crop_scale", "mask.ratio", "augment.blur_p"]) == {"views", "step"}
    with pytest.raises(KeyError, match="model.depth"):
        advised({"optim.lr": 1e-3, "model.depth": 2})


def test_a_switch_is_a_run_event_that_replaces_the_config_and_rebuilds_the_views(tmp_path):
    cfg = freeze(load_config(None, [*TINY, "optim.total_steps=100"]))
    torch.manual_seed(0)
    run = build_run(cfg, dist.init_distributed("cpu"))
    checkpoints = Checkpoints(run, TrainState(run.online, run.target, run.optimizer), tmp_path)
    events = RunEvents(run, schedule_run(run, stored=None, started_at=0.0), checkpoints)
    augment, lr = run.augment, events.schedule.schedules.at(50).lr
    sets = {"mask.rand_crop_scale": [0.6, 1.0], "mask.ratio": 0.15, "augment.blur_p": 0.0}
    events.apply(Adaptation(50, "views", sets))
    assert run.cfg is not cfg and cfg.mask.ratio == 0.3 and run.cfg.mask.ratio == 0.15
    assert run.augment is not augment and events.schedule.schedules.at(50).lr == lr  # views only
    assert checkpoints.adaptation == Adaptation(50, "views", sets)
    with pytest.raises(FrozenConfigError):
        run.cfg.mask.ratio = 0.5
    events.apply(Adaptation(60, "learning_rate", {"optim.lr": 2e-3, "optim.start_lr": 2e-4}))
    assert events.schedule.schedules.at(50).lr > lr and run.cfg.mask.ratio == 0.15
