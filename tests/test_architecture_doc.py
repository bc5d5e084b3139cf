"""docs/architecture.md's prose names every module of msn_core, msn_serve, training and visualizer.

The picture between the markers is drawn from the code (``python -m tests.import_graph``) and lists every file, so
it cannot be what names them: the prose must, with a few words of what each holds. A module counts as named when the
paragraph of its room (the one that opens with it in bold, e.g. **`msn_serve/indexes/`**) names its file
(`managed.py`), or when the prose gives its path from the repository root (`training/pretrain.py`); a file name in
another room's paragraph does not count, since several rooms have a ``cli.py``. ``__init__.py`` is the room itself.
"""
from __future__ import annotations

import re
from pathlib import Path

from tests.import_graph import BEGIN, DOC, END, REPO

PACKAGES = ("msn_core", "msn_serve", "training", "visualizer")
ROOM = re.compile(r"\*\*`([\w/]+/)`")


def prose(page: str) -> str:
    """The page without the generated picture."""
    head, rest = page.split(BEGIN)
    return head + rest.split(END)[1]


def names(text: str, word: str) -> bool:
    """``word`` (a file name or path) stands on its own in ``text``: not part of a longer name or another path."""
    return re.search(rf"(?<![\w/.]){re.escape(word)}(?!\w)", text) is not None


def unnamed(page: str, root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The modules (paths from ``root``) that the page's prose does not name."""
    text = prose(page)
    rooms: dict[str, str] = {}
    for paragraph in re.split(r"\n\s*\n", text):
        if m := ROOM.match(paragraph.strip()):
            rooms[m.group(1)] = rooms.get(m.group(1), "") + paragraph
    missing = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            room = rel.rsplit("/", 1)[0] + "/"
            if path.name != "__init__.py" and not (names(text, rel) or names(rooms.get(room, ""), path.name)):
                missing.append(rel)
    return missing


def test_the_prose_names_every_module():
    missing = unnamed(DOC.read_text())
    assert not missing, (f"{DOC.relative_to(REPO)} does not name {', '.join(missing)}: say in its room's paragraph "
                         "what each holds")


def test_a_module_named_only_in_the_picture_or_another_room_is_missing(tmp_path: Path):
    for name in ("app/__init__.py", "app/cli.py", "app/http/__init__.py", "app/http/cli.py", "app/http/routes.py",
                 "app/http/schemas.py", "app/main.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    page = (f"Intro naming `app/main.py`.\n\n{BEGIN}\nroutes.py  schemas.py  cli.py\n{END}\n\n"
            "**`app/`** — `cli.py`, the command line.\n\n**`app/http/`** — `routes.py`; not `xschemas.py`.\n")
    assert unnamed(page, tmp_path, ("app",)) == ["app/http/cli.py", "app/http/schemas.py"]
