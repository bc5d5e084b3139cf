"""Decoding uploads across cores: threads in the server process, or worker processes (``--preprocess-workers``).

Pillow releases the GIL while it decodes and resamples, but not around everything else a request costs (the HTTP
parsing, the numpy glue), so on a host with many cores and a GPU engine, threads in one process leave most cores
idle (the H100 run served 476 images/s over HTTP from a 16-core host beside a 4,581 images/s engine: docs/benchmarks.md,
"The GPU run"). Worker processes decode
with no GIL shared with the event loop; the server keeps the checks that must see the whole request (the pixel
budget of its images, :func:`~msn_serve.embedding.preprocess.check_upload`, before anything is decoded), so every
4xx a hostile upload gets is the one it gets with threads. Workers start with ``spawn`` (the server already runs
threads, which ``fork`` does not copy safely) when the pool starts, not on the first request.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np

from msn_core.bundle import Preprocessing
from msn_core.preprocessing import normalise
from msn_serve.embedding.preprocess import PixelBudget, check_upload, preprocess_bytes, resized_bytes
from msn_serve.errors import ApiError

__all__ = ["DecodePool"]


def _decode_in_worker(data: bytes, pre: Preprocessing, max_pixels: int, what: str) -> np.ndarray | tuple[int, str]:
    """One image in a worker process: its resized uint8 crop (a quarter of the float32 bytes to send back; the
    server normalises it with a table lookup), or ``(status, message)`` of its 4xx (``ApiError``'s signature does
    not survive pickling, so the server rebuilds it)."""
    try:
        return np.asarray(resized_bytes(data, pre, max_pixels=max_pixels, what=what))
    except ApiError as e:
        return e.status, e.message


def _ready() -> bool:
    return True


class DecodePool:
    """``workers`` processes (0: ``threads`` threads in this process) that turn uploads into the graph's input."""

    def __init__(self, *, workers: int, threads: int):
        self.workers = workers
        self._executor: Executor
        if workers:
            self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            for _ in range(workers):  # start them now: a spawn costs ~0.1 s of interpreter start-up each
                self._executor.submit(_ready)
        else:
            self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="msn-pre")

    @property
    def kind(self) -> str:
        return "processes" if self.workers else "threads"

    async def run(self, data: bytes, pre: Preprocessing, *, max_pixels: int, what: str,
                  budget: PixelBudget) -> np.ndarray:
        """One upload's array, or its 4xx :class:`ApiError`."""
        loop = asyncio.get_running_loop()
        if not self.workers:
            return await loop.run_in_executor(self._executor, lambda: preprocess_bytes(
                data, pre, max_pixels=max_pixels, what=what, budget=budget))
        check_upload(data, max_pixels=max_pixels, what=what, budget=budget)
        out = await loop.run_in_executor(self._executor, _decode_in_worker, data, pre, max_pixels, what)
        if isinstance(out, tuple):
            raise ApiError(*out)
        return normalise(out, pre.mean, pre.std)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
