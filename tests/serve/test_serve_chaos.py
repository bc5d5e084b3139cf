"""The chaos soak (``benchmarks/serving/serve_chaos.py``), short: real writer and replica processes, 24 clients in two
processes, one writer kill, one full disk (a tmpfs, where this machine lets root mount one) and one SIGHUP at seeded
moments over 20 s (``--minutes 0.34``). The 30-minute soak with 64 clients is the benchmark (docs/benchmarks.md,
"Chaos soak").

Asserted: every fault happened, no acknowledged write (add, delete, classifier fit) is missing from the writer after
each restart or at the end, nor from the replica once it serves the final version; no 500 and no failure outside
the windows where the writer is down; both servers outlived every SIGHUP and full disk. Latency and memory are
reported by the soak, not asserted here (on a loaded 2-core machine they say more about the neighbours than about
the service).
One fault of each kind in 20 s gives each a 5 s slot. Seed 5 puts the kill last (the disk full from ~3 s for ~3 s,
SIGHUP at ~7.5 s, the kill at ~12.3 s, 3 s before the soak's 5 s reserve at the end: filling the tmpfs takes seconds
on a loaded machine), so a restart slowed by the rest of the suite (2-4 s on an idle 2-core machine) delays no other
fault past the end of the load; it still happens under load, with the replica serving meanwhile. Without a tmpfs
the same seed puts the SIGHUP at ~4 s and the kill at ~11 s.
The clients get 5 s to start (spawn + imports take about 1 s) instead of the soak's 15, and each keeps 4 acked adds
live instead of 10 so that, in a short run, they still delete. The servers serve the session's bundle (the soak's
own default is the same architecture, exported afresh).
"""
from __future__ import annotations

import json

import pytest

from benchmarks.render import chaos as chaos_render
from benchmarks.serving import serve_chaos
from benchmarks.serving.chaos_report import classify


@pytest.mark.slow
def test_short_chaos_soak_loses_no_acknowledged_write(bundle_dir, tmp_path):
    out = tmp_path / "chaos.json"
    assert serve_chaos.main(["--bundle", str(bundle_dir), "--minutes", "0.34", "--seed", "5", "--clients", "24",
                             "--kills", "1", "--disk-fulls", "1", "--sighups", "1", "--keep-live", "4",
                             "--startup-s", "5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["kills"] == 1 and s["sighups"] == 1, report["events"]
    if report["full_disk_skipped"] is None:
        assert s["full_disk_episodes"] >= 1, report["events"]
        assert s["507_on_a_full_disk"] >= 1  # the fault reached the service: writes were refused, then went on
    assert s["events_skipped"] == 0, report["events"]
    assert s["acked_adds_checked_at_end"] > 100 and s["acked_fits_checked_at_end"] > 0
    assert s["acked_deletes_checked_at_end"] > 0  # clients delete beyond their bounded working set
    assert s["acked_writes_lost"] == 0, report["checks"]
    assert s["replica_acked_writes_lost"] == 0, report["final_check"]
    assert s["status_500"] == 0, report["requests"]["by_status"]
    assert s["errors_outside_windows"] == 0, report["requests"]["failed_outside_examples"]
    assert len(report["checks"]) == s["kills"] + 1  # after each restart and at the end
    assert all(e.get("writer_alive", True) and e.get("reader_alive", True) for e in report["events"])
    assert report["requests"]["replica_answered_while_writer_down"] > 0
    assert s["recovery_s"] and all(x > 0 for x in s["recovery_s"])
    (tmp_path / "serve_chaos.json").write_text(out.read_text())
    page = "\n".join(chaos_render.section(tmp_path))
    assert "| writer kills (SIGKILL + restart) | " + str(s["kills"]) + " |" in page and "**0** / **0** of" in page


def test_fault_schedule_is_drawn_from_the_seed():
    plan = serve_chaos.schedule(3, 1800.0, kills=10, disks=3, hups=5)
    assert plan == serve_chaos.schedule(3, 1800.0, kills=10, disks=3, hups=5)
    assert plan != serve_chaos.schedule(4, 1800.0, kills=10, disks=3, hups=5)
    assert [k for _, k, _ in plan].count("kill") == 10 and len(plan) == 18
    times = [t for t, _, _ in plan]
    assert times == sorted(times) and times[0] >= 20.0 and times[-1] <= 1800.0 - 30.0
    assert all(0 < hold <= 30.0 for _, k, hold in plan if k == "disk_full")


def test_failures_are_counted_against_their_fault_windows():
    windows = [("writer_down", 10.0, 14.0), ("disk_full", 20.0, 25.0)]
    records = [(1.0, 1.1, "w", "embed", 200, ""), (9.0, 10.5, "w", "add", "ReadError", ""),
               (14.5, 14.6, "w", "add", "ConnectError", ""),  # within a second of the restart: its connection died
               (21.0, 21.1, "w", "add", 507, ""), (30.0, 30.1, "w", "add", 507, ""),
               (12.0, 12.1, "r", "search", 200, ""), (40.0, 40.1, "w", "fit", 500, "internal server error"),
               (12.0, 12.2, "r", "search", 503, "busy")]
    out = classify(records, windows)
    assert out["classes"] == {"answered": 2, "failed_in_writer_down_windows": 2, "507_on_a_full_disk": 1,
                              "failed_outside_windows": 3}
    assert out["status_500"] == 1 and out["replica_answered_while_writer_down"] == 1


def test_chaos_section_says_not_measured_yet_without_results(tmp_path):
    assert "Not measured yet." in chaos_render.section(tmp_path)
