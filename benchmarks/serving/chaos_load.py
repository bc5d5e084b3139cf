"""The chaos soak's clients and its check of acknowledged writes (``serve_chaos.py`` runs the servers and faults).

Clients: asyncio + httpx in spawned processes, each client one request at a time over a mixed workload (embed,
masked embed, index add, search, few-shot fit and predict, the label loop's select / suggest / predict_index),
reads split between the writer and a read-only replica. A client that cannot connect (the writer is down) or gets
a 503/507 backs off and goes on, as a real client with a retry policy would. Every request is recorded as
``(sent, answered, target, kind, status or error name,
detail of a failure)`` in wall-clock seconds, so the controller can tell which
answers fell inside a fault window.

The written index holds a bounded working set: once a client has :data:`KEEP_LIVE` acknowledged adds, its next
write deletes the oldest of them instead, so the index (and the writer's memory) stops growing after a minute or
two and RSS growth measures leaks, not data (``serve_chaos.py --keep-live 0``: adds only, the index grows).

Acknowledged writes go to an append-only log per client process, one line per event: ``add <id>`` after the 2xx
(ids are unique per soak), ``untry <id>`` before a delete is sent and ``del <id>`` once it is acknowledged,
``try <name> <seq>`` before a fit is sent and ``fit <name> <seq>`` once it is acknowledged (each client overwrites
its own classifier, whose class names carry ``seq``). :func:`check_acked` reads the logs and asks a server for
every acked write: an acked add never sent for deletion must be found, an acked delete must stay deleted.
:class:`Prober` polls ``/healthz`` of both servers, the replica's served version and the filesystem's use.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import TextIO

import numpy as np

INDEX, POOL, BASE = "chaos", "pool", "base"  # the written index; a fixed index and classifier for the label loop
POOL_SIZE = 500
ID_STRIDE = 10**9  # client c of process p writes ids (p * 1000 + c) * ID_STRIDE + n: unique across the soak
BACKOFF_S, BACKOFF_MAX_S = 0.25, 2.0
KEEPALIVE_S = 2.0  # the clients' idle-connection expiry, below msn-serve's timeout_keep_alive_s
CLIENT_NICE = 10  # niceness of the client processes (see client_process)
KEEP_LIVE = 10  # acked adds a client keeps in the written index; beyond that its writes delete the oldest (0: never)
# (kind, share of requests); reads marked "either" go to the read replica half of the time
# Adds are few and small: every published version (kept 300 s after its successor) holds the whole written index,
# and all versions live on the soak's small filesystem, which must fill only when the soak fills it.
MIX = (("embed", 0.35), ("embed_masked", 0.12), ("add", 0.08), ("search", 0.17), ("fit", 0.03),
       ("predict", 0.10), ("select", 0.05), ("suggest", 0.05), ("predict_index", 0.05))
EITHER = {"search", "predict", "select", "suggest", "predict_index"}


def vectors_for(ids: list[int], dim: int) -> np.ndarray:
    """The vector stored under each id: derived from the id, so the checker needs only the ids."""
    return np.stack([np.random.default_rng(i).standard_normal(dim).astype(np.float32) for i in ids])


def fit_body(name: str, seq: int, dim: int) -> dict:
    rng = np.random.default_rng(seq)
    return {"name": name, "labels": [f"s{seq}{c}" for c in "abc"] * 4, "overwrite": True,
            "embeddings": rng.standard_normal((12, dim)).astype(np.float32).tolist()}


def prepare(url: str, dim: int) -> None:
    """The state the soak starts from: the written index (l2, so a stored vector is its own nearest neighbour at
    distance 0), a fixed pool index and a classifier for the label loop; published for the replica."""
    import httpx

    with httpx.Client(base_url=url, timeout=120) as c:
        c.post(f"/index/{INDEX}", json={"type": "flat", "metric": "l2"}).raise_for_status()
        ids = list(range(POOL_SIZE))
        c.post(f"/index/{POOL}/add", json={"ids": ids, "vectors": vectors_for(ids, dim).tolist()}).raise_for_status()
        body = fit_body(BASE, 0, dim)
        c.post("/fewshot/fit", json={**body, "embeddings": vectors_for(ids[:12], dim).tolist()}).raise_for_status()
        c.post("/admin/snapshot").raise_for_status()


async def _clients(writer: str, reader: str | None, images: list[bytes], dim: int, clients: int, proc: int,
                   start_at: float, stop_at: float, log: TextIO, seed: int, keep_live: int) -> list[tuple]:
    import httpx

    rng = np.random.default_rng(seed)
    kinds, shares = zip(*MIX, strict=True)
    cumulative = np.cumsum(shares)
    records: list[tuple] = []

    async def one(http: dict[str, httpx.AsyncClient], client: int) -> None:
        base_id, name, n, failures = (proc * 1000 + client) * ID_STRIDE, f"p{proc}c{client}", 0, 0
        live: collections.deque[list[int]] = collections.deque()  # this client's acked adds still in the index
        while time.time() < stop_at:
            n += 1
            kind = kinds[min(int(np.searchsorted(cumulative, rng.random())), len(kinds) - 1)]
            target = "r" if reader and kind in EITHER and rng.random() < 0.5 else "w"
            vec = rng.standard_normal((2, dim)).astype(np.float32).round(4).tolist()
            ids: list[int] = []
            t0 = time.time()
            try:
                c = http[target]
                if kind in ("embed", "embed_masked"):
                    data = {"mask": json.dumps({"ratio": 0.5, "seed": n})} if kind == "embed_masked" else None
                    r = await c.post("/embed", files={"image": images[(client + n) % len(images)]}, data=data)
                elif kind == "add" and keep_live and len(live) >= keep_live:
                    kind, ids = "delete", live[0]
                    log.write("".join(f"untry {i}\n" for i in ids))
                    r = await c.post(f"/index/{INDEX}/delete", json={"ids": ids})
                elif kind == "add":
                    ids = [base_id + n * 10 + j for j in range(1 + n % 2)]
                    r = await c.post(f"/index/{INDEX}/add", json={"ids": ids,
                                                                  "vectors": vectors_for(ids, dim).tolist()})
                elif kind == "search":
                    r = await c.post(f"/index/{INDEX}/search", json={"vectors": vec, "k": 5})
                elif kind == "fit":
                    log.write(f"try {name} {n}\n")
                    r = await c.post("/fewshot/fit", json=fit_body(name, n, dim))
                elif kind == "predict":
                    r = await c.post(f"/fewshot/{BASE}/predict", json={"embeddings": vec, "k": 3})
                elif kind == "select":
                    r = await c.post(f"/index/{POOL}/select", json={"n": 8, "seed": n % 5})
                elif kind == "suggest":
                    r = await c.post(f"/fewshot/{BASE}/suggest", json={"index": POOL, "n": 8, "seed": n % 5})
                else:
                    r = await c.post(f"/fewshot/{BASE}/predict_index", json={"index": POOL, "limit": 100})
                code: int | str = r.status_code
                detail = "" if r.status_code < 500 else r.text[:120]
            except httpx.HTTPError as e:
                code, detail = type(e).__name__, str(e)[:120]
            records.append((t0, time.time(), target, kind, code, detail))
            if code in (200, 201) and kind == "add":
                log.write("".join(f"add {i}\n" for i in ids))
                live.append(ids)
            elif code == 200 and kind == "delete":
                log.write("".join(f"del {i}\n" for i in ids))
                live.popleft()
            elif code == 201 and kind == "fit":
                log.write(f"fit {name} {n}\n")
            # The writer is down, busy or its disk is full: back off (doubling while it lasts), then go on. Clients
            # that retried at a fixed pace took CPU from the restarting writer on 2 cores and slowed its recovery.
            failures = 0 if isinstance(code, int) and code not in (503, 507) else failures + 1
            if failures:
                await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (failures - 1)))

    # An idle connection is dropped by the client before the server's keep-alive timeout (5 s) can close it:
    # with both at 5 s, a request sent on a connection the server was closing came back as a connection reset.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=KEEPALIVE_S)
    timeout = httpx.Timeout(60.0, connect=5.0)
    async with httpx.AsyncClient(base_url=writer, timeout=timeout, limits=limits) as w, \
            httpx.AsyncClient(base_url=reader or writer, timeout=timeout, limits=limits) as r:
        await asyncio.sleep(max(0.0, start_at - time.time()))  # every process starts at the same instant
        await asyncio.gather(*[one({"w": w, "r": r}, i) for i in range(clients)])
    return records


def client_process(args: tuple) -> list[tuple]:
    """One client process: ``args`` as :func:`_clients` takes them, with the acked-write log's path in place of
    the log. The log is line-buffered, so each acknowledged write reaches the file whole. The process runs at a lower
    priority (:data:`CLIENT_NICE`): it shares the cores with the servers here, where in production the callers run
    elsewhere, so the servers' latencies should not wait on the load generator's own work."""
    *head, log_path, seed, keep_live = args
    os.nice(CLIENT_NICE)
    with open(log_path, "a", buffering=1) as log:
        return asyncio.run(_clients(*head, log, seed, keep_live))


def read_log(paths: list[Path]) -> dict:
    """Acked adds and deletes, ids sent for deletion, the last acked seq of each classifier and every seq tried,
    from complete lines only."""
    adds: list[int] = []
    deleted: list[int] = []
    untried: set[int] = set()
    acked: dict[str, int] = {}
    tried: dict[str, set[int]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().split("\n")[:-1]:  # the last piece is "" or a line still being written
            what, *rest = line.split()
            if what == "add":
                adds.append(int(rest[0]))
            elif what == "untry":
                untried.add(int(rest[0]))
            elif what == "del":
                deleted.append(int(rest[0]))
            elif what == "try":
                tried.setdefault(rest[0], set()).add(int(rest[1]))
            elif what == "fit":
                acked[rest[0]] = max(acked.get(rest[0], 0), int(rest[1]))
    return {"adds": adds, "deleted": deleted, "untried": untried, "fits": acked, "tried": tried}


def _nearest(c, ids: list[int], dim: int, batch: int, k: int = 1) -> tuple[list[list[dict] | None], list[str]]:
    """Each id's stored vector searched for in the written index: its hits, or ``None`` where the search failed."""
    out: list[list[dict] | None] = []
    errors: list[str] = []
    for i in range(0, len(ids), batch):
        part = ids[i:i + batch]
        r = c.post(f"/index/{INDEX}/search", json={"vectors": vectors_for(part, dim).tolist(), "k": k})
        if r.status_code != 200:  # the index itself is gone or broken: nothing asked for was found
            errors.append(f"search answered {r.status_code}: {r.text[:200]}")
            out += [None] * len(part)
        else:
            out += r.json()["results"]
    return out, errors


