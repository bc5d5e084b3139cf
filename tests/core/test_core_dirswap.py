"""msn_core.durable's directory swap: ``kill -9`` at every step of :func:`replace_dir` leaves a path that
:func:`recover_dir` makes whole (the old directory before the commit record, the new one from it on), and nothing
else beside it; with the atomic exchange the path is whole even before recovery.

Each kill is real: a subprocess runs the swap with the module's test seam set to ``SIGKILL`` itself at one step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from msn_core import durable
from msn_core.durable import clean_temp_files, recover_dir, recover_dirs, replace_dir

REPO = Path(__file__).resolve().parents[2]
BEFORE_COMMIT = ["staged", "half-written", "written", "synced"]
AFTER_COMMIT = ["journaled", "aside", "placed", "old_removed", "done"]

SCRIPT = """
import os, signal, sys
from pathlib import Path
import msn_core.durable as d
target, step, keep = Path(sys.argv[1]), sys.argv[2], sys.argv[3] or None
d.use_exchange = sys.argv[4] == "1"
def at(name):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)
d._checkpoint = at
with d.replace_dir(target, keep_old=keep) as s:
    (s / "a.txt").write_text("new")
    at("half-written")
    (s / "sub").mkdir()
    (s / "sub" / "b.txt").write_text("new")
"""


def _write(path: Path, content: str) -> None:
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text(content)
    (path / "sub" / "b.txt").write_text(content)


def _content(path: Path) -> str:
    """"old" or "new" when the directory is whole (both files agree), else a description of what is wrong."""
    files = {p.relative_to(path).as_posix(): p.read_text() for p in path.rglob("*.txt")}
    values = set(files.values())
    return values.pop() if sorted(files) == ["a.txt", "sub/b.txt"] and len(values) == 1 else f"broken: {files}"


def _killed_at(target: Path, step: str, keep: Path | None = None, exchange: bool = True) -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(target), step, str(keep or ""), "1" if exchange else "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == -signal.SIGKILL, (step, r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("step", BEFORE_COMMIT + AFTER_COMMIT)
def test_a_kill_at_every_step_leaves_the_old_or_the_new_directory(tmp_path: Path, step: str, exchange: bool):
    target = tmp_path / "indexes" / "docs"
    _write(target, "old")
    _killed_at(target, step, exchange=exchange)
    if exchange:  # one atomic renameat2: the path holds a whole directory at every kill, before any recovery
        assert _content(target) in ("old", "new"), step
    elif step == "aside":  # the two renames' one window where the path is empty: whoever opens it recovers first
        assert not target.exists()
    recover_dir(target)
    assert _content(target) == ("old" if step in BEFORE_COMMIT else "new")
    assert sorted(p.name for p in target.parent.iterdir()) == ["docs"]  # no staging, aside or record left


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("step", ["synced", "journaled", "aside", "placed", "done"])
def test_a_kept_old_directory_survives_every_kill(tmp_path: Path, step: str, exchange: bool):
    target, backup = tmp_path / "indexes" / "docs", tmp_path / "backups" / "docs.old-model"
    _write(target, "old")
    _killed_at(target, step, keep=backup, exchange=exchange)
    recover_dirs(target.parent)  # what a store does when it opens its folder
    if step in BEFORE_COMMIT:
        assert _content(target) == "old" and not backup.exists()
    else:
        assert _content(target) == "new" and _content(backup) == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["docs"]


@pytest.mark.parametrize("step", ["half-written", "synced", "placed"])
def test_a_first_swap_killed_leaves_nothing_or_the_new_directory(tmp_path: Path, step: str):
    target = tmp_path / "bundle"
    _killed_at(target, step)
    clean_temp_files(tmp_path)  # msn-serve's start-up clean-up recovers swaps too
    if step == "placed":
        assert _content(target) == "new"
    assert [p.name for p in tmp_path.iterdir()] == (["bundle"] if step == "placed" else [])


def test_replace_keep_refuse_and_fail(tmp_path: Path):
    target = tmp_path / "v"
    with replace_dir(target) as s:
        _write(s, "one")
    assert _content(target) == "one"
    with replace_dir(target, keep_old=tmp_path / "backups" / "v1") as s:
        _write(s, "two")
    assert _content(target) == "two" and _content(tmp_path / "backups" / "v1") == "one"
    with pytest.raises(RuntimeError), replace_dir(target) as s:
        _write(s, "three")
        raise RuntimeError("disk on fire")
    with pytest.raises(FileExistsError), replace_dir(target, replace=False) as s:
        _write(s, "four")
    assert _content(target) == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["backups", "v"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # readable by the serving account


def test_recovery_spares_a_live_writers_staging_directory(tmp_path: Path):
    target = tmp_path / "v"
    with replace_dir(target) as staging:
        _write(staging, "new")
        (tmp_path / ".v.1-0123abcd.swap-new").mkdir()  # a dead writer's
        recover_dir(target)  # the live one holds its flock: left alone
        assert staging.is_dir() and not (tmp_path / ".v.1-0123abcd.swap-new").exists()
    assert _content(target) == "new"


def test_a_record_whose_new_directory_vanished_puts_the_old_one_back(tmp_path: Path):
    target, aside = tmp_path / "v", tmp_path / ".v.1-0123abcd.swap-old"
    _write(aside, "old")
    (tmp_path / ".v.swap.json").write_text(json.dumps({"new": ".v.1-0123abcd.swap-new", "old": aside.name,
                                                       "keep_old": False}))
    recover_dir(target)
    assert _content(target) == "old" and [p.name for p in tmp_path.iterdir()] == ["v"]


def test_the_test_seam_is_off_by_default():
    assert durable._checkpoint is None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
