"""Cells of the low-shot tables: msn-eval's JSON rows looked up by run and setting (``n/a`` where a run is missing)."""
from __future__ import annotations

from collections.abc import Callable

from benchmarks.protocol import SETTINGS


def accuracy_cell(evals: dict, key: str, setting: str) -> str:
    for row in evals.get(key, {}).get("results", []):
        if row.get("setting") == setting:
            return f"{row['mean']:.1f} ± {row['std']:.1f}"
    return "n/a"


def mean_accuracy(evals: dict, key: str, setting: str) -> float | None:
    rows = [r for r in evals.get(key, {}).get("results", []) if r.get("setting") == setting]
    return rows[0]["mean"] if rows else None


def lowshot_rows(evals: dict, rows: list[tuple[str, str]], extra: Callable[[str], list[str]] = lambda b: []):
    return [[label, *(accuracy_cell(evals, f"{b}-lowshot", s) for s, _ in SETTINGS), *extra(b)] for b, label in rows]