def _is_stored(want: int, hits: list[dict] | None) -> bool:
    """The id is its own nearest neighbour at distance 0 (same vector, l2)."""
    return bool(hits) and hits[0]["id"] == want and hits[0]["score"] <= 1e-6


def _diagnose(c, lost: list[int], first: list, dim: int) -> dict:
    """What the server held for ids found missing: the hits the batched search gave, each id searched alone
    right away and again a few seconds later, and the index's own counters; so a missing write can be told
    apart from a transient miss or a checker fault."""
    stats = c.get(f"/index/{INDEX}")
    detail: dict = {"index": {k: stats.json().get(k) for k in ("ntotal", "seq", "wal_bytes")}
                    if stats.status_code == 200 else stats.status_code, "ids": []}
    alone, _ = _nearest(c, lost, dim, batch=1, k=3)
    time.sleep(3.0)
    later, _ = _nearest(c, lost, dim, batch=len(lost) or 1, k=3)
    for want, hits, a, b in zip(lost, first, alone, later, strict=True):
        detail["ids"].append({"id": want, "batched": (hits or [])[:3], "alone": a, "alone_found": _is_stored(want, a),
                              "after_3s": b, "after_3s_found": _is_stored(want, b)})
    return detail


def check_acked(url: str, dim: int, logs: list[Path], batch: int = 500) -> dict:
    """Ask the server at ``url`` for every acknowledged write in ``logs``: each acked add never sent for deletion
    must be its own nearest neighbour (same vector, distance 0), each acked delete must not be found, each
    classifier must hold its last acked fit or a later one that was sent (a fit in flight at a kill may have
    landed unacknowledged). Missing writes come with :func:`_diagnose`'s detail."""
    import httpx

    t0 = time.time()
    before = read_log(logs)
    bad_fits: list[str] = []
    with httpx.Client(base_url=url, timeout=120) as c:
        adds, deleted = before["adds"], before["deleted"]
        found, errors = _nearest(c, adds + deleted, dim, batch)
        stored: dict[str, int | None] = {}
        for name in before["fits"]:
            r = c.get(f"/fewshot/{name}")
            stored[name] = int(r.json()["classes"][0][1:-1]) if r.status_code == 200 else None
        after = read_log(logs)  # read after the server: a delete or fit sent meanwhile may be what it holds
        missing = [(i, h) for i, h in zip(adds, found[:len(adds)], strict=True)
                   if i not in after["untried"] and not _is_stored(i, h)]
        undone = [i for i, h in zip(deleted, found[len(adds):], strict=True) if _is_stored(i, h)]
        detail = _diagnose(c, [i for i, _ in missing[:5]], [h for _, h in missing[:5]], dim) if missing else None
    for name, seq in before["fits"].items():
        got = stored[name]
        if got is None or got < seq or got not in after["tried"].get(name, set()):
            bad_fits.append(f"{name}: acked seq {seq}, stored {got}")
    return {"adds_checked": len(adds), "adds_lost": len(missing), "lost_ids": [i for i, _ in missing[:20]],
            "deletes_checked": len(deleted), "deletes_undone": len(undone), "undone_ids": undone[:20],
            "fits_checked": len(before["fits"]), "fits_lost": len(bad_fits), "lost_fits": bad_fits[:10],
            "errors": errors[:5], "missing_detail": detail, "seconds": round(time.time() - t0, 2)}


