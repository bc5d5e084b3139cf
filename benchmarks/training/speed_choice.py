"""What the trainer's ``auto`` speed settings choose on this machine: its own timing pass, measured with the clock.

The run is built in this process from a preset (``benchmarks.training.train_throughput.PRESETS``) plus ``--set``,
made long (``optim.total_steps``, no ``run.max_steps``) so that the pass is worth its cost, and
``training/run/precision_timing.py``'s ``choose_speed`` times the candidates on its steps (undone) exactly as a run
does before its first step. The record is what the run writes into ``config.yaml`` (``plan.speed_timing``), with
every reason.

    python -m benchmarks.training.speed_choice --preset cpu-recipe --set data.num_workers=1 --out /tmp/c.json
    python -m benchmarks.training.speed_choice --preset gpu-s16 --device cpu --batch 16 --set run.precision=bf16
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import REPO, machine, save_json
from benchmarks.training.step_breakdown import for_device
from benchmarks.training.train_throughput import COMMON, PRESETS, split_preset


def speed_choice(config: str | None, overrides: list[str]) -> dict:
    """The timing pass's record and reasons for the run ``config`` + ``overrides`` builds (its length replaced)."""
    from training import distributed as dist
    from training.config import load_config
    from training.run.build import build_run
    from training.run.precision_timing import choose_speed

    items = [o for o in COMMON + overrides if not o.startswith(("run.max_steps=", "optim.budget_minutes="))]
    cfg = load_config(REPO / config if config else None,
                      [*items, "optim.budget_minutes=null", "optim.total_steps=100000"])
    run = build_run(cfg, dist.init_distributed(cfg.run.device))
    choice = choose_speed(run)
    return {**choice.record(), "why": choice.reasons, "global_batch": run.global_batch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-recipe", choices=sorted(PRESETS))
    ap.add_argument("--device", choices=["cuda", "cpu"], help="replace the preset's device (CPU-sized workers)")
    ap.add_argument("--batch", type=int, help="per-process batch (default: the preset's)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    config, overrides = split_preset(PRESETS[a.preset])
    if a.device or a.batch:
        overrides = for_device(overrides, a.device or "cpu", a.batch)
    overrides += a.extra
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    record = {"machine": machine(), "started": started, "preset": a.preset, "overrides": overrides,
              **speed_choice(config, overrides)}
    print(json.dumps(record), flush=True)
    if a.out is not None:
        save_json(a.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
