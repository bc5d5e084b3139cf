"""run.precision: auto on a CPU with bf16 units times real steps of fp32 and bf16, keeps the faster, and undoes them.

The steps are real steps of a tiny model; only the clock is simulated (a timer that runs the step and reports a
chosen duration), so the tests decide the same on any CPU, with or without bf16 units. The timing's schedule is
shortened to one warm-up step and three windows of one step per precision, to keep the tests fast. The attention
kernel is fixed here (and no loader workers leave threads to time): ``test_speed_timing.py`` times those.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import yaml

from msn_core.hardware import cpu_info
from training import distributed as dist
from training.config import load_config
from training.run import precision_timing
from training.run.build import Run, build_run
from training.run.precision_timing import Setting, SpeedChoice, choose_speed, timing_steps
from training.run.step import start_hyperparameters, train_step

from .test_precision import AVX2_ONLY, AVX512_BF16, TINY

LONG = [*TINY, "optim.total_steps=10000", "run.cpu_attention=explicit"]  # long enough to pay for the timing


@pytest.fixture(autouse=True)
def short_timing(monkeypatch):
    monkeypatch.setattr(precision_timing, "WARMUP_STEPS", 1)
    monkeypatch.setattr(precision_timing, "WINDOWS", 3)
    monkeypatch.setattr(precision_timing, "WINDOW_STEPS", 1)


def _run(*extra: str) -> Run:
    return build_run(load_config(None, [*LONG, *extra]), dist.init_distributed("cpu"))


def _clock(bf16: list[float] | float, fp32: float = 0.01):
    """A timer that runs the real step and reports simulated seconds: ``bf16`` per call (a list: call by call)."""
    calls: Counter[str] = Counter()

    def timer(setting, step):
        precision = setting.precision
        step()
        calls[precision] += 1
        if precision == "fp32":
            return fp32
        return bf16[calls[precision] - 1] if isinstance(bf16, list) else bf16

    return timer, calls


def _never(setting, step):
    raise AssertionError(f"timed a {setting} step")


def _snapshot(run: Run) -> dict:
    return {"online": {k: v.clone() for k, v in run.online.state_dict().items()},
            "target": {k: v.clone() for k, v in run.target.state_dict().items()},
            "rng": torch.get_rng_state(), "mask": run.mask_generator.get_state(), "precision": run.precision}


def _same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["online"][k], v) for k, v in b["online"].items())
            and all(torch.equal(a["target"][k], v) for k, v in b["target"].items())
            and torch.equal(a["rng"], b["rng"]) and torch.equal(a["mask"], b["mask"]))


def test_bf16_slower_keeps_fp32_and_leaves_no_trace():
    run = _run()
    before = _snapshot(run)
    # bf16 at twice fp32's step time, except one fast first window (a noisy moment): the median window decides
    timer, calls = _clock([0.02, 0.001, 0.02, 0.02])  # warm-up, then three windows
    choice = choose_speed(run, cpu=AVX512_BF16, timer=timer)
    assert choice.precision == "fp32" and choice.timed
    assert calls == {"fp32": 4, "bf16": 4} and choice.steps == timing_steps(2) == 8
    assert choice.images_per_second() == pytest.approx({"fp32": 1600.0, "bf16": 800.0})  # batch 16
    assert "fp32 1600 and bf16 800 images/s" in choice.reasons["run.precision"]
    # every weight, buffer and RNG stream as before; AdamW holds no state, no gradient is left over
    assert _same(before, _snapshot(run)) and run.precision == before["precision"]
    assert run.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in run.online.parameters())


def test_nothing_is_timed_when_there_is_nothing_to_choose_or_no_time_to_pay_for_it():
    run = _run()
    for precision in ("fp32", "bf16"):  # set by the user
        run.cfg.run.precision = precision
        choice = choose_speed(run, cpu=AVX512_BF16, timer=_never)
        assert (choice.precision, choice.reasons["run.precision"], choice.timed) == (precision, "set by you", False)
    run.cfg.run.precision = "auto"
    choice = choose_speed(run, cpu=AVX2_ONLY, timer=_never)  # bf16 would be emulated
    assert choice.precision == "fp32" and "no bf16 units" in choice.reasons["run.precision"]
    for stored in ("fp32", "bf16"):  # a resumed run keeps its checkpoint's precision
        choice = choose_speed(run, stored={"precision": stored}, cpu=AVX512_BF16, timer=_never)
        assert choice.precision == stored and "resumed" in choice.reasons["run.precision"]
    short = _run("optim.total_steps=100")  # 8 timing steps would be 8 % of it: the flag rule
    choice = choose_speed(short, cpu=AVX512_BF16, timer=_never)
    why = choice.reasons["run.precision"]
    assert choice.precision == "bf16" and "not timed: 8 timing steps" in why and "100" in why
    amx = cpu_info("avx2 avx512f avx512_bf16 amx_tile amx_bf16")
    assert choose_speed(_run("run.max_steps=10"), cpu=amx, timer=_never).precision == "bf16"


def test_a_budget_too_short_for_the_timing_stops_after_the_warm_up():
    run = _run("optim.total_steps=null", "optim.budget_minutes=0.001")  # 0.06 s: 6 timed steps of 0.01 s are too many
    timer, calls = _clock(0.01)
    choice = choose_speed(run, cpu=AVX512_BF16, timer=timer)
    assert not choice.timed and choice.steps == 2 and calls == {"fp32": 1, "bf16": 1}
    assert choice.precision == "bf16" and "more than 5 % of the 0.001-minute budget" in choice.reasons["run.precision"]


@pytest.mark.parametrize("bf16_seconds, expected", [(0.02, "fp32"), (0.005, "bf16")])
def test_the_faster_is_kept_and_trains_the_weights_it_would_set_explicitly(bf16_seconds, expected):
    def trained(run: Run) -> dict:
        batches, hyper = iter(run.loader), start_hyperparameters(run.cfg)
        for _ in range(3):
            train_step(run, hyper, next(batches)[0])
        return _snapshot(run)

    auto = _run()  # built, timed and trained before the explicit run is built: the global RNG is the process's
    timer, _ = _clock(bf16_seconds)
    choice = choose_speed(auto, cpu=AVX512_BF16, timer=timer)
    auto.use_precision(choice.precision)
    assert choice.precision == expected
    assert choice.seconds_per_step == pytest.approx({"fp32": 0.01, "bf16": bf16_seconds})
    with_auto = trained(auto)
    assert _same(trained(_run(f"run.precision={expected}")), with_auto)


def test_config_yaml_records_the_resolved_precision_and_the_measurement(tmp_path):
    from training.config import with_keys
    from training.pretrain import write_run_config
    from training.run.decide import Decisions, settle_speed

    run = _run()
    choice = SpeedChoice(Setting("fp32", "explicit", torch.get_num_threads()), {"run.precision": "auto"},
                         {"run.precision": "the faster of fp32 1600 and bf16 800 images/s, timed"},
                         {"fp32": 0.01, "bf16": 0.02}, "fp32", global_batch=16, steps=36, seconds=5.0)
    write_run_config(with_keys(run.cfg, settle_speed(run, choice, None)), tmp_path, Decisions(None, choice))
    assert run.precision == "fp32" and run.autocast is not None
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["run"]["precision"] == "fp32"
    assert written["plan"]["why"]["run.precision"].startswith("the faster of fp32 1600 and bf16 800 images/s")
    assert written["plan"]["speed_timing"]["images_per_second"] == {"fp32": 1600.0, "bf16": 800.0}
    assert load_config(tmp_path / "config.yaml").run.precision == "fp32"  # the record is skipped when loading


def test_the_budget_is_sized_from_the_timed_rate_without_timing_again(monkeypatch):
    """A timed precision's seconds per step size a budget run: calibration does not run its steps a second time."""
    import time

    from training.run import length

    monkeypatch.setattr(length, "calibrate_budget", lambda *a, **k: pytest.fail("the budget timed steps again"))
    run = build_run(load_config(None, [*TINY, "optim.budget_minutes=1"]), dist.init_distributed("cpu"))
    before = _snapshot(run)
    decided = length.decide_run_length(run, stored=None, started_at=time.monotonic(), seconds_per_step=0.05)
    assert decided.decided_by == "optim.budget_minutes"
    assert 1100 <= decided.total_steps <= 60 / 0.05 / 1.03  # 60 s at 0.05 s/step, less the 3 % reserve
    assert _same(_snapshot(run), before)
