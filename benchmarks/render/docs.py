"""Regenerate the tables of docs/ from the JSON the measuring scripts stored; nothing here measures.

    python -m benchmarks.render                  # docs/benchmarks.md, docs/results.md, docs/recipe_search.md
    python -m benchmarks.render --plots          # also redraw the plots drawn from JSON (budget curve, label loop)
    python -m benchmarks.render --only results   # one page
    python -m benchmarks.render --check          # write nothing; exit 1 if a page is not what the JSON gives

Where each page reads from: benchmarks.md from ``benchmarks/results/*.json``; results.md from ``docs/results/*.json``
(``evaluation/paper_tables.py``), ``docs/budget_curve.json``, ``docs/rcdm_eval.json`` and
``benchmarks/results/label_efficiency.json``, with ``docs/results-notes.md`` appended; recipe_search.md from
``benchmarks/results/recipe_search.json``. Every figure names the machine it was measured on.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import DOCS, RESULTS
from benchmarks.protocol import BUDGET_JSON, BUDGET_PNG, LABEL_PNG
from benchmarks.render import benchmarks_page, recipe_page, results_page
from msn_core.durable import atomic_write

PAGES: dict[str, tuple[str, Callable[[Path, Path], str]]] = {
    "benchmarks": ("benchmarks.md", lambda docs, results: benchmarks_page.render(results)),
    "results": ("results.md", lambda docs, results: results_page.render(docs)),
    "recipe_search": ("recipe_search.md", lambda docs, results: recipe_page.render(results / "recipe_search.json")),
}


def plots(docs: Path, results: Path) -> list[Path]:
    """Redraw the plots whose data is all in JSON (a changed matplotlib redraws them byte-differently, hence opt-in)."""
    from benchmarks.render import budget, label

    written = []
    if (docs / BUDGET_JSON).exists():
        budget.plot(json.loads((docs / BUDGET_JSON).read_text()), docs / BUDGET_PNG)
        written.append(docs / BUDGET_PNG)
    report = results / "label_efficiency.json"
    if report.exists() and "accuracy" in (data := json.loads(report.read_text())):
        label.plot(data, docs / LABEL_PNG.name)
        written.append(docs / LABEL_PNG.name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(PAGES), default=list(PAGES), help="pages to write")
    parser.add_argument("--plots", action="store_true", help="also redraw the budget-curve and label-loop plots")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where the pages go (and results.md's JSON is read)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="benchmarks/results/ (the scripts' JSON)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    args = parser.parse_args(argv)
    stale = []
    for page in args.only:
        name, render = PAGES[page]
        text, path = render(args.docs, args.results), args.docs / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
                print(f"{path} differs from what the JSON gives")
            continue
        atomic_write(path, text.encode())
        print(f"wrote {path}")
    if args.check:
        return 1 if stale else 0
    for path in plots(args.docs, args.results) if args.plots else []:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
