"""Asyncio dynamic batcher in front of the inference engine.

Requests enqueue *preprocessed* images (decoding errors never reach this point, so a bad upload can only fail its
own request), in one form whatever the route and the process that prepared them: the graph's own input row, float32
``(C,H,W)`` normalised (:mod:`msn_serve.http.embedder`: decoded here, or by an HTTP worker process and read from
shared memory, :mod:`msn_serve.workers`; or sent so by an OIP client).

The engine never waits on Python: a single worker coroutine runs a batch at once when the engine is idle (after
``max_wait_ms``, 0 by default), and while the engine runs one batch the next one fills up (to ``max_batch_size``)
and is packed in a thread of its own, ready the moment the engine is free. Batches run in a one-thread executor so
the event loop keeps accepting requests.

Mixed kept-patch counts: images with different K share a batch, their ``keep_idx`` rows padded to the largest K
with ``-1`` (the bundle contract, :mod:`msn_core.bundle`; the padded keys get a -1e4 attention bias, which
underflows to an exact 0 weight, so results are bit-identical to unpadded runs; a test checks this). Items are
sorted by K and a new group starts when K drops below half the group's maximum, which bounds padding waste to < 2x.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from msn_core.masks import PAD, pad_keep
from msn_serve.embedding.engine import InferenceEngine
from msn_serve.errors import ApiError
from msn_serve.metrics import Metrics

log = logging.getLogger("msn_serve.embedding.batcher")


class QueueFull(ApiError):
    def __init__(self, retry_after: float):
        super().__init__(503, "inference queue is full; retry later",
                         headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


class InferenceFailed(ApiError):
    def __init__(self, message: str):
        super().__init__(500, f"inference failed: {message}")


INLINE_PACK_BYTES = 1 << 20  # smaller batches are packed on the event loop (a thread hop would cost more)


@dataclass
class _Item:
    pixels: np.ndarray  # float32 (C,H,W) normalised: the graph's input row
    keep: np.ndarray
    future: asyncio.Future
    enqueued: float


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to (and including) ``max_batch_size``: the batch shapes warmed up / padded to."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


def token_buckets(num_patches: int) -> list[int]:
    """Kept-token shapes warmed up (and, on CUDA, padded to): a quarter, half, three quarters, all."""
    return sorted({max(1, math.ceil(num_patches * f)) for f in (0.25, 0.5, 0.75, 1.0)})


class Batcher:
    def __init__(self, engine: InferenceEngine, metrics: Metrics, *, max_batch_size: int, max_wait_ms: float,
                 queue_size: int, pad_shapes: bool | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.queue_size = queue_size
        # Shape-specialised backends (CUDA kernels, cuDNN/TRT plans) want a fixed set of shapes.
        self.pad_shapes = engine.device == "cuda" if pad_shapes is None else pad_shapes
        self.b_buckets = batch_buckets(max_batch_size)
        self.k_buckets = token_buckets(engine.info.num_patches)
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msn-infer")
        self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msn-pack")
        self._task: asyncio.Task | None = None
        self._running: asyncio.Task | None = None  # the batch the engine runs now
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.batches_run = 0
        self._avg_batch_s = 0.05

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="msn-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._running is not None and not self._running.done():
            self._running.cancel()
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(ApiError(503, "server is shutting down"))
        self._queue.clear()
        self._executor.shutdown(wait=True)
        self._packer.shutdown(wait=True)

    @property
    def queue_depth(self) -> int:
        """Images waiting for a batch."""
        return len(self._queue)

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done() and self.consecutive_failures == 0

    def warmup(self) -> int:
        """Run every (batch, kept-token) bucket once; blocking, call before declaring readiness."""
        c, s = self.engine.info.in_chans, self.engine.info.image_size
        n = 0
        for b in self.b_buckets:
            for k in self.k_buckets:
                pixels = np.zeros((b, c, s, s), dtype=np.float32)
                self.engine.run(pixels, np.tile(np.arange(k, dtype=np.int64), (b, 1)))
                n += 1
        return n

    # ---- request side ----------------------------------------------------------------------------------------
    def submit(self, items: list[tuple[np.ndarray, np.ndarray]]) -> list[asyncio.Future]:
        """Enqueue all images of one request, or none of them (503 when the queue cannot take them all)."""
        if len(items) > self.queue_size:
            raise ApiError(413, f"{len(items)} images exceed the inference queue size {self.queue_size}; "
                                "send fewer per request")
        if len(self._queue) + len(items) > self.queue_size:
            self.metrics.errors.labels("queue_full").inc()
            backlog = (len(self._queue) / self.max_batch_size + 1) * self._avg_batch_s
            raise QueueFull(backlog)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        futures = []
        for pixels, keep in items:
            fut = loop.create_future()
            self._queue.append(_Item(pixels, keep, fut, now))
            futures.append(fut)
        self.metrics.queue_depth.set(len(self._queue))
        self._wake.set()
        return futures

    async def embed(self, items: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Embed images (pixels (C,H,W), keep_idx (K,)) through the shared batches; returns (n, D)."""
        if not items:
            return np.zeros((0, self.engine.info.embed_dim), dtype=np.float32)
        futures = self.submit(items)
        try:
            rows = await asyncio.gather(*futures)
        except BaseException:
            for f in futures:
                f.cancel()  # a disconnected client's images are skipped, not computed
            raise
        return np.stack(rows).astype(np.float32, copy=False)

    # ---- worker side ----------------------------------------------------------------------------------------
    @property
    def engine_busy(self) -> bool:
        return self._running is not None and not self._running.done()

    async def _wait(self, timeout: float | None = None) -> bool:
        """Until something changes (an image arrives, the engine frees up) or ``timeout``; False on the timeout."""
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _batch_ready(self) -> None:
        """Return when a batch should be taken: at once for an idle engine (after ``max_wait``, 0 by default);
        while the engine is busy, once a full batch waits (packed while the engine finishes) or the engine is free."""
        while not self._queue:
            await self._wait()
        if self.engine_busy:
            while self.engine_busy and len(self._queue) < self.max_batch_size:
                await self._wait()
            return
        deadline = self._queue[0].enqueued + self.max_wait
        while len(self._queue) < self.max_batch_size and not self.engine_busy:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not await self._wait(remaining):
                return

    async def _loop(self) -> None:
        while True:
            try:
                await self._batch_ready()
                batch: list[_Item] = []
                while self._queue and len(batch) < self.max_batch_size:
                    item = self._queue.popleft()
                    if not item.future.done():
                        batch.append(item)
                self.metrics.queue_depth.set(len(self._queue))
                for group in self._group(batch):
                    await self._launch(group)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batcher loop error")
                self.metrics.errors.labels("batcher").inc()

    def _group(self, batch: list[_Item]) -> list[list[_Item]]:
        groups: list[list[_Item]] = []
        for it in sorted(batch, key=lambda i: -len(i.keep)):
            if groups and 2 * len(it.keep) >= len(groups[-1][0].keep):
                groups[-1].append(it)
            else:
                groups.append([it])
        return groups

    def _pack(self, group: list[_Item]) -> tuple[np.ndarray, np.ndarray]:
        b = len(group)
        k = max(len(it.keep) for it in group)
        if self.pad_shapes:
            k = next((kb for kb in self.k_buckets if kb >= k), k)
            b = next((bb for bb in self.b_buckets if bb >= b), b)
        pixels = np.zeros((b, *group[0].pixels.shape), dtype=np.float32)
        for i, it in enumerate(group):
            pixels[i] = it.pixels
        # Shape-padding rows keep patch 0 alone: a row with every key masked would give an all-masked softmax.
        one_patch = np.zeros(1, dtype=np.int64)
        return pixels, pad_keep([it.keep for it in group] + [one_patch] * (b - len(group)), width=k)

    async def _launch(self, group: list[_Item]) -> None:
        """Pack ``group`` (in the packing thread when it is large: the engine may be running meanwhile), wait for
        the engine to be free, and start it on the batch; returns without waiting for the result."""
        now = time.perf_counter()
        for it in group:
            self.metrics.queue_wait.observe(now - it.enqueued)
            self.metrics.kept_tokens.observe(len(it.keep))
        if sum(it.pixels.nbytes for it in group) > INLINE_PACK_BYTES:
            pixels, keep = await asyncio.get_running_loop().run_in_executor(self._packer, self._pack, group)
        else:
            pixels, keep = self._pack(group)
        self.metrics.batch_size.observe(len(group))
        self.metrics.padded_tokens.inc(int((keep[: len(group)] == PAD).sum()))
        while self.engine_busy:
            await self._wait()
        self._running = asyncio.get_running_loop().create_task(self._execute(group, pixels, keep))
        self._running.add_done_callback(lambda _: self._wake.set())

    async def _execute(self, group: list[_Item], pixels: np.ndarray, keep: np.ndarray) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, self.engine.run, pixels, keep)
        except asyncio.CancelledError:
            for it in group:
                if not it.future.done():
                    it.future.set_exception(ApiError(503, "server is shutting down"))
            raise
        except Exception as e:  # noqa: BLE001
            self.metrics.errors.labels("inference").inc()
            log.warning("batch of %d failed (%s); retrying items one by one", len(group), e)
            if len(group) > 1:
                for it in group:
                    await self._execute([it], *self._pack([it]))
                return
            self.consecutive_failures += 1
            self.last_error = str(e)
            if not group[0].future.done():
                group[0].future.set_exception(InferenceFailed(str(e)))
            return
        dt = time.perf_counter() - t0
        self.metrics.inference.observe(dt)
        self._avg_batch_s = 0.9 * self._avg_batch_s + 0.1 * dt
        self.consecutive_failures = 0
        self.batches_run += 1
        for i, it in enumerate(group):
            if not it.future.done():
                it.future.set_result(out[i])
