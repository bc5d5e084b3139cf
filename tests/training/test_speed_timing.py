"""run.cpu_attention / run.cpu_threads: auto is timed with the precision on the run's own steps, the faster kept,
everything undone; the two attention kernels compute the same thing.

As in ``test_precision_choice.py`` the steps are real steps of a tiny model and only the clock is simulated, with
the timing's schedule shortened (one warm-up step, three windows of one step per combination).
"""
from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from training import distributed as dist
from training.config import ConfigError, load_config
from training.model.vit import Attention, build_encoder, explicit_attention, use_cpu_attention
from training.run import precision_timing
from training.run.build import Run, build_run
from training.run.plan import DataSurvey, plan_run
from training.run.precision_timing import choose_speed, timing_steps, use_setting
from training.run.step import start_hyperparameters, train_step

from .test_plan import CPU as CPU_MACHINE
from .test_precision import AVX512_BF16, TINY

REPO = Path(__file__).resolve().parents[2]
LONG = [*TINY, "optim.total_steps=10000"]  # long enough to pay for the timing
BF16 = [*LONG, "run.precision=bf16"]


@pytest.fixture(autouse=True)
def short_timing(monkeypatch):
    monkeypatch.setattr(precision_timing, "WARMUP_STEPS", 1)
    monkeypatch.setattr(precision_timing, "WINDOWS", 3)
    monkeypatch.setattr(precision_timing, "WINDOW_STEPS", 1)


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(*overrides: str) -> Run:
    return build_run(load_config(None, list(overrides)), dist.init_distributed("cpu"))


def _clock(seconds: dict[tuple, float]):
    """A timer that runs the real step and reports ``seconds[(precision, attention, threads)]``; keys may leave out
    what does not vary (``None`` matches anything)."""
    calls: Counter[tuple] = Counter()

    def timer(setting, step):
        step()
        key = (setting.precision, setting.attention, setting.threads)
        calls[key] += 1
        for pattern, s in seconds.items():
            if all(want is None or want == got for want, got in zip(pattern, key, strict=True)):
                return s
        raise AssertionError(f"no simulated time for {key}")

    return timer, calls


def _kernels(run: Run) -> set[str]:
    return {m.cpu_bf16_kernel for net in (run.online, run.target) for m in net.modules() if isinstance(m, Attention)}


def _snapshot(run: Run) -> dict:
    return {"online": {k: v.clone() for k, v in run.online.state_dict().items()},
            "target": {k: v.clone() for k, v in run.target.state_dict().items()},
            "rng": torch.get_rng_state(), "mask": run.mask_generator.get_state()}


def _same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["online"][k], v) for k, v in b["online"].items())
            and all(torch.equal(a["target"][k], v) for k, v in b["target"].items())
            and torch.equal(a["rng"], b["rng"]) and torch.equal(a["mask"], b["mask"]))