class Prober(threading.Thread):
    """``/healthz`` of each server every ``period`` s (latency, or the error), and the replica's served version."""

    def __init__(self, urls: dict[str, str], disk: Path, period: float = 0.1):
        super().__init__(daemon=True)
        self.urls, self.disk, self.period, self._halt = urls, disk, period, threading.Event()
        self.health: list[tuple[float, str, float | None]] = []  # (t, target, seconds or None on error)
        self.versions: list[tuple[float, str | None, str | None]] = []  # replica: (t, serving, current)
        self.disk_used: list[tuple[float, float]] = []  # (t, MiB used on the data directory's filesystem)

    def run(self) -> None:
        import httpx

        clients = {k: httpx.Client(base_url=u, timeout=5) for k, u in self.urls.items()}
        n = 0
        while not self._halt.is_set():
            for target, c in clients.items():
                t0 = time.time()
                try:
                    ok = c.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append((t0, target, time.time() - t0 if ok else None))
            if n % 10 == 0:
                st = os.statvfs(self.disk)
                self.disk_used.append((time.time(), (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20))
            if "r" in clients and n % 10 == 0:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    s = clients["r"].get("/admin/snapshot").json()
                    self.versions.append((time.time(), s["serving"], s["current"]))
            n += 1
            self._halt.wait(self.period)
        for c in clients.values():
            c.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
