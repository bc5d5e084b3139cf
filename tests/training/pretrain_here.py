"""``training/pretrain.py``'s ``main`` run in the test's own process: a subprocess costs a fresh interpreter and torch
import (3-5 CPU-seconds) that a test of what one run writes, or of one error line, does not need. Tests of processes
(kill -9, torchrun, bit-identical runs compared across processes) keep their subprocesses."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch


def pretrain_here(argv: Sequence[str], caplog: pytest.LogCaptureFixture) -> str | int | None:
    """Run ``pretrain.py ARGV`` here, as ``OMP_NUM_THREADS=1`` runs it in a subprocess (one torch thread: a tiny model
    spins a second thread against the rest of the suite); its log at INFO goes to ``caplog``. Returns what the
    command exits with: None when it ends normally, else ``sys.exit``'s argument (the one line a user reads)."""
    from training.pretrain import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO):
            main(list(argv))
    except SystemExit as done:
        return done.code
    finally:
        torch.set_num_threads(threads)
    return None
