"""MSN pretraining.

    torchrun --nproc_per_node=N training/pretrain.py --config configs/X.yaml --output-dir runs/X [--set k=v ...]
    torchrun --nproc_per_node=N training/pretrain.py --data DIR --output-dir runs/X   # your images (a folder, a list)
    msn-pretrain --config configs/X.yaml --output-dir runs/X            # one process, same thing
    torchrun ... --resume        # continue exactly from runs/X/checkpoint.pt
    torchrun --max-restarts=3 ...   # failed workers restart and continue from this launch's checkpoint.pt
    torchrun ... --init-from PATH   # warm start: official .pth.tar, checkpoint.pt, bundle or HF ViTMSN folder

One process per device (CPU processes use gloo, GPUs NCCL); multi-node through torchrun's rendezvous flags.
Per image and step: an unmasked target view goes through the EMA target encoder; a patch-dropped anchor view and
`num_focal` small focal views go through the online encoder; the anchors' prototype assignments are trained to
match the sharpened, Sinkhorn-balanced assignment of the target (training/model/losses.py). The run lasts
`optim.epochs`, `optim.total_steps` optimiser steps, or `optim.budget_minutes` of wall-clock time, decided
before the loop (training/run/length.py); a budget run resizes it from its measured rate (training/run/budget.py).

`main` reads top to bottom: config (and the plan) -> distributed -> build (and resume) -> decide (speed settings,
run length, the settings that follow it; the config is frozen and ``config.yaml`` written, once:
``training/run/decide.py``) -> loop (changed only by events: ``training/run/events.py``) -> save.
``checkpoint.pt`` is ``training/run/checkpoints.py``'s.
Resuming happens with ``--resume``, or by itself when torchrun restarts the workers of this launch
(docs/training.md#restarts-under-torchrun).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

from msn_core.gpu import CudaUnavailable
from msn_core.sources import MEMORY_SOURCES, SourceError
from training import distributed as dist
from training.bundle.warm_start import init_run
from training.checkpoint import fault_point, launch_id
from training.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    dump_config,
    read_raw_config,
    set_key,
)
from training.run.adapt import OnStall
from training.run.build import Run, build_run
from training.run.checkpoints import Checkpoints
from training.run.collapse import CollapseDetector, RunGeometry
from training.run.decide import Decisions, decide_run
from training.run.events import RunEvents
from training.run.length import RunLength
from training.run.monitor import TrainingMonitor
from training.run.plan import Plan, parse_budget, plan_config, set_length
from training.run.probe import build_probe
from training.run.stall import Adaptation, StallDetector, StallSettings
from training.run.state import Progress, TrainState, batches_from
from training.run.step import StepOutput, train_step
from training.run.view_probe import build_view_probe

log = logging.getLogger("msn.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML config (keys: see training/config.py)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--data", metavar="DIR|LIST", help="your images, without a config if you like: a folder "
                        "(flat, nested or root/<class>/...), a file list (.txt/.csv), or fashion-mnist | synthetic; "
                        "sets data.source=auto and data.root (docs/training.md#your-own-images)")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys: --set optim.budget_minutes=30 data.batch_size=128 "
                             "(repeatable; later ones win)")
    parser.add_argument("--budget", metavar="TIME", type=parse_budget, help="train for this wall-clock time, e.g. "
                        "30m, 2h, 1h30m (optim.budget_minutes); with --data and no --config the run is planned")
    parser.add_argument("--epochs", metavar="N", type=int, help="train for N passes over the data (optim.epochs)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt if it exists")
    parser.add_argument("--eval-data", metavar="DIR|LIST", help="labelled images for the kNN probe during training "
                        "(run.eval_data): a labelled folder or file list, or fashion-mnist; default: the training "
                        "images when they have labels")
    parser.add_argument("--init-from", metavar="PATH", help="warm start (run.init_from): official .pth.tar, "
                        "checkpoint.pt, bundle or HF ViTMSN folder; --resume of an existing checkpoint wins")
    parser.add_argument("--on-stall", choices=("warn", "adapt"), help="run.on_stall: when the run stalls, warn "
                        "(default) or also switch once to the advised views or learning rate (training/run/adapt.py)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    # 1. config: YAML + --set overrides; a bad key is an error message, not a traceback
    args = parse_args(argv)
    try:
        cfg, plan = resolve_config(args)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"pretrain: {err}")
    # 2. distributed: one process per device (torchrun's environment, or a single process)
    try:
        info = dist.init_distributed(cfg.run.device)
    except CudaUnavailable as err:  # run.device=cuda with no usable GPU: one line, not a CPU run
        sys.exit(f"pretrain: {err}")
    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    started_at = time.monotonic()  # a budget counts from here: building, calibration, the loop, checkpoints
    launch = None  # rank 0: this launch's id, new or (torchrun restarted the workers) read back; checkpoints keep it
    try:
        if info.rank == 0:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            launch = launch_id(args.output_dir, restarted=dist.restart_count() > 0)
        # 3. build: data, views, networks, loss, optimiser; then the stored position when resuming
        try:
            run = build_run(cfg, info)
        except SourceError as err:  # the data: no images, a malformed list, a wrong layout
            sys.exit(f"pretrain: {err}")
        state, progress = TrainState(run.online, run.target, run.optimizer), Progress()
        checkpoints = Checkpoints(run, state, args.output_dir, launch)
        resumed = checkpoints.should_resume(asked=args.resume)  # --resume, or torchrun restarting this launch
        if resumed:
            progress = checkpoints.resume()
        init_run(run, cfg.run.init_from, resumed=resumed)  # warm start (training/bundle/warm_start.py)
        probe = build_probe(run) if info.rank == 0 else None  # kNN on labelled images, if any (training/run/probe.py)
        # 4. decide: the speed settings (auto times them on this run's steps, undone; a resumed run keeps its
        # checkpoint's), the run length (stored, or from steps, a timed budget or epochs: the timing's rate sizes a
        # budget, so no step is timed twice), the settings that follow the length; then the config is frozen and
        # written, once (training/run/decide.py). From here on only events change the run (training/run/events.py):
        # a budget's resizes, a stall's switch; every checkpoint stores them
        decisions, events = decide_run(run, plan, checkpoints, resumed=resumed, started_at=started_at)
        cfg, schedule = run.cfg, events.schedule
        state.length = schedule
        length = schedule.length
        if info.rank == 0:
            decisions.announce()
            write_run_config(cfg, args.output_dir, decisions, checkpoints.stored_adaptation)
        # 5. loop: optimiser steps with logs and periodic checkpoints
        stall_settings = StallSettings.from_config(cfg, run.global_batch,
                                                   plan.survey.detail_side if plan is not None else None)
        view_probe = build_view_probe(run, length.total_steps) if info.rank == 0 else None  # run/view_probe.py
        monitor = TrainingMonitor(args.output_dir, enabled=info.rank == 0, total_steps=length.stop_at,
                                  start_step=progress.step, progress_bar=cfg.run.progress_bar,
                                  tensorboard=cfg.run.tensorboard, probe=probe,
                                  detector=CollapseDetector(RunGeometry.from_config(cfg)),
                                  stop_on_collapse=cfg.run.stop_on_collapse,
                                  stall_detector=StallDetector(stall_settings, total_steps=length.total_steps,
                                                               start_step=progress.step),
                                  view_probe=view_probe)
        monitor.write(describe(run, length))
        on_stall = OnStall(events, rewrite_config=lambda adapted: write_run_config(run.cfg, args.output_dir,
                                                                                   decisions, adapted))
        last = train_loop(run, events, progress, monitor, checkpoints, on_stall)
        # 6. save: the last step's checkpoint, unless the loop just wrote it
        if last is not None and checkpoints.saved_step != progress.step:
            checkpoints.save(progress, last)
        minutes = (time.monotonic() - started_at) / 60
        spent = f"; {schedule.summary()}" if schedule.budget is not None else ""
        monitor.write(f"done: step {progress.step} of {schedule.length.total_steps}, epoch {progress.epoch}, "
                      f"{minutes:.1f} min{spent}; checkpoint at {checkpoints.path}")
        monitor.close()
        if monitor.stopped_by is not None:  # run.stop_on_collapse: the checkpoint is kept, the exit status says so
            sys.exit(f"pretrain: stopped at step {progress.step} because training collapsed (run.stop_on_collapse); "
                     f"see the warning above and metrics.jsonl; checkpoint at {checkpoints.path}")
    finally:
        dist.cleanup()


def resolve_config(args: argparse.Namespace) -> tuple[Config, Plan | None]:
    """The run's config: the dataclass defaults, then ``--config``'s YAML, then ``--data``, then ``--set`` (later
    wins). This is the one place the command line becomes a config: whatever is decided from the data and the machine
    before the run is built belongs here, so it is recorded in ``config.yaml`` and ``--set`` still overrides it.
    ``--budget`` / ``--epochs`` replace the config's length; ``--data`` without ``--config`` plans the run from the
    data and the machine (``training/run/plan.py``): that plan is returned beside the config, for the log, the stall
    detector and ``config.yaml`` (None for a run from a recipe)."""
    raw = read_raw_config(args.config, None)
    if args.data is not None:
        named = args.data in MEMORY_SOURCES and not Path(args.data).exists()
        if not named and not Path(args.data).exists():
            raise FileNotFoundError(f"--data {args.data}: no such folder or file list")
        set_key(raw, "data.source", args.data if named else "auto")
        set_key(raw, "data.root", None if named else os.path.abspath(args.data))  # config.yaml: cwd-independent
    if args.eval_data is not None:
        set_key(raw, "run.eval_data", args.eval_data)
    if args.init_from is not None:
        set_key(raw, "run.init_from", os.path.abspath(args.init_from))  # config.yaml: cwd-independent
    if args.on_stall is not None:
        set_key(raw, "run.on_stall", args.on_stall)
    set_length(raw, budget_minutes=args.budget, epochs=args.epochs)
    plan = None  # --data without a recipe: plan one from the data and the machine (training/run/plan.py)
    if args.data is not None and args.config is None:
        plan = plan_config(raw, args.overrides)
        for key, value in plan.values.items():
            set_key(raw, key, value)
    apply_overrides(raw, args.overrides)
    return config_from_dict(raw), plan


def train_loop(run: Run, events: RunEvents, progress: Progress, monitor: TrainingMonitor,
               checkpoints: Checkpoints, on_stall: OnStall | None = None) -> StepOutput | None:
    """Optimiser steps from ``progress`` to the schedule's ``stop_at`` (which a budget run's resize events move), with
    logs and periodic and epoch checkpoints. The loop reads ``run.cfg`` and changes the run only through ``events``.

    Returns the last step's output (None when there was no step left); the caller writes the last checkpoint.
    """
    schedule, last, skipped_files = events.schedule, None, 0
    batches = batches_from(run.loader, run.sampler, progress, run.cfg.data.batch_size)
    schedule.start(progress.step)
    while progress.step < schedule.length.stop_at:
        images, _labels, num_skipped = next(batches)
        skipped_files += num_skipped
        last = train_step(run, schedule.schedules.at(progress.step), images)
        epoch_ended = progress.advance(run.steps_per_epoch)
        fault_point("step", progress.step)  # test hook (MSN_TEST_KILL_AT): a rank killed mid-run
        monitor.step(run.global_batch)
        if events.after_step(progress.step) is not None and monitor.bar is not None:
            monitor.bar.total = schedule.length.stop_at  # the progress bar follows the resized end
        settings = run.cfg.run  # the config of now: a stall's switch replaces it (training/run/events.py)
        if progress.step % settings.log_every_steps == 0 or progress.step == schedule.length.stop_at:
            monitor.log(progress.step, progress.epoch, log_record(last, run, skipped_files),
                        final=progress.step == schedule.length.stop_at)
            if monitor.should_stop():  # run.stop_on_collapse and a collapse confirmed: every rank stops here
                break
            if on_stall is not None:  # --on-stall adapt: once, every rank switches, checkpoints and says so
                on_stall.after_log(progress, last, monitor.stall)
        if progress.step % settings.checkpoint_every_steps == 0 or epoch_ended:
            checkpoints.save(progress, last)
            keep_every = settings.keep_epoch_checkpoints
            if epoch_ended and keep_every and progress.epoch % keep_every == 0:
                checkpoints.keep_epoch_copy(progress.epoch)
    if skipped_files:
        log.warning("%d unreadable image files were skipped", skipped_files)
    return last


def write_run_config(cfg: Config, output_dir: Path, decisions: Decisions, adapted: Adaptation | None = None) -> None:
    """Write the run's ``config.yaml``: the one writer, called by rank 0 once the decision stage has frozen the
    config. Beside the resolved config, a ``plan`` section that loading skips says why (``Decisions.record``). A run
    that switched itself on a stall (``--on-stall adapt``) writes it again then, with the switch as ``adapted``."""
    dump_config(cfg, output_dir / "config.yaml", plan=decisions.record(adapted))


def describe(run: Run, length: RunLength) -> str:
    params = sum(p.numel() for p in run.online.parameters()) / 1e6
    return (f"MSN: {params:.2f}M trainable parameters, {run.num_images} images, {run.steps_per_epoch} steps/epoch, "
            f"{length.describe()}, global batch {run.global_batch}, world size {run.info.world_size}, "
            f"device {run.device}, {run.precision}")


def log_record(out: StepOutput, run: Run, skipped_files: int) -> dict:
    record = {**out.metrics(), "skipped_files": skipped_files, "precision": run.precision}
    if run.device.type == "cuda":
        record["max_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    return record


if __name__ == "__main__":
    main()
