"""kill -9 of msn-serve on Milvus Lite during a write stream: every acknowledged add must survive.

Milvus Lite runs inside msn-serve, so a SIGKILL of msn-serve kills the engine too; an add is acknowledged once it is
in Milvus Lite's write-ahead log (docs/serving.md, "Milvus backend"). One msn-serve (``--index-backend milvus``,
``<data-dir>/milvus.db``) and one client thread adding batches of vectors with increasing ids (each vector derived
from its id, metadata ``{"i": id}``). At moments drawn from ``--seed`` the server is killed with SIGKILL and
restarted on the same port and data directory; after each restart every acknowledged id is looked up (a search for
its own vector must return it first, with its metadata). Reported, as JSON with the machine: kills, acknowledged
adds, acknowledged adds lost (must be 0), unacknowledged adds that landed anyway, restart times.

    python -m benchmarks.serving.milvus_chaos [--kills 10] [--seed 0]
    python -m benchmarks.serving.milvus_chaos --kills 2 --out /tmp/chaos.json     # a quick check
"""
from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, save_json
from benchmarks.serving.serve_chaos import ServeProcess
from benchmarks.serving.serve_harness import tiny_bundle

DIM, BATCH, LOOKUP = 64, 8, 256  # the tiny bundle's width; ids per add; vectors per lookup search
OUT = RESULTS / "milvus_chaos.json"


def vectors(ids: list[int]) -> np.ndarray:
    """The vector of each id, reproducible from the id alone."""
    return np.stack([np.random.default_rng(i).standard_normal(DIM).astype(np.float32) for i in ids])


class Writer(threading.Thread):
    """Adds ``BATCH`` new ids per request until stopped; records which batches were acknowledged (HTTP 200)."""

    def __init__(self, url: str, first_id: int):
        super().__init__(daemon=True)
        self.url, self.next_id, self.stop = url, first_id, threading.Event()
        self.acked: list[int] = []
        self.failed: list[int] = []  # sent, no 200 (the server died under it): may or may not have landed

    def run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.is_set():
                ids = list(range(self.next_id, self.next_id + BATCH))
                self.next_id += BATCH
                try:
                    r = c.post("/index/chaos/add", json={"ids": ids, "vectors": vectors(ids).tolist(),
                                                         "metadata": [{"i": i} for i in ids]})
                    (self.acked if r.status_code == 200 else self.failed).extend(ids)
                except httpx.TransportError:
                    self.failed.extend(ids)
                    time.sleep(0.05)


def missing(url: str, ids: list[int]) -> list[int]:
    """The ids whose own vector does not find them first (with their metadata)."""
    import httpx

    lost = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for lo in range(0, len(ids), LOOKUP):
            chunk = ids[lo:lo + LOOKUP]
            r = c.post("/index/chaos/search", json={"vectors": vectors(chunk).tolist(), "k": 1})
            r.raise_for_status()
            for i, row in zip(chunk, r.json()["results"], strict=True):
                if not row or row[0]["id"] != i or row[0].get("metadata") != {"i": i}:
                    lost.append(i)
    return lost


def run(kills: int, seed: int, workdir: Path) -> dict[str, Any]:
    import httpx

    rng = np.random.default_rng(seed)
    bundle = tiny_bundle(workdir / "bundle")
    srv = ServeProcess("msn-serve", bundle, workdir / "data", ["--index-backend", "milvus"], workdir / "serve.log")
    restarts, lost_after = [srv.start()], []
    acked: set[int] = set()
    failed: set[int] = set()
    try:
        r = httpx.post(f"{srv.url}/index/chaos", json={"type": "flat"}, timeout=30)
        assert r.status_code == 201, r.text
        for kill in range(1, kills + 1):
            writer = Writer(srv.url, max(acked | failed, default=-1) + 1)  # new ids only
            writer.start()
            time.sleep(float(rng.uniform(0.5, 2.0)))
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(30)
            writer.stop.set()
            writer.join(30)
            restarts.append(srv.start())
            acked.update(writer.acked)
            failed.update(writer.failed)
            lost_after.append(len(missing(srv.url, sorted(acked))))
            print(f"kill {kill}: {len(acked)} acknowledged ids, {lost_after[-1]} lost; restart {restarts[-1]:.1f} s",
                  flush=True)
        landed = len(failed) - len(missing(srv.url, sorted(failed))) if failed else 0
        ntotal = httpx.get(f"{srv.url}/index/chaos", timeout=30).json()["ntotal"]
    finally:
        srv.stop()
    return {"kills": kills, "seed": seed, "acknowledged_ids": len(acked), "ids_per_add": BATCH,
            "acknowledged_ids_lost": lost_after[-1] if lost_after else 0, "lost_after_each_kill": lost_after,
            "unacknowledged_ids": len(failed), "unacknowledged_ids_that_landed": landed, "ntotal": ntotal,
            "start_s": round(restarts[0], 2), "restart_s": [round(s, 2) for s in restarts[1:]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="msn-milvus-chaos-") as tmp:
        result = run(a.kills, a.seed, Path(tmp))
    save_json(a.out, {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), **result})
    print(f"{result['acknowledged_ids_lost']} of {result['acknowledged_ids']} acknowledged ids lost")
    return 1 if result["acknowledged_ids_lost"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
