"""Chaos soak of msn-serve: faults together and under load, every acknowledged write checked.

    python -m benchmarks.serving.serve_chaos --minutes 30 --seed 0    # the lead's run (needs the machine to itself)
    python -m benchmarks.serving.serve_chaos --minutes 1              # proves the harness

A writer ``msn-serve`` (``--publish-interval-s``) and a read-only replica (``--read-only --reload-poll-s``) on one
data directory, 64 clients (``chaos_load.py``: embed, masked embed, index add / search, few-shot fit / predict,
select / suggest / predict_index; reads split between writer and replica), all on 127.0.0.1. At moments drawn
from ``--seed`` the writer is killed with SIGKILL and restarted on the same port and data directory, the data
directory's filesystem (a tmpfs this script mounts, ``--tmpfs-mb``) is filled up and freed again, and SIGHUP is
sent to both servers (the replica reloads; the writer must ignore it). Faults run one at a time. After each
restart and at the end every acknowledged write is looked up; at the end the replica, once it serves the final
published version, must hold every one too.

Reported (printed, and JSON with the machine): requests by status; 5xx and connection errors outside the windows
where the writer is down (507 while the disk is full is expected and counted apart); any 500; acknowledged writes
lost; recovery time after each kill; the writer's RSS per incarnation; ``/healthz`` latency in and outside faults.
Where the tmpfs cannot be mounted (not root, no CAP_SYS_ADMIN) the full-disk fault is skipped and the reason
recorded.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, machine, save_json
from benchmarks.serving import chaos_load
from benchmarks.serving.chaos_report import summarize
from benchmarks.serving.serve_harness import test_images, tiny_bundle
from benchmarks.serving.serve_soak import STARTUP_S, RssSampler

READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One ``msn-serve`` role on a fixed port (a restarted writer comes back where the clients expect it)."""

    def __init__(self, role: str, bundle: Path, data: Path, args: list[str], log: Path):
        self.role, self.port, self.log_path = role, free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "msn_serve", "--bundle", str(bundle), "--data-dir", str(data),
                    "--port", str(self.port), "--log-level", "warning", "--precision", "fp32",
                    "--runtime", "onnxruntime", "--intra-op-threads", "1", "--max-wait-ms", "2", *args]
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    def start(self) -> float:
        """Start and wait for /readyz; the seconds it took. Raises with the log's tail if it exits instead."""
        import httpx

        env = {k: v for k, v in os.environ.items() if not k.startswith("MSN_SERVE_")}
        env.update(PYTHONUNBUFFERED="1", MSN_SERVE_WAL_COMPACT_MB="4")  # compactions happen during the soak
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {self.role} started {time.strftime('%H:%M:%S')} ====\n".encode())
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.pids.append(self.proc.pid)
        t0 = time.time()
        while time.time() - t0 < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.time() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} not ready after {READY_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])

    def children(self) -> list[int]:
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class FullDisk:
    """Fill the tmpfs the data directory lives on with one file, and free it."""

    def __init__(self, mount: Path):
        self.path = mount / "filler.bin"

    def fill(self) -> int:
        written = 0
        with open(self.path, "wb", buffering=0) as f:
            for chunk in (2**20, 2**12):  # MiB pieces, then page-sized ones to the last free page
                block = b"\0" * chunk
                while True:
                    try:
                        written += f.write(block)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
        return written

    def free(self) -> None:
        self.path.unlink(missing_ok=True)


def mount_tmpfs(where: Path, mb: int) -> str | None:
    """Mount a tmpfs of ``mb`` MiB at ``where``; ``None``, or why it could not."""
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs (full-disk fault skipped)"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], capture_output=True,
                       text=True, check=False)
    return None if r.returncode == 0 else f"mount -t tmpfs failed: {(r.stderr or r.stdout).strip()[:200]}"


