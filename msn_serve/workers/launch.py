"""``--http-workers``: how many HTTP processes, and starting the server with them.

``auto`` decides from the engine and the cores (the affinity mask, capped by a container's CPU limit). One process's
front end serves about 600 single-image requests a second, whatever the cores (docs/serving.md, "Front end"): an engine
slower than half of that leaves the front end idle, and HTTP processes would only take memory and the engine's cores; a
faster one (a GPU, a small model on a CPU) is fed by one HTTP process per core (on a GPU host, one core is left to the
engine process). On a CPU the engine's rate is read from the start-up runtime measurement, or measured here (a few
batches) when the precision was pinned.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI

from msn_core.inference import available_cpus
from msn_serve.http.server import uvicorn_options
from msn_serve.runtime import Runtime

log = logging.getLogger("msn_serve.workers")
ONE_PROCESS_RATE = 600.0  # single-image requests/s one process's front end serves (measured: 476-628)
MAX_AUTO = 16


@dataclass
class FrontEnd:
    """What serves HTTP: ``count`` worker processes (0: the engine process itself), and why."""

    count: int
    requested: str
    reason: str
    engine_images_per_s: float | None = None
    workers: Any = field(default=None, repr=False)  # HttpWorkers once started

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"http_workers": self.count, "requested": self.requested, "reason": self.reason}
        if self.engine_images_per_s is not None:
            out["engine_images_per_s"] = round(self.engine_images_per_s, 1)
        if self.workers is not None:
            out["processes"] = self.workers.describe()
        return out


def cpu_budget() -> int:
    """The CPUs this server may use: its affinity mask, capped by a cgroup CPU quota (a container's CPU limit,
    which the affinity mask does not show: a pod limited to 8 CPUs on a 64-core node sees 64)."""
    cores = available_cpus()
    for path, parse in ((Path("/sys/fs/cgroup/cpu.max"), lambda t: t.split()[:2]),
                        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                         lambda t: [t.strip(), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()])):
        try:
            quota, period = parse(path.read_text())
            if quota not in ("max", "-1"):
                return min(cores, max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError):
            continue
    return cores


def engine_rate(runtime: Runtime, seconds: float = 0.5) -> float:
    """The default model's engine images/s at the largest batch: the runtime choice's measurement, else timed."""
    model = runtime.models.default
    figures = model.choice.candidates.get(f"{model.choice.runtime}/{model.choice.precision}", {})
    if "images_per_s" in figures:
        return float(figures["images_per_s"])
    info, engine = model.info, model.embedding.engine
    batch = min(runtime.settings.max_batch_size, 32)
    pixels = np.zeros((batch, info.in_chans, info.image_size, info.image_size), dtype=np.float32)
    keep = np.tile(np.arange(info.num_patches, dtype=np.int64), (batch, 1))
    engine.run(pixels, keep)  # the first run builds kernels: not timed
    runs, t0 = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - t0 < seconds:
        engine.run(pixels, keep)
        runs += 1
    return runs * batch / (time.perf_counter() - t0)


def choose_http_workers(requested: str, runtime: Runtime, cores: int | None = None) -> FrontEnd:
    """The front end for ``--http-workers requested`` (a number, ``auto`` or ``0``)."""
    if requested != "auto":
        count = int(requested)
        return FrontEnd(count, requested, "one process serves HTTP (--http-workers 0)" if count == 0 else
                        f"--http-workers {count}")
    cores = cores or cpu_budget()
    device = runtime.models.default.embedding.engine.device
    if cores < 2:
        return FrontEnd(0, "auto", f"{cores} core: HTTP processes would share it with the engine")
    if device == "cuda":
        count = min(MAX_AUTO, cores - 1 if cores > 2 else cores)
        return FrontEnd(count, "auto", f"a GPU engine outruns one process's front end (~{ONE_PROCESS_RATE:.0f} "
                                       f"images/s); one HTTP process per core of {cores}, one core left to the engine")
    rate = engine_rate(runtime)
    if rate < ONE_PROCESS_RATE / 2:
        return FrontEnd(0, "auto", f"the engine runs {rate:.0f} images/s, under half of what one process's front end "
                                   f"serves (~{ONE_PROCESS_RATE:.0f}): HTTP processes would only take its cores", rate)
    count = min(MAX_AUTO, cores)
    return FrontEnd(count, "auto", f"the engine runs {rate:.0f} images/s, at least half of what one process's front "
                                   f"end serves (~{ONE_PROCESS_RATE:.0f}): one HTTP process per core of {cores}", rate)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=4096)


def serve_with_workers(app: FastAPI, runtime: Runtime, overrides: dict[str, Any], front_end: FrontEnd) -> int:
    """Run the engine process: the app on a private Unix socket, ``front_end.count`` HTTP processes, the port."""
    from msn_serve.workers.supervisor import EngineServer, HttpWorkers

    settings = runtime.settings
    listener = listen(settings.host, settings.port)  # bound now: the port is taken before anything starts
    private = tempfile.mkdtemp(prefix="msn-serve-")
    uds = os.path.join(private, "engine.sock")
    options = uvicorn_options(settings)
    for key in ("host", "port"):
        options.pop(key)
    options["http"].max_connections = 1 << 30  # the HTTP processes hold the server's connection limit
    workers = HttpWorkers(runtime, overrides, front_end.count, uds, settings.http_worker_slots)
    front_end.workers = workers
    runtime.front_end = front_end.describe
    server = EngineServer(uvicorn.Config(app, uds=uds, **options), workers, listener,
                          on_sighup=lambda: app.state.on_sighup())
    try:
        server.run()
    finally:
        listener.close()
        if os.path.exists(uds):
            os.unlink(uds)
        os.rmdir(private)
    return 0
