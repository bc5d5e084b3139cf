"""The chaos soak's figures, from what ``serve_chaos.py`` recorded: every request placed against the fault windows.

A writer answer that is a 5xx or a connection error counts as *in a writer-down window* when the request was in
flight at some moment between a kill and the restarted writer's readiness (plus one second for connections that
died with it); a 507 counts as *on a full disk* when the request overlapped a full-disk episode. Everything else
that failed is an error *outside the windows*, which the targets allow none of (and no 500 anywhere).
"""
from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

from benchmarks.serving.serve_harness import pct

SLACK_S = 1.0
RSS_WARMUP_S = 60.0


def _overlaps(t0: float, t1: float, windows: list[tuple[float, float]], slack: float = 0.0) -> bool:
    return any(t0 <= w1 + slack and t1 >= w0 for w0, w1 in windows)


def _latency(values: list[float]) -> dict:
    ms = [1e3 * v for v in values]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 2), "p99_ms": round(pct(ms, 99), 2),
            "max_ms": round(max(ms), 2) if ms else None}


def classify(records: list[tuple], windows: list[tuple[str, float, float]], start: float = 0.0) -> dict:
    down = [(a, b) for k, a, b in windows if k == "writer_down"]
    full = [(a, b) for k, a, b in windows if k == "disk_full"]
    by_status: Counter = Counter()
    by_kind: Counter = Counter()
    cls: Counter = Counter()
    outside: list[str] = []
    reader_ok_while_down = 0
    for t0, t1, target, kind, code, *detail in records:
        role = "writer" if target == "w" else "replica"
        by_status[f"{role} {code}"] += 1
        by_kind[f"{kind} {code}"] += 1
        failed = not isinstance(code, int) or code >= 500
        if target == "r" and not failed and _overlaps(t0, t1, down):
            reader_ok_while_down += 1
        if not failed:
            cls["answered"] += 1
        elif target == "w" and _overlaps(t0, t1, down, SLACK_S):
            cls["failed_in_writer_down_windows"] += 1
        elif code == 507 and _overlaps(t0, t1, full):
            cls["507_on_a_full_disk"] += 1
        else:
            cls["failed_outside_windows"] += 1
            if len(outside) < 20:
                outside.append(f"{role} {kind} {code} {''.join(detail)!r} at {t0 - start:.3f}-{t1 - start:.3f} s")
    return {"by_status": dict(sorted(by_status.items())), "by_kind_and_status": dict(sorted(by_kind.items())),
            "classes": dict(cls), "failed_outside_examples": outside,
            "status_500": sum(v for k, v in by_status.items() if k.endswith(" 500")),
            "replica_answered_while_writer_down": reader_ok_while_down}


def healthz(health: list[tuple], windows: list[tuple[str, float, float]], start: float) -> dict:
    """``/healthz`` latency per server and phase (from the load's start): outside every fault, during each kind."""
    out: dict = {}
    for target, role in (("w", "writer"), ("r", "replica")):
        phases: dict[str, list] = {"outside_faults": [], "disk_full": [], "sighup": [], "writer_down": [],
                                   "during_faults": []}  # during_faults = disk_full + sighup (not restarts)
        errors: Counter = Counter()
        for t, tgt, seconds in health:
            if tgt != target or t < start:
                continue
            phase = next((k for k, a, b in windows if a <= t <= b + (SLACK_S if k == "writer_down" else 0)),
                         "outside_faults")
            if seconds is None:
                errors[phase] += 1
            else:
                phases[phase].append(seconds)
                if phase in ("disk_full", "sighup"):
                    phases["during_faults"].append(seconds)
        out[role] = {p: {**_latency(v), "errors": errors[p]} for p, v in phases.items() if v or errors[p]}
    return out