def schedule(seed: int, seconds: float, kills: int, disks: int, hups: int) -> list[tuple[float, str, float]]:
    """``(at, kind, hold)`` sorted by time: the events spread over slots of equal length after a warm-up, their
    order and offsets drawn from ``seed``; ``hold`` is how long a full disk stays full."""
    rng = np.random.default_rng(seed)
    kinds = ["kill"] * kills + ["disk_full"] * disks + ["sighup"] * hups
    rng.shuffle(kinds)
    warm, tail = min(20.0, 0.1 * seconds), min(30.0, 0.15 * seconds)
    slot = (seconds - warm - tail) / max(1, len(kinds))
    out = []
    for i, kind in enumerate(kinds):
        hold = float(min(30.0, rng.uniform(0.3, 0.6) * slot)) if kind == "disk_full" else 0.0
        out.append((warm + slot * (i + rng.uniform(0.0, 0.3)), kind, round(hold, 2)))
    return out


class Soak:
    def __init__(self, bundle: Path, scratch: Path, minutes: float, seed: int, clients: int, procs: int,
                 tmpfs_mb: int, publish_s: float, poll_s: float, keep_live: int = chaos_load.KEEP_LIVE,
                 http_workers: str = "0", startup_s: float = STARTUP_S):
        self.bundle, self.scratch, self.seconds, self.seed = bundle, scratch, 60.0 * minutes, seed
        self.startup_s = startup_s
        workers = ["--http-workers", http_workers]
        self.keep_live = keep_live
        self.clients, self.procs = clients, procs
        self.mount = scratch / "mnt"
        self.mount.mkdir()
        self.disk_skipped = mount_tmpfs(self.mount, tmpfs_mb)
        self.mounted = self.disk_skipped is None
        self.data = self.mount / "data"
        self.writer = ServeProcess("writer", bundle, self.data, ["--queue-size", "1024", "--max-queued-fits", "64",
                                                                "--publish-interval-s", str(publish_s), *workers],
                                   scratch / "writer.log")
        self.reader = ServeProcess("reader", bundle, self.data, ["--read-only", "--reload-poll-s", str(poll_s),
                                                                "--queue-size", "1024", *workers],
                                   scratch / "reader.log")
        self.logs = [scratch / f"acked-{p}.log" for p in range(procs)]
        self.events: list[dict] = []
        self.windows: list[tuple[str, float, float]] = []
        self.checks: list[dict] = []
        self.rss: list[dict] = []  # per writer incarnation: {"pid", "t0", "samples"}
        self.orphans: list[int] = []

    def _sample_rss(self) -> None:
        sampler = RssSampler(self.writer.proc.pid, self.start_at)
        sampler.start()
        self.rss.append({"pid": self.writer.proc.pid, "sampler": sampler})

    def _stop_rss(self) -> None:
        if self.rss and "sampler" in self.rss[-1]:
            self.rss[-1]["samples"] = self.rss[-1].pop("sampler").stop()

    def kill(self) -> dict:
        children = self.writer.children()
        self._stop_rss()
        t_kill = time.time()
        self.writer.proc.send_signal(signal.SIGKILL)
        self.writer.proc.wait(30)
        failed_starts = []
        while True:
            try:
                self.writer.start()
                break
            except (RuntimeError, TimeoutError) as e:
                failed_starts.append(str(e)[:300])
                if len(failed_starts) >= 3:
                    raise
                time.sleep(1.0)
        t_ready = time.time()
        self.windows.append(("writer_down", t_kill, t_ready))
        self._sample_rss()
        time.sleep(1.0)
        # The killed writer's fit worker and multiprocessing's resource tracker exit once they notice (a worker in
        # the middle of a fit or of its start-up only after it); how many still run at the end is reported.
        left = [pid for pid in children if alive(pid)]
        self.orphans += left
        check = chaos_load.check_acked(self.writer.url, self.dim, self.logs)
        self.checks.append({"after": "kill", **check})
        if check["missing_detail"]:
            print(f"  acked writes not found after the restart: {json.dumps(check['missing_detail'])}", flush=True)
        return {"recovery_s": round(t_ready - t_kill, 3), "failed_starts": failed_starts,
                "children_left_running": len(left), "check": check}

    def disk_full(self, hold: float) -> dict:
        disk = FullDisk(self.mount)
        t0 = time.time()
        try:
            written = disk.fill()
            time.sleep(hold)
        finally:
            disk.free()
        t1 = time.time()
        self.windows.append(("disk_full", t0, t1))
        return {"filled_mb": round(written / 2**20, 1), "held_s": round(t1 - t0, 2),
                "writer_alive": self.writer.alive(), "reader_alive": self.reader.alive()}

    def sighup(self) -> dict:
        t0 = time.time()
        for server in (self.reader, self.writer):
            server.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        self.windows.append(("sighup", t0, time.time()))
        return {"writer_alive": self.writer.alive(), "reader_alive": self.reader.alive()}

    def run_faults(self, plan: list[tuple[float, str, float]]) -> None:
        for at, kind, hold in plan:
            delay = self.start_at + at - time.time()
            if delay > 0:
                time.sleep(delay)
            late = time.time() - (self.start_at + at)
            if time.time() > self.start_at + self.seconds - 5:
                self.events.append({"kind": kind, "planned_s": round(at, 1), "skipped": "the load had ended"})
                continue
            t = time.time() - self.start_at
            print(f"[{t:6.1f} s] {kind}", flush=True)
            result = self.kill() if kind == "kill" else self.disk_full(hold) if kind == "disk_full" else self.sighup()
            self.events.append({"kind": kind, "planned_s": round(at, 1), "at_s": round(t, 1),
                                "late_s": round(max(0.0, late), 1), **result})
            if not (self.writer.alive() and self.reader.alive()):
                raise RuntimeError(f"a server died after {kind}: writer {self.writer.tail()} / "
                                   f"reader {self.reader.tail()}")

    def run(self, kills: int, disks: int, hups: int) -> dict:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        from msn_core.bundle import load_bundle_info

        self.dim = load_bundle_info(self.bundle).embed_dim
        plan = schedule(self.seed, self.seconds, kills, disks if self.mounted else 0, hups)
        self.first_start_s = self.writer.start()  # before any load: what a recovery under load compares with
        chaos_load.prepare(self.writer.url, self.dim)
        self.reader.start()
        images = test_images(16)
        self.start_at = time.time() + self.startup_s
        stop_at = self.start_at + self.seconds
        prober = chaos_load.Prober({"w": self.writer.url, "r": self.reader.url}, self.mount)
        prober.start()
        self._sample_rss()
        procs = max(1, min(self.procs, self.clients))
        jobs = [(self.writer.url, self.reader.url, images, self.dim, self.clients // procs +
                 (p < self.clients % procs), p, self.start_at, stop_at, str(self.logs[p]), self.seed * 100 + p,
                 self.keep_live)
                for p in range(procs)]
        with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(chaos_load.client_process, j) for j in jobs]
            try:
                self.run_faults(plan)
            finally:
                records = [r for f in futures for r in f.result()]
        final = {"writer": chaos_load.check_acked(self.writer.url, self.dim, self.logs)}
        self.checks.append({"after": "end", **final["writer"]})
        final["reader"] = self._reader_final()
        prober.stop()
        self._stop_rss()
        orphans = [pid for pid in self.orphans if alive(pid)]  # outlived the killed writer to the end of the soak
        return {"plan": [{"at_s": round(a, 1), "kind": k, "hold_s": h} for a, k, h in plan],
                "events": self.events, "windows": self.windows, "checks": self.checks, "final": final,
                "records": records, "health": prober.health, "versions": prober.versions,
                "disk_used": prober.disk_used, "mounted": self.mounted,
                "rss": [{"pid": r["pid"], "samples": r.get("samples", [])} for r in self.rss],
                "orphans": len(orphans), "start_at": self.start_at, "first_start_s": self.first_start_s}

    def _reader_final(self) -> dict:
        """Publish the final state and wait (up to a minute) for the replica to serve it; then check it."""
        import httpx

        version = httpx.post(f"{self.writer.url}/admin/snapshot", timeout=120).json()["version"]
        t0 = time.time()
        while time.time() - t0 < 60:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.reader.url}/admin/snapshot", timeout=5).json()["serving"] == version:
                    break
            time.sleep(0.2)
        else:
            return {"error": f"the replica did not serve version {version} within 60 s"}
        return {"version": version, "caught_up_s": round(time.time() - t0, 2),
                **chaos_load.check_acked(self.reader.url, self.dim, self.logs)}

    def close(self) -> None:
        for server in (self.writer, self.reader):
            server.stop()
        for pid in self.orphans:  # children of a killed writer that outlived it (reported)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.mounted:
            r = subprocess.run(["umount", str(self.mount)], capture_output=True, check=False)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the load (faults happen inside it)")
    ap.add_argument("--seed", type=int, default=0, help="draws the fault schedule and the clients' requests")
    ap.add_argument("--bundle", type=Path, help="bundle directory (default: a tiny random ViT exported here)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_chaos.json")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--kills", type=int, help="writer kills (default: 0.4 a minute, at least 2)")
    ap.add_argument("--disk-fulls", type=int, help="full-disk episodes (default: 0.14 a minute, at least 1)")
    ap.add_argument("--sighups", type=int, help="SIGHUPs (default: 0.5 a minute, at least 2)")
    ap.add_argument("--tmpfs-mb", type=int, default=256, help="size of the data directory's filesystem")
    ap.add_argument("--publish-interval-s", type=float, default=30.0, help="the writer's (each version is kept "
                    "300 s after its successor, all on the tmpfs)")
    ap.add_argument("--reload-poll-s", type=float, default=1.0)
    ap.add_argument("--keep-live", type=int, default=chaos_load.KEEP_LIVE,
                    help="acked adds each client keeps in the index before deleting its oldest (0: never delete)")
    ap.add_argument("--http-workers", default="0", help="both servers' --http-workers (0: one process each)")
    ap.add_argument("--startup-s", type=float, default=STARTUP_S,
                    help="time the client processes get to start (spawn + imports) before the load and its clock")
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.clients < 1:
        sys.exit("serve_chaos: --minutes and --clients must be positive")
    m = a.minutes
    kills = a.kills if a.kills is not None else max(2, round(0.4 * m))
    disks = a.disk_fulls if a.disk_fulls is not None else max(1, round(0.14 * m))
    hups = a.sighups if a.sighups is not None else max(2, round(0.5 * m))
    out = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "minutes": m, "seed": a.seed,
           "clients": a.clients, "client_processes": a.client_procs,
           "client_nice": chaos_load.CLIENT_NICE, "keep_live": a.keep_live, "note": a.note,
           "http_workers": a.http_workers,
           "bundle": str(a.bundle) if a.bundle else "tiny random ViT (2 blocks, 32 px, patch 4, 64-d)"}
    print(f"machine: {out['machine']['cpu']} x{out['machine']['cores_visible']}; {m:g} min, seed {a.seed}, "
          f"{kills} kills, {disks} full disks, {hups} SIGHUPs", flush=True)
    with tempfile.TemporaryDirectory(prefix="msn-chaos-") as tmp:
        scratch = Path(tmp)
        bundle = a.bundle or tiny_bundle(scratch / "tiny")
        soak = Soak(bundle, scratch, m, a.seed, a.clients, a.client_procs, a.tmpfs_mb, a.publish_interval_s,
                    a.reload_poll_s, a.keep_live, a.http_workers, a.startup_s)
        try:
            raw = soak.run(kills, disks, hups)
        finally:
            soak.close()
        out.update(summarize(raw, scratch / "writer.log", scratch / "reader.log"))
        out["full_disk_skipped"] = soak.disk_skipped
    save_json(a.out, out)
    print(json.dumps(out["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
