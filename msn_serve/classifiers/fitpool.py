"""Few-shot fits in worker processes: cyanure holds the GIL for a whole fit, so a fit in the serving process froze
every endpoint (``/healthz`` included) for as long as it ran.

A :class:`FitPool` keeps up to ``workers`` spawned processes (numpy + :mod:`msn_core.lowshot` + cyanure, no ONNX
Runtime, no FAISS, no locks of the parent), runs at most that many fits at once, lets ``max_queued`` more wait and
answers 503 + ``Retry-After`` beyond; a fit that runs past ``timeout_s`` is stopped by killing its worker (a new one
is spawned for the next fit). Requests and results cross the pipe as a JSON header plus raw little-endian array
bytes, never as pickles. Workers run at a lower CPU priority than the server (``nice``), and exit when the server
dies (their pipe closes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from msn_core.lowshot import LinearClassifier
from msn_core.optional import MissingDependency, optional
from msn_serve.errors import ApiError, busy, unprocessable

log = logging.getLogger("msn_serve.classifiers.fitpool")
NICE = 5  # fits are background work next to request handling


def _frame(head: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(head).encode()
    return struct.pack("<I", len(raw)) + raw + body


def _unframe(data: bytes) -> tuple[dict[str, Any], memoryview]:
    (n,) = struct.unpack_from("<I", data)
    return json.loads(data[4: 4 + n]), memoryview(data)[4 + n:]


def _worker_main(conn: Any, threads: int) -> None:
    """Worker process: fit what arrives on ``conn`` until it closes."""
    from msn_core.lowshot import fit_logistic

    try:
        os.nice(NICE)
    except OSError:  # pragma: no cover - not allowed here; run at normal priority
        pass
    optional("cyanure.estimators")  # ~1 s to import: paid at start-up, not by the first fit (which reports a lack)
    try:
        conn.send_bytes(_frame({"ready": True}))  # start-up does not count against a fit's timeout
    except OSError:
        return
    while True:
        try:
            head, body = _unframe(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            x = np.frombuffer(body, dtype="<f4").reshape(head["shape"])
            model = fit_logistic(x, np.asarray(head["labels"], dtype=str), lambd=head["lambd"],
                                 max_iter=head["max_iter"], tol=head["tol"], n_threads=threads)
            coef = np.ascontiguousarray(model.coef, dtype="<f8")
            reply = _frame({"classes": [str(c) for c in model.classes], "shape": list(coef.shape),
                            "seconds": model.fit_seconds}, coef.tobytes())
        except (ValueError, MissingDependency) as e:  # no cyanure here: the error says which install has it
            reply = _frame({"error": str(e)})
        try:
            conn.send_bytes(reply)
        except OSError:
            return


class _Worker:
    START_S = 120.0  # a worker that is not ready by then is broken (imports hang, no memory, ...)

    def __init__(self, ctx: Any, threads: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, threads), name="msn-fit", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def call(self, frame: bytes, timeout: float) -> bytes | None:
        """The reply, or ``None`` after ``timeout`` seconds; raises ``EOFError``/``OSError`` if the worker died."""
        if not self.ready:
            if not self.conn.poll(self.START_S):
                raise OSError(f"fit worker not ready after {self.START_S:.0f} s")
            self.conn.recv_bytes()
            self.ready = True
        self.conn.send_bytes(frame)
        if not self.conn.poll(timeout):
            return None
        return self.conn.recv_bytes()

    def stop(self, kill: bool = False) -> None:
        if kill and self.proc.is_alive():
            self.proc.kill()
        self.conn.close()  # a waiting worker sees EOF and exits
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class FitPool:
    def __init__(self, *, workers: int, max_queued: int, timeout_s: float, threads: int,
                 on_change: Callable[[int], None] | None = None):
        """``on_change(n)`` is called whenever the number of fits running or waiting changes (a metrics gauge)."""
        self.workers, self.max_queued, self.timeout_s, self.threads = workers, max_queued, timeout_s, threads
        self._on_change = on_change or (lambda n: None)
        self._ctx = multiprocessing.get_context("spawn")  # fork would copy ORT/FAISS threads and the data lock
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="msn-fit")
        self._slots: asyncio.Semaphore | None = None
        self._waiting = 0
        self._running = 0
        self._avg_s = 2.0
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._waiting + self._running

    async def fit(self, x: np.ndarray, labels: list[str], *, lambd: float, max_iter: int = 300,
                  tol: float = 1e-3) -> LinearClassifier:
        """The low-shot fit of :func:`msn_core.lowshot.fit_logistic`, run in a worker process."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        if self.in_flight >= self.workers + self.max_queued:
            raise busy(f"{self.in_flight} few-shot fits are running or waiting (fit_workers={self.workers}, "
                       f"max_queued_fits={self.max_queued}); retry later",
                       self._avg_s * (1 + self._waiting / self.workers))
        x = np.ascontiguousarray(x, dtype="<f4")
        frame = _frame({"shape": list(x.shape), "labels": labels, "lambd": lambd, "max_iter": max_iter, "tol": tol},
                       x.tobytes())
        self._waiting += 1
        self._on_change(self.in_flight)
        try:
            await self._slots.acquire()
        except BaseException:
            self._waiting -= 1
            self._on_change(self.in_flight)
            raise
        self._waiting -= 1
        self._running += 1
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, frame)
        finally:
            self._running -= 1
            self._slots.release()
            self._on_change(self.in_flight)
        head, body = _unframe(reply)
        if "error" in head:
            raise unprocessable(head["error"])
        self._avg_s = 0.8 * self._avg_s + 0.2 * float(head["seconds"])
        coef = np.frombuffer(body, dtype="<f8").reshape(head["shape"]).copy()
        return LinearClassifier(coef, np.asarray(head["classes"]), float(head["seconds"]))

    def _run(self, frame: bytes) -> bytes:
        with self._lock:
            if self._closed:
                raise ApiError(503, "server is shutting down")
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker(self._ctx, self.threads)
        try:
            reply = worker.call(frame, self.timeout_s)
        except (EOFError, OSError) as e:
            worker.stop(kill=True)
            log.error("few-shot fit worker died (exit code %s): %s", worker.proc.exitcode, e)
            raise ApiError(500, f"the few-shot fit worker died (exit code {worker.proc.exitcode})") from None
        if reply is None:
            worker.stop(kill=True)
            log.warning("few-shot fit stopped after %.0f s (fit_timeout_s)", self.timeout_s)
            raise unprocessable(f"the fit did not finish within {self.timeout_s:g} s (fit_timeout_s): send fewer "
                                "examples or classes, or a larger lambd")
        with self._lock:
            if self._closed:
                worker.stop()
            else:
                self._idle.append(worker)
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
