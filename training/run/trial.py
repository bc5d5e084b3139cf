"""Trial steps: real optimiser steps of this run, timed before its loop and then undone, as if never taken.

Two decisions time the run's own steps before it trains: the speed settings (``training/run/precision_timing.py``)
and a budget's step count (``training/run/budget.py``). Both run real steps (this run's networks, batch, views and
loader: a cached batch timed ~20 % faster than the loop then ran on the demo, because fetching and collating are
part of a step) and both must leave nothing behind, so that a run that timed ends with the same weights as one
that did not. This module is the one home of that: :func:`loader_step` is the step, :func:`wall_seconds` its clock,
:func:`undone` puts back the weights and buffers (BatchNorm statistics too), AdamW's state and the RNG streams.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from training import distributed as dist
from training.checkpoint import capture_rng_state, restore_rng_state
from training.run.build import Run
from training.run.step import start_hyperparameters, train_step

__all__ = ["loader_step", "undone", "wall_seconds"]


@contextmanager
def undone(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
           mask_generator: torch.Generator | None = None) -> Iterator[None]:
    """Whatever steps run inside leave ``modules``, ``optimizer`` (no state, no gradient left) and every RNG stream
    (torch's, and ``mask_generator``'s) as they were, also when a step raises."""
    saved_modules = [copy.deepcopy(module.state_dict()) for module in modules]
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_rng = capture_rng_state(mask_generator)
    try:
        yield
    finally:
        for module, state in zip(modules, saved_modules, strict=True):
            module.load_state_dict(state)
        optimizer.load_state_dict(saved_optimizer)
        optimizer.zero_grad(set_to_none=True)
        restore_rng_state(saved_rng, mask_generator)


def wall_seconds(step: Callable[[], None]) -> float:
    """``step``'s wall-clock seconds, queued device work (and the other ranks) included."""
    dist.synchronize()
    start = time.perf_counter()
    step()
    dist.synchronize()
    return time.perf_counter() - start


def loader_step(run: Run) -> Callable[[], None]:
    """One real optimiser step of ``run`` per call, on the loader's next batch (round and round: a small dataset may
    hold fewer batches than a timing takes), at the schedules' starting values; the step's metrics are read as the
    loop reads them when it logs, the same host sync."""
    batches = _cycle(run.loader)
    hyper = start_hyperparameters(run.cfg)

    def step() -> None:
        train_step(run, hyper, next(batches)[0]).metrics()

    return step


def _cycle(loader: Iterator) -> Iterator:
    while True:
        yield from loader
