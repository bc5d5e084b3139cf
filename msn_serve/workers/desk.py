"""The engine stage: the engine process's end of one HTTP process's link.

An embed call names ring slots; each slot's prepared image (float32 ``(C, H, W)``, normalised) and kept indices go
to the named model's batcher as views into the shared mapping (nothing is copied until the batch is packed), and the
embeddings go back in the reply. The model is looked up and held (:meth:`ServedModel.use`) here, in the process that
owns it, so a model replaced while the image was being prepared is answered by the model served now when it prepares
images alike, and otherwise sends the HTTP process back to prepare them again (:data:`~msn_serve.workers.wire.STALE`).
Request records and closed-connection counts from the HTTP process are applied here.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from msn_serve.errors import ApiError
from msn_serve.runtime import Runtime
from msn_serve.workers import wire
from msn_serve.workers.ring import CropRing

log = logging.getLogger("msn_serve.workers")


def catalog(runtime: Runtime) -> dict[str, Any]:
    """The models an HTTP process prepares crops for: each one's ``msn.json`` and the default's name."""
    models = runtime.models
    return {"default": models.default.name, "models": {n: m.info.to_dict() for n, m in models.models.items()}}


class EngineDesk:
    """Serves one HTTP process: its embed calls against ``ring``, its metrics records and connection counts."""

    def __init__(self, runtime: Runtime, ring: CropRing, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, on_closed: Callable[[int], None]):
        self.runtime, self.ring, self.reader, self.writer = runtime, ring, reader, writer
        self.on_closed = on_closed
        self._calls: set[asyncio.Task] = set()
        self.calls_served = 0

    def send_catalog(self) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.json_message(b"C", catalog(self.runtime)))

    async def serve(self) -> None:
        """Until the HTTP process goes away: then its calls still queued are cancelled (the batcher skips them)."""
        self.send_catalog()
        try:
            while True:
                kind, payload = await wire.read_message(self.reader)
                if kind == b"E":
                    task = asyncio.get_running_loop().create_task(self._embed(wire.parse_embed(payload)))
                    self._calls.add(task)
                    task.add_done_callback(self._calls.discard)
                elif kind == b"M":
                    self._record(json.loads(payload))
                elif kind == b"X":
                    self.on_closed(wire.parse_closed(payload))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:  # gone, or a garbled stream
            if isinstance(e, ValueError):
                log.error("HTTP process link closed on a bad message: %s", e)
        finally:
            for task in list(self._calls):
                task.cancel()
            self.writer.close()

    def _record(self, records: dict[str, Any]) -> None:
        metrics = self.runtime.metrics
        for route, method, status, seconds in records.get("requests", []):
            metrics.record(route, method, int(status), float(seconds))
        for kind, count in records.get("errors", {}).items():
            metrics.errors.labels(kind).inc(count)

    async def _embed(self, call: wire.EmbedCall) -> None:
        try:
            reply = await self._embeddings(call)
        except ApiError as e:
            reply = wire.Reply(call.request, e.status, error={**e.body(), "headers": e.headers or {}})
        except Exception as e:
            log.exception("embed call failed")
            self.runtime.metrics.errors.labels("internal").inc()
            reply = wire.Reply(call.request, 500, error={"error": f"internal server error: {type(e).__name__}"})
        if not self.writer.is_closing():
            self.writer.write(wire.reply_message(reply))
            self.calls_served += 1

    async def _embeddings(self, call: wire.EmbedCall) -> wire.Reply:
        model = self.runtime.models.get(call.model)
        with model.use():
            info = model.info
            if wire.preparation(info) != call.prepared_for:  # replaced meanwhile: the catalog went out before this
                return wire.Reply(call.request, wire.STALE)
            shape = (info.in_chans, info.image_size, info.image_size)
            items = []
            for r in call.images:
                if (r.channels, r.height, r.width) != shape:
                    raise ValueError(f"an image of shape {[r.channels, r.height, r.width]} for a model of {shape}")
                pixels = self.ring.pixels(r.slot, r.channels, r.height, r.width)  # ValueError beyond the slot
                items.append((pixels, self.ring.keep(r.slot, pixels.nbytes, r.kept)))
            emb = await model.embedding.embed_items(items, status=call.status)
        return wire.Reply(call.request, 200, info.model_id, emb)
