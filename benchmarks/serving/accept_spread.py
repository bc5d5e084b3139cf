"""How keep-alive connections spread over HTTP processes: SO_REUSEPORT, a shared accept queue, and hand-over.

Each trial starts ``--processes`` minimal asyncio servers (uvloop when installed, as msn-serve's) that count the
connections they get, opens ``--connections`` keep-alive connections at once as a load test's clients do, and
reads the counts back. Three ways to share one port:

- ``reuseport``: each process binds its own ``SO_REUSEPORT`` socket; the kernel hashes each connection to one;
- ``shared``: one listening socket made before the processes fork, every process accepting from it (gunicorn's and
  uvicorn's ``--workers``);
- ``handover``: one process accepts and passes each connection (``SCM_RIGHTS``) to the process with the fewest,
  as ``msn-serve --http-workers`` does (:mod:`msn_serve.workers.supervisor`).

    python -m benchmarks.serving.accept_spread            # writes benchmarks/results/accept_spread.json
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, machine, save_json

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class Counting(asyncio.Protocol):
    count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Counting.count += 1
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(RESPONSE)  # type: ignore[attr-defined]


def serve(kind: str, listener: socket.socket | None, port: int, control: socket.socket | None,
          results: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    loop = _loop()
    asyncio.set_event_loop(loop)
    if kind == "reuseport":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1024)
    if listener is not None:
        loop.run_until_complete(loop.create_server(Counting, sock=listener))
    if control is not None:
        control.setblocking(False)

        def receive() -> None:
            try:
                _, fds, _, _ = socket.recv_fds(control, 64, 64)
            except BlockingIOError:
                return
            for fd in fds:
                loop.create_task(loop.connect_accepted_socket(Counting, socket.socket(fileno=fd)))

        loop.add_reader(control.fileno(), receive)

    async def until_stopped() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.02)

    loop.run_until_complete(until_stopped())
    results.put((os.getpid(), Counting.count))


def trial(kind: str, processes: int, connections: int) -> list[int]:
    ctx = mp.get_context("fork")
    results, stop = ctx.Queue(), ctx.Event()
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    shared = None
    if kind in ("shared", "handover"):
        shared = socket.create_server(("127.0.0.1", port), backlog=1024)
    pairs = [socket.socketpair() for _ in range(processes)] if kind == "handover" else []
    procs = [ctx.Process(target=serve, args=(kind, shared if kind == "shared" else None, port,
                                              pairs[i][1] if pairs else None, results, stop))
             for i in range(processes)]
    for p in procs:
        p.start()
    time.sleep(0.3)
    clients, given = [], [0] * processes
    for _ in range(connections):
        c = socket.create_connection(("127.0.0.1", port))
        if kind == "handover":
            conn, _ = shared.accept()  # type: ignore[union-attr]
            i = int(np.argmin(given))
            socket.send_fds(pairs[i][0], [b"c"], [conn.fileno()])
            given[i] += 1
            conn.close()
        c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        clients.append(c)
    for c in clients:
        c.recv(64)
    stop.set()
    counts = sorted(results.get(timeout=10)[1] for _ in procs)
    for p in procs:
        p.join(5)
    for c in clients:
        c.close()
    if shared is not None:
        shared.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "accept_spread.json")
    a = ap.parse_args()
    out: dict = {"benchmark": "accept_spread", "processes": a.processes, "connections": a.connections,
                 "trials": a.trials, "machine": machine(), "kinds": {}}
    for kind in ("reuseport", "shared", "handover"):
        counts = [trial(kind, a.processes, a.connections) for _ in range(a.trials)]
        busiest = [max(c) / a.connections for c in counts]
        out["kinds"][kind] = {"counts": counts, "busiest_share_mean": round(float(np.mean(busiest)), 3),
                              "busiest_share_max": round(float(np.max(busiest)), 3)}
        print(f"{kind}: the busiest of {a.processes} processes took {np.mean(busiest):.0%} of the connections on "
              f"average, {np.max(busiest):.0%} at worst (even: {1 / a.processes:.0%})", flush=True)
    save_json(a.out, out)


if __name__ == "__main__":
    main()
