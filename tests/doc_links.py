"""Relative links and ``#anchors`` in the docs, resolved as GitHub renders them (headings' slugs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation dropped except ``-`` and
    ``_``, spaces made ``-`` (no collapsing)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _without_code(text: str) -> list[str]:
    """The lines of a markdown text with code blocks blanked and inline code removed (links there are not links)."""
    lines, fence = [], ""
    for line in text.splitlines():
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if not fence and opening:
            fence = opening.group(1)
            lines.append("")
        elif fence:
            fence = "" if line.strip().startswith(fence) else fence
            lines.append("")
        else:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(doc: Path) -> set[str]:
    """The anchors of a markdown file's headings, with GitHub's ``-1``, ``-2`` suffixes for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    fence = ""
    for line in doc.read_text(encoding="utf-8").splitlines():
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if opening and (not fence or line.strip().startswith(fence)):
            fence = "" if fence else opening.group(1)
            continue
        heading = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def check_links(doc: Path, text: str | None = None) -> tuple[int, list[str]]:
    """Relative links and ``#anchors`` of one markdown file: the target exists and has the heading. Returns the
    number of links checked and the broken ones."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    checked, problems = 0, []
    for number, line in enumerate(_without_code(text), 1):
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            target = m.group(1)
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            resolved = doc if not path else (doc.parent / _unquote(path)).resolve()
            where = f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name}:{number}"
            if not resolved.exists():
                problems.append(f"{where}: link to missing {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return checked, problems


def _unquote(path: str) -> str:
    from urllib.parse import unquote

    return unquote(path)
