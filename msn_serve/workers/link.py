"""An HTTP process's link to the engine process: embed calls out, replies and the model catalog in.

Each call takes its slots from the process's ring before its images are written and gives them back only when the
engine's reply arrives, so a client that disconnects meanwhile never frees a slot the engine may still read. When the
link closes (the engine process died), every waiting call is answered 503 and the HTTP process shuts down:
the supervisor, or Kubernetes, restarts the whole server.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from msn_core.bundle import BundleInfo, parse_bundle_info
from msn_serve.embedding.models import ModelLookups
from msn_serve.errors import ApiError
from msn_serve.workers import wire
from msn_serve.workers.ring import CropRing, SlotPool

log = logging.getLogger("msn_serve.workers")


@dataclass(frozen=True)
class CatalogModel:
    name: str
    info: BundleInfo


class Catalog(ModelLookups):
    """The models the engine process serves, as it last said (each one's name and bundle facts, the default first),
    looked up as the engine process's registry looks them up."""

    def __init__(self, document: dict[str, Any]):
        default = document["default"]
        infos = {n: parse_bundle_info(d, where=f"model {n}") for n, d in document["models"].items()}
        order = [default, *(n for n in infos if n != default)]
        self.models: dict[str, CatalogModel] = {n: CatalogModel(n, infos[n]) for n in order}


class EngineLink:
    """The HTTP process's end: :meth:`embed` sends one request's crops and awaits its reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ring: CropRing,
                 on_lost: Callable[[], None]):
        self.reader, self.writer, self.ring, self.on_lost = reader, writer, ring, on_lost
        self.slots = SlotPool(ring.slots)
        self.catalog: Catalog | None = None
        self._has_catalog = asyncio.Event()
        self._pending: dict[int, tuple[asyncio.Future, list[int]]] = {}
        self._ids = itertools.count(1)
        self._records: list[tuple[str, str, int, float]] = []
        self._errors: dict[str, int] = {}
        self._closed_connections = 0
        self._flush_due = False
        self.lost = False

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._has_catalog.wait(), timeout)

    async def run(self) -> None:
        try:
            while True:
                kind, payload = await wire.read_message(self.reader)
                if kind == b"R":
                    reply = wire.parse_reply(payload)
                    future, slots = self._pending.pop(reply.request, (None, []))
                    self.slots.give_back(slots)
                    if future is not None and not future.done():
                        future.set_result(reply)
                elif kind == b"C":
                    self.catalog = Catalog(json.loads(payload))
                    self._has_catalog.set()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            log.error("the engine process closed the link (%s); this HTTP process stops", type(e).__name__)
        finally:
            self.lost = True
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(ApiError(503, "the engine process is gone; retry",
                                                  headers={"Retry-After": "1"}))
            self._pending.clear()
            self.on_lost()

    async def embed(self, model: str | None, prepared_for: str, items: list[tuple[np.ndarray, np.ndarray]],
                    status: int = 422) -> wire.Reply:
        """Write the prepared images (float32 ``(C, H, W)``) and their kept indices into free slots and wait for the
        engine's reply."""
        if self.lost:
            raise ApiError(503, "the engine process is gone; retry", headers={"Retry-After": "1"})
        for pixels, keep in items:
            if pixels.ndim != 3 or not self.ring.fits(4 * pixels.size, len(keep)):
                raise ApiError(500, f"a prepared image of shape {list(pixels.shape)} with {len(keep)} kept patches "
                                    f"does not fit this HTTP process's slots of {self.ring.slot_bytes} bytes")
        slots = self.slots.take(len(items))
        if slots is None:
            raise ApiError(503, f"this HTTP process's {self.ring.slots} image slots are all in use (a full "
                                "inference queue); retry later", headers={"Retry-After": "1"})
        refs = []
        for slot, (pixels, keep) in zip(slots, items, strict=True):
            self.ring.write(slot, np.asarray(pixels, dtype=np.float32), keep)
            c, h, w = pixels.shape
            refs.append(wire.ImageRef(slot, h, w, c, len(keep)))
        request = next(self._ids) & 0xFFFFFFFF
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[request] = (future, slots)
        self.writer.write(wire.embed_message(wire.EmbedCall(request, model, refs, prepared_for, status)))
        return await asyncio.shield(future)  # a cancelled request keeps its slots until the reply frees them

    # ---- what the engine process keeps for this one (metrics, connection counts) --------------------------------
    def record(self, route: str, method: str, status: int, started: float) -> None:
        self._records.append((route, method, status, time.perf_counter() - started))
        self._flush_soon()

    def count_error(self, kind: str) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1
        self._flush_soon()

    def connection_closed(self) -> None:
        self._closed_connections += 1
        self._flush_soon()

    def _flush_soon(self) -> None:
        """Everything recorded in this turn of the event loop goes in one message."""
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self.lost or self.writer.is_closing():
            return
        if self._records or self._errors:
            self.writer.write(wire.json_message(b"M", {"requests": self._records, "errors": self._errors}))
            self._records, self._errors = [], {}
        if self._closed_connections:
            self.writer.write(wire.closed_message(self._closed_connections))
            self._closed_connections = 0
