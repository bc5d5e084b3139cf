"""Schedules against the official stepping semantics and against closed-form values at key steps."""

from __future__ import annotations

import itertools
import math

import pytest

from training.run.schedules import Schedules

VITS = {  # official configs/pretrain/msn_vits16.yaml
    "warmup_epochs": 15,
    "start_lr": 2e-4,
    "ref_lr": 1e-3,
    "final_lr": 1e-6,
    "ref_weight_decay": 0.04,
    "final_weight_decay": 0.4,
    "ema_start": 0.996,
    "ema_end": 1.0,
}


def official_trace(spe: int, epochs: int, warmup: float, horizon_scale: float, sharpen=(0.25, 0.25), **kw):
    """Replay the official training loop's schedule calls; return (lr, wd, m, T) used at each iteration."""
    t_max = int(horizon_scale * epochs * spe)
    warmup_steps = int(warmup * spe)
    lr_step = wd_step = 0.0

    def lr_sched():  # WarmupCosineSchedule.step
        nonlocal lr_step
        lr_step += 1
        if lr_step < warmup_steps:
            progress = float(lr_step) / float(max(1, warmup_steps))
            return kw["start_lr"] + progress * (kw["ref_lr"] - kw["start_lr"])
        progress = float(lr_step - warmup_steps) / float(max(1, t_max - warmup_steps))
        return max(
            kw["final_lr"],
            kw["final_lr"] + (kw["ref_lr"] - kw["final_lr"]) * 0.5 * (1.0 + math.cos(math.pi * progress)),
        )

    def wd_sched():  # CosineWDSchedule.step
        nonlocal wd_step
        wd_step += 1
        ref, final = kw["ref_weight_decay"], kw["final_weight_decay"]
        progress = wd_step / t_max
        new = final + (ref - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(final, new) if final <= ref else min(final, new)

    inc_m = (kw["ema_end"] - kw["ema_start"]) / (spe * epochs * horizon_scale)
    momentum = (kw["ema_start"] + inc_m * i for i in range(int(spe * epochs * horizon_scale) + 1))
    inc_t = (sharpen[1] - sharpen[0]) / (spe * epochs * horizon_scale)
    sharpen_gen = (sharpen[0] + inc_t * i for i in range(int(spe * epochs * horizon_scale) + 1))

    trace = []
    for _ in range(epochs * spe):  # per iteration: T, then lr/wd before optimizer.step, then m after it
        t = next(sharpen_gen)
        lr, wd = lr_sched(), wd_sched()
        trace.append((lr, wd, next(momentum), t))
    return trace


@pytest.mark.parametrize("horizon_scale", [1.0, 1.25])
@pytest.mark.parametrize("spe,epochs,warmup", [(7, 10, 3), (5, 4, 0), (3, 6, 1.5)])
def test_matches_official_loop_every_step(spe, epochs, warmup, horizon_scale):
    kw = dict(VITS, warmup_epochs=warmup)
    s = Schedules.from_epochs(spe, epochs, horizon_scale=horizon_scale, sharpen_start=0.3, sharpen_end=0.2, **kw)
    trace = official_trace(spe, epochs, warmup, horizon_scale, sharpen=(0.3, 0.2), **kw)
    assert len(trace) == s.total_steps
    for step, (lr, wd, m, t) in enumerate(trace):
        assert s.lr(step) == lr
        assert s.weight_decay(step) == wd
        assert s.ema_momentum(step) == m
        assert s.sharpen_temperature(step) == t


def test_key_steps_closed_form():
    spe, epochs = 10, 20  # horizon 250, warmup 50 (kw warmup_epochs=5)
    s = Schedules.from_epochs(spe, epochs, **dict(VITS, warmup_epochs=5))
    assert (s.horizon, s.warmup_steps, s.total_steps) == (250, 50, 200)
    # step 0 already uses the value after one scheduler.step()
    assert s.lr(0) == pytest.approx(2e-4 + (1 / 50) * 8e-4, rel=1e-12)
    assert s.lr(48) == pytest.approx(2e-4 + (49 / 50) * 8e-4, rel=1e-12)
    assert s.lr(49) == pytest.approx(1e-3, rel=1e-12)  # end of warmup: peak
    mid = 1e-6 + (1e-3 - 1e-6) * 0.5 * (1 + math.cos(math.pi * 100 / 200))
    assert s.lr(149) == pytest.approx(mid, rel=1e-12)
    last = 1e-6 + (1e-3 - 1e-6) * 0.5 * (1 + math.cos(math.pi * 150 / 200))
    assert s.lr(199) == pytest.approx(last, rel=1e-12)
    assert s.lr(199) > 1e-4  # stretched horizon: training stops well above final_lr

    assert s.weight_decay(0) == pytest.approx(0.4 - 0.36 * 0.5 * (1 + math.cos(math.pi / 250)), rel=1e-12)
    assert s.weight_decay(199) == pytest.approx(0.4 - 0.36 * 0.5 * (1 + math.cos(math.pi * 0.8)), rel=1e-12)
    assert s.ema_momentum(0) == 0.996
    assert s.ema_momentum(199) == pytest.approx(0.996 + 0.004 * 199 / 250, rel=1e-12)
    assert s.sharpen_temperature(0) == s.sharpen_temperature(199) == 0.25


def test_horizon_one_reaches_final_values_on_last_step():
    s = Schedules.from_epochs(10, 20, horizon_scale=1.0, **dict(VITS, warmup_epochs=5))
    assert s.horizon == s.total_steps == 200
    assert s.lr(199) == pytest.approx(1e-6, rel=1e-9)
    assert s.weight_decay(199) == pytest.approx(0.4, rel=1e-12)
    assert s.ema_momentum(199) == pytest.approx(0.996 + 0.004 * 199 / 200, rel=1e-12)


def test_vits_800_epochs_matches_paper_run():
    s = Schedules.from_epochs(1251, 800, **VITS)  # ImageNet-1k / batch 1024
    last = s.total_steps - 1
    assert s.lr(last) == pytest.approx(9.9e-5, rel=0.01)
    assert s.weight_decay(last) == pytest.approx(0.366, abs=1e-3)
    assert s.ema_momentum(last) == pytest.approx(0.9992, abs=1e-4)
    lrs = [s.lr(i) for i in range(0, s.total_steps, 997)]
    peak = lrs.index(max(lrs))
    assert all(a <= b for a, b in itertools.pairwise(lrs[: peak + 1]))  # warmup increases
    assert all(a >= b for a, b in itertools.pairwise(lrs[peak:]))  # then decays


def test_past_horizon_holds_final_values():
    s = Schedules.from_epochs(10, 10, horizon_scale=0.5, **dict(VITS, warmup_epochs=1))  # horizon 50, trains 100 steps
    assert s.lr(99) == s.lr(49) == pytest.approx(1e-6)
    assert s.weight_decay(99) == pytest.approx(0.4)
    assert s.ema_momentum(99) == s.ema_momentum(50)
    assert s.ema_momentum(99) == pytest.approx(1.0)


def test_weight_decay_can_decrease():
    s = Schedules.from_epochs(10, 10, **dict(VITS, ref_weight_decay=0.4, final_weight_decay=0.04))
    wds = [s.weight_decay(i) for i in range(100)]
    assert all(a >= b for a, b in itertools.pairwise(wds)) and wds[-1] > 0.04


@pytest.mark.parametrize(
    "override",
    [{"steps_per_epoch": 0}, {"epochs": 0}, {"warmup_epochs": -1}, {"horizon_scale": 0}, {"sharpen_end": 0}],
)
def test_validation(override):
    args = {**VITS, "steps_per_epoch": 10, "epochs": 10, **override}
    with pytest.raises(ValueError):
        Schedules.from_epochs(**args)


def test_step_parametrisation_equals_epochs():
    by_epochs = Schedules.from_epochs(7, 10, **dict(VITS, warmup_epochs=3))
    by_steps = Schedules(70, 21, **{k: v for k, v in VITS.items() if k != "warmup_epochs"})
    assert all(by_epochs.lr(i) == by_steps.lr(i) and by_epochs.ema_momentum(i) == by_steps.ema_momentum(i)
               for i in range(70))


@pytest.mark.parametrize("override", [{"total_steps": 0}, {"warmup_steps": -1}])
def test_step_validation(override):
    args = {**{k: v for k, v in VITS.items() if k != "warmup_epochs"}, "total_steps": 10, "warmup_steps": 1,
            **override}
    with pytest.raises(ValueError):
        Schedules(**args)
