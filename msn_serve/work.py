"""The thread pool for CPU work that must stay off the event loop (FAISS calls, stores, label loop, bodies).

Two threads: enough to overlap a search with a store write, few enough to leave the cores to ONNX Runtime. Every
service shares the one pool, so the service as a whole never runs more than that much of this work at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class WorkPool:
    """``await pool.run(fn, *args)`` runs ``fn`` in a worker thread and gives back its result (or exception)."""

    def __init__(self, workers: int = 2, prefix: str = "msn-work"):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self, *, wait: bool) -> None:
        self._pool.shutdown(wait=wait)