def test_bf16_kernel_follows_the_clock_and_leaves_no_trace():
    run = _run(*BF16)
    before, threads = _snapshot(run), torch.get_num_threads()
    # sdpa faster in two windows of three; one noisy window makes it slow: the median decides
    timer, calls = _clock({("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.01})
    choice = choose_speed(run, timer=timer)
    assert choice.setting.attention == "sdpa" and choice.label == "sdpa" and choice.steps == timing_steps(2) == 8
    assert sum(calls.values()) == 8 and choice.images_per_second() == pytest.approx({"explicit": 800, "sdpa": 1600})
    assert choice.reasons["run.cpu_attention"].startswith("the faster of explicit 800 and sdpa 1600 images/s")
    assert choice.reasons["run.precision"] == "set by you" and "no data loader workers" in choice.reasons[
        "run.cpu_threads"]
    assert _same(before, _snapshot(run)) and _kernels(run) == {"explicit"} and torch.get_num_threads() == threads
    assert run.optimizer.state_dict()["state"] == {} and all(p.grad is None for p in run.online.parameters())


def test_precision_and_kernel_are_timed_in_one_pass():
    run = _run(*LONG)
    timer, calls = _clock({("fp32", None, None): 0.01, ("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.008})
    choice = choose_speed(run, cpu=AVX512_BF16, timer=timer)
    assert (choice.precision, choice.setting.attention) == ("bf16", "sdpa") and choice.steps == timing_steps(3)
    assert set(choice.seconds_per_step) == {"fp32", "bf16 explicit", "bf16 sdpa"} and len(calls) == 3
    assert choice.reasons["run.precision"].startswith("the faster of fp32 1600 and bf16 2000 images/s, timed on")
    assert choice.reasons["run.cpu_attention"] == ("the faster of explicit 800 and sdpa 2000 images/s, timed in the "
                                                   "same pass")
    # fp32 wins: the kernel was measured but is not used, and the reason says so
    timer, _ = _clock({("fp32", None, None): 0.005, ("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.01})
    choice = choose_speed(run, cpu=AVX512_BF16, timer=timer)
    assert choice.precision == "fp32" and choice.reasons["run.cpu_attention"].startswith("not used: the run trains "
                                                                                          "in fp32 (SDPA)")


def test_threads_are_timed_when_loader_workers_share_the_cores_and_give_way_first_when_time_is_short():
    run = _run(*BF16, "data.num_workers=1")
    threads = torch.get_num_threads()
    timer, calls = _clock({("bf16", "explicit", 2): 0.02, ("bf16", "explicit", 1): 0.015,
                           ("bf16", "sdpa", 2): 0.03, ("bf16", "sdpa", 1): 0.025})
    choice = choose_speed(run, timer=timer, threads=2)
    assert (choice.setting.attention, choice.setting.threads, choice.label) == ("explicit", 1, "explicit 1 thread")
    assert len(calls) == 4 and torch.get_num_threads() == threads  # every combination timed; threads put back
    assert choice.reasons["run.cpu_threads"].startswith("the faster of 2 threads 800 and 1 thread 1067 images/s")
    # 4 combinations cost 16 steps here, 2 cost 8: over 5 % of 200 steps, threads keep torch's default; 8 fit
    short = _run(*BF16, "data.num_workers=1", "optim.total_steps=200")
    timer, calls = _clock({("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.01})
    choice = choose_speed(short, timer=timer, threads=2)
    assert choice.setting == precision_timing.Setting("bf16", "sdpa", 2) and set(calls) == {
        ("bf16", "explicit", 2), ("bf16", "sdpa", 2)}
    assert choice.reasons["run.cpu_threads"] == ("torch's default for this process (2); not timed: 16 timing steps "
                                                 "would be more than 5 % of the run's 200")


@pytest.mark.parametrize("overrides, clock, chosen, explicit", [
    ([], {("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.01}, ("sdpa", 2), ["run.cpu_attention=sdpa"]),
    ([], {("bf16", "explicit", None): 0.01, ("bf16", "sdpa", None): 0.02}, ("explicit", 2),
     ["run.cpu_attention=explicit"]),
    (["data.num_workers=1", "run.cpu_attention=sdpa"], {("bf16", "sdpa", 2): 0.02, ("bf16", "sdpa", 1): 0.01},
     ("sdpa", 1), ["data.num_workers=1", "run.cpu_attention=sdpa", "run.cpu_threads=1"]),
])
def test_the_run_after_timing_trains_the_weights_the_explicit_setting_trains(overrides, clock, chosen, explicit):
    """In a fresh interpreter, as a run is: the low-shot tests' cyanure, loaded earlier in the same pytest worker,
    leaves the process so that two bf16 runs with 2 threads differ in their last bits (seen with
    tests/evaluation/test_lowshot.py run first; one thread is unaffected)."""
    check = (f"from tests.training import test_speed_timing as t; t.after_timing_equals_explicit({overrides!r}, "
             f"{clock!r}, {chosen!r}, {explicit!r})")
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def after_timing_equals_explicit(overrides: list[str], clock: dict, chosen: tuple, explicit: list[str]) -> None:
    """The run timed by ``auto`` (then set to its choice) and a run built with that choice set explicitly train
    bit-identical weights and leave the same random streams."""
    precision_timing.WARMUP_STEPS, precision_timing.WINDOWS, precision_timing.WINDOW_STEPS = 1, 3, 1  # as the fixture

    def trained(run: Run) -> dict:
        batches, hyper = iter(run.loader), start_hyperparameters(run.cfg)
        for _ in range(3):
            train_step(run, hyper, next(batches)[0])
        return _snapshot(run)

    auto = _run(*BF16, *overrides)  # built, timed and trained before the explicit run: the global RNG is shared
    timer, _ = _clock(clock)
    choice = choose_speed(auto, timer=timer, threads=2)
    use_setting(auto, choice.setting)
    assert (choice.setting.attention, choice.setting.threads) == chosen and choice.timed
    with_auto = trained(auto)
    fixed = _run(*BF16, *explicit)
    assert _kernels(fixed) == _kernels(auto) == {chosen[0]} and torch.get_num_threads() == chosen[1]
    assert _same(trained(fixed), with_auto)


def test_explicit_and_sdpa_attention_agree_in_bf16_and_fp32_ignores_the_setting():
    """Both bf16 kernels stay within bf16 rounding of the fp32 result (max error under 2 % of the output's scale; the
    two differ in where they round, not in what they compute); fp32 runs SDPA whatever the setting (the ONNX export
    is fp32), bit for bit."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 6, 37, 64, generator=g) for _ in range(3))
    mask = torch.ones(4, 1, 1, 37, dtype=torch.bool)
    mask[2, ..., 20:] = False
    for m in (None, mask):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explicit = explicit_attention(q, k, v, m).float()
            fused = F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), attn_mask=m).float()
        scale = ref.abs().max()
        assert (explicit - ref).abs().max() < 0.02 * scale and (fused - ref).abs().max() < 0.02 * scale
        assert (explicit - fused).abs().max() < 0.02 * scale
    encoder = build_encoder("vit_tiny", 4, 16, depth=2).eval()
    images = torch.randn(3, 3, 16, 16, generator=g)
    outputs = {}
    for kernel in ("explicit", "sdpa"):
        use_cpu_attention(encoder, kernel)
        with torch.no_grad():
            outputs[kernel] = encoder(images)[0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs[f"{kernel} bf16"] = encoder(images)[0].float()
    assert torch.equal(outputs["explicit"], outputs["sdpa"])
    bf16_gap = (outputs["explicit bf16"] - outputs["sdpa bf16"]).abs().max()
    assert 0 <= bf16_gap < 0.03 * outputs["explicit"].abs().max()
    with pytest.raises(ValueError, match="expected one of explicit, sdpa"):
        use_cpu_attention(encoder, "flash")


def test_one_step_loss_is_the_same_with_either_kernel():
    """A whole bf16 step (forward, loss, backward) on the same weights and batch: the losses agree within 0.5 %."""
    losses = {}
    for kernel in ("explicit", "sdpa"):
        run = _run(*BF16, f"run.cpu_attention={kernel}")
        losses[kernel] = train_step(run, start_hyperparameters(run.cfg), next(iter(run.loader))[0]).metrics()["loss"]
    assert losses["explicit"] == pytest.approx(losses["sdpa"], rel=5e-3)


def test_the_plan_block_and_a_recipe_run_show_each_choice(tmp_path, capsys, caplog):
    from training.config import with_keys
    from training.pretrain import write_run_config
    from training.run.decide import Decisions, settle_speed

    run = _run(*BF16)
    timer, _ = _clock({("bf16", "explicit", None): 0.02, ("bf16", "sdpa", None): 0.01})
    choice = choose_speed(run, timer=timer)
    plan = plan_run(DataSurvey("synthetic", 64, 16, True), CPU_MACHINE, {"optim.budget_minutes": 10})
    assert plan.values["run.cpu_attention"] == "auto"
    values = settle_speed(run, choice, plan)
    Decisions(plan, choice).announce()
    line = next(x for x in capsys.readouterr().out.splitlines() if "run.cpu_attention" in x)
    assert "sdpa" in line and "the faster of explicit 800 and sdpa 1600 images/s" in line
    assert values["run.cpu_attention"] == "sdpa" and _kernels(run) == {"sdpa"}
    with caplog.at_level(logging.INFO, logger="msn.train"):
        Decisions(None, choice).announce()
    assert any(r.getMessage().startswith("run.cpu_attention sdpa: the faster of") for r in caplog.records)
    write_run_config(with_keys(run.cfg, values), tmp_path, Decisions(None, choice))
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["run"]["cpu_attention"] == "sdpa" and written["run"]["cpu_threads"] == torch.get_num_threads()
    assert written["plan"]["speed_timing"]["images_per_second"] == {"explicit": 800.0, "sdpa": 1600.0}
    assert written["plan"]["why"]["run.cpu_attention"].startswith("the faster of explicit 800")
    reread = load_config(tmp_path / "config.yaml")
    assert (reread.run.cpu_attention, reread.run.precision) == ("sdpa", "bf16")


def test_resumed_runs_keep_the_checkpoints_settings_and_bad_values_are_refused():
    run = _run(*LONG)
    choice = choose_speed(run, stored={"precision": "bf16", "cpu_attention": "sdpa", "cpu_threads": 1},
                          cpu=AVX512_BF16, timer=lambda s, step: pytest.fail("timed a resumed run"))
    assert choice.setting == precision_timing.Setting("bf16", "sdpa", 1) and not choice.timed
    assert "resumed" in choice.reasons["run.cpu_attention"]
    with pytest.raises(ConfigError, match="run.cpu_attention"):
        load_config(None, [*TINY, "run.cpu_attention=flash"])
    with pytest.raises(ConfigError, match="run.cpu_threads"):
        load_config(None, [*TINY, "run.cpu_threads=-1"])
