"""docs/benchmarks.md, "Chaos soak": the table of ``benchmarks/results/serve_chaos.json`` (or "not measured yet")."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.render.text import machine_line, sentence, table

USAGE = ("`python -m benchmarks.serving.serve_chaos --minutes 30 --seed 0`: a writer and a read-only replica on one "
         "data directory, 64 clients with a mixed workload (embed, masked embed, index add, delete and search, "
         "few-shot fit and predict, the label loop; each client keeps a bounded set of vectors in the index), "
         "while at seeded moments the writer is killed with SIGKILL and restarted, "
         "its data directory's filesystem (a tmpfs) fills up and is freed, and SIGHUP goes to both servers. Every "
         "acknowledged write is looked up after each restart and at the end, on the writer and on the replica.")


def _ms(d: dict) -> str:
    return "n/a" if d.get("p50_ms") is None else f"{d['p50_ms']:.0f} / {d['p99_ms']:.0f} ms"


def section(results: Path) -> list[str]:
    lines = ["## Chaos soak", "", USAGE, ""]
    path = results / "serve_chaos.json"
    if not path.exists():
        return lines + ["Not measured yet.", ""]
    lines += _report(json.loads(path.read_text()))
    workers = results / "serve_chaos-workers.json"
    if workers.exists():
        r = json.loads(workers.read_text())
        lines += ["### With HTTP worker processes", "",
                  (f"`python -m benchmarks.serving.serve_chaos --minutes {r['minutes']:g} --seed {r['seed']} "
                   f"--http-workers {r['http_workers']} --out benchmarks/results/serve_chaos-workers.json`: the "
                   "same soak, both servers with HTTP worker processes (a killed writer takes its HTTP processes "
                   "down with it)."), ""]
        lines += _report(r)
    return lines


def _report(r: dict) -> list[str]:
    """One soak's machine line and table."""
    s = r["summary"]
    recovery = s["recovery_s"]
    growth = s["rss_max_growth_after_warmup"]
    disk = (f"{s['full_disk_episodes']} ({s['507_on_a_full_disk']:,} writes answered 507)"
            if not r.get("full_disk_skipped") else f"skipped: {r['full_disk_skipped']}")
    rows = [
        ["requests", f"{s['requests']:,} ({s['answered']:,} answered)", ""],
        ["writer kills (SIGKILL + restart)", str(s["kills"]), "≥ 10"],
        ["recovery after a kill (median / max)",
         (f"{statistics.median(recovery):.1f} / {max(recovery):.1f} s (a start without load: "
          f"{s['writer_start_without_load_s']:.1f} s)") if recovery else "n/a", ""],
        ["full-disk episodes", disk, "≥ 3"],
        ["SIGHUPs / versions the replica switched to", f"{s['sighups']} / {s['replica_version_changes']}", ""],
        ["acknowledged writes lost (writer / replica)",
         (f"**{s['acked_writes_lost']}** / **{s['replica_acked_writes_lost']}** of "
          f"{s['acked_adds_checked_at_end']:,} adds, {s.get('acked_deletes_checked_at_end', 0):,} deletes and "
          f"{s['acked_fits_checked_at_end']} classifiers"), "0"],
        ["failed while the writer was down", f"{s['failed_in_writer_down_windows']:,}", ""],
        ["5xx or connection errors outside those windows", f"**{s['errors_outside_windows']}**", "0"],
        ["500 answers", f"**{s['status_500']}**", "0"],
        ["writer `/healthz` p50 / p99 outside faults", _ms(s["healthz_writer_outside_faults"]), "p99 ≤ 100 ms"],
        ["writer `/healthz` p50 / p99 during full disks and SIGHUPs", _ms(s["healthz_writer_during_faults"]), ""],
        ["writer RSS growth after warm-up (longest-lived incarnations)",
         "n/a" if growth is None else f"{100 * growth:+.1f} %", "≤ 5 %"],
    ]
    head = (f"Machine: {machine_line(r['machine'])}. {r['minutes']:g} minutes, seed {r['seed']}, {r['clients']} "
            f"clients in {r['client_processes']} processes on the same machine. Bundle: {r['bundle']}.")
    return [head + (" " + sentence(r["note"]) if r.get("note") else ""), "",
            table(["", "measured", "target (30 minutes)"], rows), ""]
