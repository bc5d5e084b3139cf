"""One HTTP worker process: ``python -m msn_serve.workers.http_process`` (started by the engine process only).

It runs uvicorn with the server's own protocol (header timeout, header cap, connection limit:
:mod:`msn_serve.http.server`) on connections the engine process accepted and handed over (``SCM_RIGHTS`` on a
control socket, to the process with the fewest open connections: neither ``SO_REUSEPORT`` hashing nor a shared
accept queue spreads keep-alive connections evenly). The embedding routes (``POST /embed``, ``/v1/embeddings`` and
OIP infer) run their preparation and response stages here (:mod:`msn_serve.workers.prepare`); every other request
goes to the engine process's app (:mod:`msn_serve.workers.proxy`). SIGTERM drains like uvicorn (in-flight requests
finish, idle connections close); SIGHUP re-reads the keys file. When the engine process goes away, so does this
process.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from msn_serve.config import Settings
from msn_serve.http.auth import KeyRing
from msn_serve.http.guard import GuardMiddleware
from msn_serve.http.openai_api import OpenAIErrorShape
from msn_serve.http.server import uvicorn_options
from msn_serve.workers.link import EngineLink
from msn_serve.workers.prepare import EmbedStages
from msn_serve.workers.proxy import CoreProxy
from msn_serve.workers.ring import CropRing

log = logging.getLogger("msn_serve.workers")
ENV = "MSN_HTTP_WORKER"  # the engine process's instructions to this process (JSON)


class WorkerApp:
    """The embedding routes through their stages here; everything else to the engine process. As in the single
    process, the guard (auth, the body cap) runs first, inside OpenAI's error shape for ``/v1`` paths."""

    def __init__(self, settings: Settings, link: EngineLink, uds: str):
        self.link = link
        self.keys = KeyRing(settings.resolved_api_key(), settings.api_keys_file)
        self.stages = EmbedStages(settings, link)
        self.guarded = OpenAIErrorShape(GuardMiddleware(self._embed, keys=self.keys, max_body=settings.max_body_bytes))
        self.proxy = CoreProxy(uds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        matched = self.stages.match(scope["method"], scope["path"])
        if matched is None:
            await self.proxy(scope, receive, send)
            return
        template, scope["msn.route"], scope["msn.params"] = matched
        started, status = time.perf_counter(), 500

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.guarded(scope, receive, tracking_send)
        finally:
            self.link.record(template, "POST", status, started)

    async def _embed(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.stages(scope["msn.route"], Request(scope, receive), scope["msn.params"])
        await response(scope, receive, send)


class HandedOverServer(uvicorn.Server):
    """uvicorn serving the connections that arrive on ``control`` (no listening socket of its own)."""

    def __init__(self, config: uvicorn.Config, app: WorkerApp, control: socket.socket, link_task: asyncio.Task):
        super().__init__(config)
        self.app, self.control, self.link, self.link_task = app, control, app.link, link_task

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])
        loop = asyncio.get_running_loop()
        base = self.config.http_protocol_class
        link = self.link

        class Protocol(base):  # type: ignore[valid-type, misc]
            def connection_lost(self, exc: Exception | None) -> None:
                super().connection_lost(exc)
                link.connection_closed()

        def protocol() -> asyncio.Protocol:
            return Protocol(config=self.config, server_state=self.server_state, app_state=self.lifespan.state,
                            _loop=loop)

        self._protocol = protocol
        self.control.setblocking(False)
        loop.add_reader(self.control.fileno(), self._receive)
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self.app.keys.reload(force=True))
        except (ValueError, RuntimeError, NotImplementedError):
            pass

    def _receive(self) -> None:
        """Connections handed over by the engine process; its end closing means it is gone: stop."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.control, 1024, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:
                loop.remove_reader(self.control.fileno())
                self.should_exit = True
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                loop.create_task(loop.connect_accepted_socket(self._protocol, sock))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.remove_reader(self.control.fileno())
        except (ValueError, OSError):
            pass
        await super().shutdown(sockets)
        self.link_task.cancel()


def main() -> int:
    spec = json.loads(os.environ[ENV])
    settings = Settings(**spec["overrides"])
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[http {spec['index']}]: %(message)s")
    control = socket.socket(fileno=spec["control_fd"])
    link_sock = socket.socket(fileno=spec["link_fd"])
    ring = CropRing(spec["ring_fd"], spec["slots"], spec["slot_bytes"])
    options = uvicorn_options(settings)
    options["http"].max_connections = spec["max_connections"]
    for key in ("host", "port"):
        options.pop(key)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server: HandedOverServer | None = None

        def lost() -> None:
            if server is not None:
                server.should_exit = True

        reader, writer = await asyncio.open_connection(sock=link_sock)
        link = EngineLink(reader, writer, ring, on_lost=lost)
        link_task = loop.create_task(link.run())
        await link.ready(timeout=60)
        app = WorkerApp(settings, link, spec["core_uds"])
        config = uvicorn.Config(app, lifespan="off", **options)
        server = HandedOverServer(config, app, control, link_task)
        await server.serve(sockets=[])
        app.stages.close()
        await app.proxy.aclose()

    with asyncio.Runner(loop_factory=uvicorn.Config(WorkerApp, loop=options["loop"]).get_loop_factory()) as runner:
        runner.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
