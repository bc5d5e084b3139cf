"""The engine process with HTTP worker processes: it owns every piece of state and the listening socket.

:class:`HttpWorkers` starts the HTTP processes, each with its control socket (connections handed over), its link
(embed calls, :mod:`msn_serve.workers.desk`) and its crop ring (made once here and reused by a restarted
process), restarts one that dies with back-off (its calls still queued are dropped and all its slots are free
again), and hands each accepted connection to the live process with the fewest open connections.
:class:`EngineServer` is uvicorn serving the single-process app on a private Unix socket (what the HTTP processes
forward every route but ``/embed`` to) with those steps around it: start the HTTP processes once the app is up,
accept, and on SIGTERM stop accepting, drain the HTTP processes, then stop the app (lifespan: models, stores).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

from msn_core.bundle import BundleInfo
from msn_serve.errors import unprocessable
from msn_serve.http.server import json_response
from msn_serve.runtime import Runtime
from msn_serve.workers.desk import EngineDesk
from msn_serve.workers.http_process import ENV
from msn_serve.workers.ring import CropRing, describe_input, image_bytes, slot_bytes_for

log = logging.getLogger("msn_serve.workers")
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits before restarting a process that died, by deaths in a row
HEALTHY_AFTER_S = 30.0  # a process alive this long resets its back-off
DRAIN_S = 15.0  # how long SIGTERM waits for the HTTP processes to finish their requests
NO_HTTP_PROCESS = json_response("503 Service Unavailable", "no HTTP process is running (restarting); retry",
                                "retry-after: 1\r\n")


@dataclass
class Slot:
    """One HTTP process position: its ring, and the process now filling it."""

    index: int
    ring: CropRing
    proc: subprocess.Popen | None = None
    control: socket.socket | None = None
    desk: EngineDesk | None = None
    desk_task: asyncio.Task | None = None
    started: float = 0.0
    open_connections: int = 0
    connections: int = 0
    restarts: int = 0
    deaths_in_a_row: int = 0
    restarting: bool = False

    @property
    def live(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.control is not None

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "pid": self.proc.pid if self.proc else None, "live": self.live,
                "open_connections": self.open_connections, "connections": self.connections,
                "embed_calls": self.desk.calls_served if self.desk else 0, "restarts": self.restarts,
                "slots": self.ring.slots, "slot_bytes": self.ring.slot_bytes}


class HttpWorkers:
    """``count`` HTTP processes around ``runtime``."""

    def __init__(self, runtime: Runtime, overrides: dict[str, Any], count: int, core_uds: str, slots: int):
        # At least one request's worth: the largest request always fits a ring with nothing in flight.
        slots = max(slots, runtime.settings.max_images_per_request)
        self.runtime, self.overrides, self.core_uds, self.slots = runtime, overrides, core_uds, slots
        infos = [m.info for m in runtime.models.models.values()]
        self.slot_bytes = slot_bytes_for(infos)  # every model served now fits; one added later must fit too
        self.sized_for = max(infos, key=image_bytes)
        self.workers = [Slot(i, CropRing.create(slots, self.slot_bytes, f"msn-crops-{i}")) for i in range(count)]
        log.info("HTTP process rings: %d slots of %d bytes each (%s, model %s), pages touched only where written",
                 slots, self.slot_bytes, describe_input(self.sized_for), self.sized_for.model_id)
        runtime.models.admission.append(self._admit)
        limit = runtime.settings.max_connections
        self.max_connections = -(-limit // count)  # the server-wide limit, shared out (connections are balanced)
        self.stopping = False
        self._watch: asyncio.Task | None = None
        runtime.model_listeners.append(self._send_catalogs)

    def _admit(self, name: str, info: BundleInfo) -> None:
        """Refuse a model added while serving whose images would not fit the slots sized at start-up."""
        if image_bytes(info) > self.slot_bytes:
            raise unprocessable(
                f"model {name!r}: its images ({describe_input(info)}: {image_bytes(info)} bytes) do not fit the "
                f"HTTP processes' shared-memory slots of {self.slot_bytes} bytes, sized at start-up for the largest "
                f"model served then ({describe_input(self.sized_for)}); restart msn-serve with this bundle among "
                "its --bundle models (the slots are sized for the largest), or serve it with --http-workers 0")

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(w) for w in self.workers))
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())
        self.runtime.metrics.http_workers.set(sum(w.live for w in self.workers))

    async def _spawn(self, worker: Slot) -> None:
        control, control_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link, link_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {"index": worker.index, "overrides": self.overrides, "control_fd": control_child.fileno(),
                "link_fd": link_child.fileno(), "ring_fd": worker.ring.fd, "slots": self.slots,
                "slot_bytes": self.slot_bytes,
                "core_uds": self.core_uds, "max_connections": self.max_connections}
        env = {**os.environ, ENV: json.dumps(spec)}
        # Popen returns once the child is forked: nothing here waits on the process.
        worker.proc = subprocess.Popen([sys.executable, "-m", "msn_serve.workers.http_process"], env=env,  # noqa: ASYNC220
                                       pass_fds=(control_child.fileno(), link_child.fileno(), worker.ring.fd))
        control_child.close()
        link_child.close()
        reader, writer = await asyncio.open_connection(sock=link)
        worker.desk = EngineDesk(self.runtime, worker.ring, reader, writer,
                                 on_closed=lambda n, w=worker: self._closed(w, n))
        worker.desk_task = asyncio.get_running_loop().create_task(worker.desk.serve())
        control.settimeout(1.0)
        worker.control, worker.started, worker.open_connections = control, time.monotonic(), 0
        log.info("HTTP process %d started (pid %d)", worker.index, worker.proc.pid)

    def _closed(self, worker: Slot, count: int) -> None:
        worker.open_connections = max(0, worker.open_connections - count)

    def _send_catalogs(self) -> None:
        for w in self.workers:
            if w.desk is not None:
                w.desk.send_catalog()

    async def _watch_loop(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.2)
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None and not w.restarting and not self.stopping:
                    w.restarting = True
                    asyncio.get_running_loop().create_task(self._restart(w))

    async def _restart(self, worker: Slot) -> None:
        """Reclaim a dead process's place (its queued calls dropped, its slots all free) and start another."""
        code = worker.proc.returncode if worker.proc else None
        self._retire(worker)
        alive_for = time.monotonic() - worker.started
        worker.deaths_in_a_row = 1 if alive_for > HEALTHY_AFTER_S else worker.deaths_in_a_row + 1
        wait = BACKOFF_S[min(worker.deaths_in_a_row, len(BACKOFF_S)) - 1]
        log.error("HTTP process %d (exit %s) died after %.1f s; restarting in %.1f s", worker.index, code,
                  alive_for, wait)
        self.runtime.metrics.http_workers.set(sum(w.live for w in self.workers))
        await asyncio.sleep(wait)
        if not self.stopping:
            await self._spawn(worker)
            worker.restarts += 1
            self.runtime.metrics.http_worker_restarts.inc()
            self.runtime.metrics.http_workers.set(sum(w.live for w in self.workers))
        worker.restarting = False

    def _retire(self, worker: Slot) -> None:
        if worker.control is not None:
            worker.control.close()
            worker.control = None
        if worker.desk_task is not None:
            worker.desk_task.cancel()  # cancels the dead process's calls: the batcher skips them

    # ---- connections ---------------------------------------------------------------------------------------------
    def hand_over(self, conn: socket.socket) -> None:
        """Give an accepted connection to the live process with the fewest open connections; with none alive (all
        restarting), answer 503 + ``Retry-After`` and close it."""
        live = sorted((w for w in self.workers if w.live), key=lambda w: (w.open_connections, w.connections))
        for w in live:
            try:
                socket.send_fds(w.control, [b"c"], [conn.fileno()])  # type: ignore[arg-type]
            except OSError:
                continue
            w.open_connections += 1
            w.connections += 1
            break
        else:
            try:
                conn.setblocking(False)
                conn.send(NO_HTTP_PROCESS)
            except OSError:
                pass
        conn.close()

    def describe(self) -> list[dict[str, Any]]:
        return [w.describe() for w in self.workers]

    # ---- signals and shutdown ------------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        for w in self.workers:
            if w.live:
                w.proc.send_signal(sig)  # type: ignore[union-attr]

    async def stop(self) -> None:
        """SIGTERM every HTTP process, wait for them to drain (bounded), then close their links."""
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + DRAIN_S
        for w in self.workers:
            while w.proc is not None and w.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.proc is not None and w.proc.poll() is None:
                log.warning("HTTP process %d did not drain in %.0f s; killing it", w.index, DRAIN_S)
                w.proc.kill()
                w.proc.wait(5)
            self._retire(w)


class EngineServer(uvicorn.Server):
    """The app on its private Unix socket, the HTTP processes, and the public listening socket."""

    def __init__(self, config: uvicorn.Config, workers: HttpWorkers, listener: socket.socket, on_sighup: Any):
        super().__init__(config)
        self.workers, self.listener, self.on_sighup = workers, listener, on_sighup

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        await self.workers.start()
        loop = asyncio.get_running_loop()
        self.listener.setblocking(False)
        loop.add_reader(self.listener.fileno(), self._accept)
        try:
            loop.add_signal_handler(signal.SIGHUP, self._sighup)
        except (ValueError, RuntimeError, NotImplementedError):
            pass
        host, port = self.listener.getsockname()[:2]
        log.info("msn-serve listening on http://%s:%d with %d HTTP processes", host, port, len(self.workers.workers))

    def _sighup(self) -> None:
        self.on_sighup()
        self.workers.signal(signal.SIGHUP)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: log, try again on the next readiness
                log.warning("accept failed: %s", e)
                return
            self.workers.hand_over(conn)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.remove_reader(self.listener.fileno())
        except (ValueError, OSError):
            pass
        self.listener.close()
        await self.workers.stop()
        await super().shutdown(sockets)