def rss(incarnations: list[dict]) -> dict:
    """Per writer incarnation: RSS after warm-up (a minute, or a third of a shorter life) and at the end."""
    rows = []
    for inc in incarnations:
        s = inc["samples"]
        if len(s) < 3:
            continue
        t_first, life = s[0][0], s[-1][0] - s[0][0]
        warm = [kb for t, kb in s if t - t_first >= min(RSS_WARMUP_S, life / 3)]
        rows.append({"pid": inc["pid"], "life_s": round(life, 1), "first_kb": s[0][1], "after_warmup_kb": warm[0],
                     "end_kb": s[-1][1], "max_kb": max(kb for _, kb in s),
                     "growth_after_warmup": round((s[-1][1] - warm[0]) / warm[0], 4)})
    long_lived = [r for r in rows if r["life_s"] >= 2 * RSS_WARMUP_S] or rows
    series = [(round(t, 1), i, kb) for i, inc in enumerate(incarnations) for t, kb in inc["samples"]]
    return {"incarnations": rows, "series_kb": series[:: max(1, len(series) // 300)],
            "max_growth_after_warmup": max((r["growth_after_warmup"] for r in long_lived), default=None)}


def replica_versions(versions: list[tuple]) -> dict:
    """How the replica followed: versions it served, and the longest time ``CURRENT`` was ahead of it."""
    served = [v for _, v, _ in versions if v]
    changes = sum(1 for a, b in itertools.pairwise(served) if a != b)
    lag, behind_since = 0.0, None
    for t, serving, current in versions:
        if current and serving != current:
            behind_since = behind_since or t
            lag = max(lag, t - behind_since)
        else:
            behind_since = None
    return {"versions_served": len(set(served)), "version_changes": changes, "max_lag_s": round(lag, 1)}


def disk_use(samples: list[tuple[float, float]], windows: list[tuple[str, float, float]], mounted: bool) -> dict:
    """The data directory's filesystem: most MiB used outside full-disk episodes (it must not fill by itself)."""
    full = [(a, b) for k, a, b in windows if k == "disk_full"]
    outside = [mb for t, mb in samples if not _overlaps(t, t, full, SLACK_S)]
    return {"tmpfs": mounted, "max_used_mb_outside_full_disk": round(max(outside), 1) if outside else None,
            "end_used_mb": round(samples[-1][1], 1) if samples else None}


def log_errors(path: Path) -> dict:
    """ERROR lines and tracebacks in a server's log, grouped by message (timestamps and numbers stripped)."""
    if not path.exists():
        return {}
    found: Counter = Counter()
    for line in path.read_text(errors="replace").splitlines():
        if " ERROR " in line or line.startswith("Traceback") or "unhandled error" in line:
            head = re.sub(r"^\d{4}-\d\d-\d\d \S+ ", "", line)  # the timestamp
            found[re.sub(r"\d+", "N", head)[:160]] += 1
    return dict(found.most_common(20))


def _lost(check: dict) -> int:
    """Acknowledged writes a check did not find: adds missing, deletes undone, classifiers behind."""
    return check["adds_lost"] + check.get("deletes_undone", 0) + check["fits_lost"]


def summarize(raw: dict, writer_log: Path, reader_log: Path) -> dict:
    start = raw["start_at"]
    windows = raw["windows"]
    requests = classify(raw["records"], windows, start)
    events = raw["events"]
    kills = [e for e in events if e["kind"] == "kill" and "skipped" not in e]
    disks = [e for e in events if e["kind"] == "disk_full" and "skipped" not in e]
    hups = [e for e in events if e["kind"] == "sighup" and "skipped" not in e]
    checks = raw["checks"]
    lost = max((_lost(c) for c in checks), default=0)
    final_reader = raw["final"]["reader"]
    replica_lost = _lost(final_reader) if "adds_lost" in final_reader else None
    disk_507 = {i: 0 for i in range(len(disks))}
    full = [(a, b) for k, a, b in windows if k == "disk_full"]
    for t0, t1, _, _, code, _ in raw["records"]:
        if code == 507:
            for i, (a, b) in enumerate(full):
                if t0 <= b and t1 >= a:
                    disk_507[i] += 1
    for i, e in enumerate(disks):
        e["answered_507"] = disk_507.get(i, 0)
    health = healthz(raw["health"], windows, start)
    memory = rss(raw["rss"])
    recovery = [e["recovery_s"] for e in kills]
    w = health["writer"]

    summary = {
        "requests": len(raw["records"]), "answered": requests["classes"].get("answered", 0),
        "failed_in_writer_down_windows": requests["classes"].get("failed_in_writer_down_windows", 0),
        "507_on_a_full_disk": requests["classes"].get("507_on_a_full_disk", 0),
        "errors_outside_windows": requests["classes"].get("failed_outside_windows", 0),
        "status_500": requests["status_500"], "acked_writes_lost": lost, "replica_acked_writes_lost": replica_lost,
        "acked_adds_checked_at_end": raw["final"]["writer"]["adds_checked"],
        "acked_deletes_checked_at_end": raw["final"]["writer"]["deletes_checked"],
        "acked_fits_checked_at_end": raw["final"]["writer"]["fits_checked"],
        "kills": len(kills), "full_disk_episodes": len(disks), "sighups": len(hups),
        "events_skipped": sum(1 for e in events if "skipped" in e),
        "replica_version_changes": replica_versions(raw["versions"])["version_changes"],
        "recovery_s": recovery, "recovery_s_max": max(recovery, default=None),
        "writer_start_without_load_s": round(raw["first_start_s"], 2),
        "healthz_writer_outside_faults": {k: w.get("outside_faults", {}).get(k) for k in ("p50_ms", "p99_ms")},
        "healthz_writer_during_faults": {k: w.get("during_faults", {}).get(k) for k in ("p50_ms", "p99_ms")},
        "rss_max_growth_after_warmup": memory["max_growth_after_warmup"],
        "killed_writers_children_alive_at_end": raw["orphans"],
    }
    return {"summary": summary, "requests": requests, "events": events, "plan": raw["plan"], "checks": checks,
            "final_check": raw["final"], "healthz": health, "rss": memory,
            "replica": replica_versions(raw["versions"]),
            "disk": disk_use(raw["disk_used"], windows, raw["mounted"]),
            "windows": [{"kind": k, "from_s": round(a - start, 3), "to_s": round(b - start, 3)} for k, a, b in windows],
            "log_errors": {"writer": log_errors(writer_log), "replica": log_errors(reader_log)}}

