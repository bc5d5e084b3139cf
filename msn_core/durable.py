"""Durable files: after a crash (``kill -9``, power loss) every file is its old version or its new one.

The one home of the project's durability, used by training (checkpoints, feature caches, exported bundles), the
visualizer and the service (classifiers, indexes, snapshots, its data directory):

* :func:`atomic_write` / :func:`atomic_write_json`: write a temporary file in the same directory, ``fsync`` it,
  ``rename`` it over the target, ``fsync`` the directory (which makes the rename itself durable). Temporary names
  are ``.<name>.<pid>.<random>.tmp``, so concurrent writers never share one and :func:`clean_temp_files` recognises
  the leftovers of interrupted writes;
* :func:`remove_durably`: a file or directory gone for good once it returns (a directory is renamed away first,
  so an interrupted removal leaves no half-deleted directory under the old name);
* :func:`quarantine`: a file that fails to parse is moved under ``<data-dir>/quarantine/`` with a logged reason,
  never deleted;
* :func:`lock_data_dir`: one process per data directory, by a kernel lock that dies with the process;
* :func:`replace_dir` / :func:`recover_dir`: a whole directory (an index, a bundle, a published version) built in a
  staging directory beside its path and swapped in, so the path always holds a whole old or a whole new one
  (the protocol, and what a crash at each of its steps leaves, are under "Directory swap" below).

Appending (the index store's write-ahead log) builds on :func:`write_all` and :func:`fsync_path`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "atomic_write",
    "atomic_write_json",
    "clean_temp_files",
    "fsync_path",
    "lock_data_dir",
    "quarantine",
    "recover_dir",
    "recover_dirs",
    "remove_durably",
    "replace_dir",
    "write_all",
]

log = logging.getLogger("msn_core.durable")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is out (a write may be partial); errors (ENOSPC, EIO) propagate."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with ``data`` (bytes, or a function that writes to the open binary file), durably.

    The file gets the usual permissions (0666 minus the umask), not ``mkstemp``'s 0600: bundles and published
    snapshots are read by other users (the serving account).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        if callable(data):
            with open(fd, "wb") as f:
                data(f)
                f.flush()
                os.fsync(f.fileno())
        else:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """:func:`atomic_write` of ``obj`` as JSON."""
    atomic_write(path, (json.dumps(obj, indent=indent) + "\n").encode())


def remove_durably(path: Path) -> None:
    """Remove a file or a directory tree; the name is gone (and the parent fsync'd) when this returns."""
    if path.is_dir():
        trash = path.with_name(f".{path.name}.deleted.{time.time_ns()}")
        os.replace(path, trash)  # atomic: the name is gone even if rmtree is interrupted
        fsync_path(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        fsync_path(path.parent)


def clean_temp_files(root: Path) -> None:
    """Finish or undo interrupted directory swaps under ``root`` (:func:`recover_dirs`), then delete leftovers of
    interrupted atomic writes / removals (never acknowledged, safe to drop); ``quarantine/`` is left alone."""
    for parent in sorted({p.parent for p in root.rglob(".*.swap*") if _SWAP_RE.fullmatch(p.name)}):
        if "quarantine" not in parent.relative_to(root).parts:
            recover_dirs(parent)
    for p in list(root.rglob(".*.tmp")) + list(root.rglob(".*.deleted.*")):
        if "quarantine" in p.relative_to(root).parts:
            continue
        log.info("removing leftover %s", p)
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def quarantine(data_dir: Path, path: Path, reason: str) -> Path:
    """Move a corrupt file/dir to ``<data_dir>/quarantine/`` (never delete user data) and log why."""
    qdir = data_dir / "quarantine"
    qdir.mkdir(parents=True, exist_ok=True)
    rel = "__".join(path.relative_to(data_dir).parts) if path.is_relative_to(data_dir) else path.name
    dest = qdir / f"{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6:06d}-{rel}"
    os.replace(path, dest)
    fsync_path(qdir)
    fsync_path(path.parent)
    log.error("QUARANTINED %s -> %s: %s", path, dest, reason)
    return dest


def lock_data_dir(data_dir: Path, *, owner: str) -> int:
    """Take an exclusive ``flock`` on ``<data_dir>/.lock`` for the life of the process; returns its descriptor.

    Two writers appending to the same log would corrupt it; the kernel drops the lock when the process dies (even
    on ``kill -9``), so there is no stale lock to clean up. ``owner`` names the program in the refusal
    ("... in use by another msn-serve process").
    """
    import fcntl  # POSIX only: imported where it is needed

    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"data directory {data_dir} is in use by another {owner} process") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


# ------------------------------------------------------------------------------------------------ directory swap
#
# A directory cannot be ``rename``d over a non-empty one, so replacing one takes two renames, and a crash between
# them would leave no directory at the path. A commit record makes the pair atomic. Names beside ``target`` (in its
# parent P; ``tok`` = ``<pid>-<8 hex>``):
#
#   .<name>.<tok>.swap-new   the staging directory, flock'd by its writer for as long as it lives
#   .<name>.<tok>.swap-old   the old directory moved aside (``keep_old``, e.g. a backup, instead when given)
#   .<name>.swap.json        the commit record: {"new": staging name, "old": aside path relative to P, "keep_old"}
#
# replace_dir: 1 mkdir + flock the staging directory; the caller writes into it. 2 fsync every file and directory
# in it. (No old directory: rename it to the target, fsync P; done.) 3 write the record (atomic_write: fsync'd),
# which also holds the staging directory's inode: the commit point. 4-5 exchange the staging directory and the
# target in one ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+ on ext4, xfs, btrfs, tmpfs...): the path goes from the
# old directory to the new one with no moment between; the staging name now holds the old one, which is moved to
# the aside. Where the file system cannot exchange, 4 renames the target to the aside and 5 the staging directory
# to the target. 6 remove the aside (unless kept). 7 unlink the record. Steps 4-7 are _finish, which recovery runs
# too; every step checks the state it finds (the target holds the new directory when its inode is the recorded
# one), so a crash during recovery is recovered the same way.
#
# What ``kill -9`` leaves, as the next recover_dir (every replace_dir starts with one; readers call it before
# opening) puts it: before 3, the old directory (or none, if there was none) and an orphan staging directory,
# removed once its flock is free; from 3 on, the swap is finished forward: the new one is whole (fsync'd before
# the record was written), so the path gets it and the aside and the record go. With the exchange the path always
# holds a whole directory, old or new; without it, it is empty between 4 and 5 until recovery (whoever opens it
# calls recover_dir first). Concurrent swaps and recoveries in one parent are serialised by a flock on the parent
# directory, held only for the record's steps.

_SWAP_RE = re.compile(r"\.(?P<name>.+?)(?:\.(?P<tok>\d+-[0-9a-f]{8})\.swap-(?P<kind>new|old)|\.swap\.json)")
# Test seam: called with each step's name ("staged", "written", "synced", "journaled", "aside", "placed",
# "old_removed", "done"); the kill tests make a real process SIGKILL itself there.
_checkpoint: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _checkpoint is not None:
        _checkpoint(name)


# Set False to take the two-rename path where the file system could exchange (the tests cover both).
use_exchange = True
_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2: Callable[..., int] | None | bool = False  # False: not looked up yet


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the directories at ``a`` and ``b``; False where the kernel, libc or file system cannot."""
    global _renameat2
    if not use_exchange or sys.platform != "linux":
        return False
    if _renameat2 is False:
        import ctypes

        _renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if _renameat2 is None:
        return False
    import ctypes

    at_fdcwd = -100
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _flock(path: Path, *, blocking: bool) -> int | None:
    """An exclusive ``flock`` on a directory: its descriptor, or None when another holder has it (non-blocking).
    The kernel drops it when the process dies, so a dead writer's staging directory is recognisable as such."""
    import fcntl  # POSIX only

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = _flock(path, blocking=True)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _journal(target: Path) -> Path:
    return target.parent / f".{target.name}.swap.json"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(dirpath, name)):
                fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


@contextlib.contextmanager
def replace_dir(target: str | os.PathLike, *, keep_old: str | os.PathLike | None = None,
                replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; when the block ends normally it becomes ``target``.

    The old ``target`` is removed once the new one is in place, or moved to ``keep_old`` (on the same file system)
    when given. ``replace=False`` refuses (``FileExistsError``) to replace an existing ``target``. On an exception
    in the block the staging directory is removed and ``target`` is untouched. A crash at any point leaves a path
    that :func:`recover_dir` makes whole (see the protocol above).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(target)
    staging = target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.swap-new"
    staging.mkdir()
    lock = _flock(staging, blocking=True)
    try:
        _step("staged")
        yield staging
        _step("written")
        _fsync_tree(staging)
        fsync_path(target.parent)  # the staging directory's own entry, before a record can name it
        _step("synced")
        with _locked(target.parent):
            _commit(target, staging, None if keep_old is None else Path(keep_old), replace)
    except BaseException:
        if not _committed(target, staging):  # once committed, the record owns the staging directory
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _committed(target: Path, staging: Path) -> bool:
    try:
        return json.loads(_journal(target).read_text()).get("new") == staging.name
    except (OSError, ValueError, AttributeError):
        return False


def _commit(target: Path, staging: Path, keep_old: Path | None, replace: bool) -> None:
    parent = target.parent
    if not os.path.lexists(target):
        os.rename(staging, target)
        try:
            fsync_path(parent)
        except OSError:  # not durable: undo, so a failed call leaves the path as it found it (nothing there)
            with contextlib.suppress(OSError):
                os.rename(target, staging)
            raise
        _step("placed")
        _step("done")
        return
    if not replace:
        raise FileExistsError(f"{target} exists")
    aside = keep_old or parent / (staging.name.removesuffix(".swap-new") + ".swap-old")
    if os.path.lexists(aside):
        raise FileExistsError(f"{aside} exists (where the old {target.name} was to be moved)")
    if not aside.parent.is_dir():  # e.g. the first backup: the new folder must survive a crash too
        aside.parent.mkdir(parents=True)
        fsync_path(aside.parent.parent)
    atomic_write_json(_journal(target), {"new": staging.name, "old": os.path.relpath(aside, parent),
                                         "keep_old": keep_old is not None, "new_inode": _inode(staging)})
    _step("journaled")
    _finish(target)


def _move_aside(current: Path, old: Path, target: Path) -> None:
    """Rename the old directory (now at ``current``) to the aside or backup path ``old``, durably."""
    if os.path.lexists(old):
        raise OSError(f"cannot finish replacing {target}: {old} is in the way")
    os.rename(current, old)
    fsync_path(target.parent)
    if old.parent != target.parent:
        fsync_path(old.parent)
    _step("aside")


def _finish(target: Path) -> None:
    """Steps 4-7 of a committed swap, from whatever state a crash left them in (holding the parent's lock)."""
    parent, journal = target.parent, _journal(target)
    try:
        record = json.loads(journal.read_text())
        new, old, keep = parent / record["new"], parent / record["old"], bool(record["keep_old"])
    except (ValueError, KeyError, TypeError) as e:  # atomic_write makes this impossible; say so if it happens
        log.error("unreadable swap record %s (%s): removed", journal, e)
        journal.unlink()
        fsync_path(parent)
        return
    new_inode = record.get("new_inode")
    placed = new_inode is not None and _inode(target) == new_inode  # exchanged: the staging name holds the old one
    if new.is_dir() and not placed and os.path.lexists(target) and _exchange(new, target):
        fsync_path(parent)
        _step("placed")
        placed = True
    if new.is_dir() and placed:  # the old directory, under the staging name since the exchange
        _move_aside(new, old, target)
    elif new.is_dir():
        if os.path.lexists(target):
            _move_aside(target, old, target)
        os.rename(new, target)
        fsync_path(parent)
        _step("placed")
    elif not os.path.lexists(target) and old.is_dir():  # the new one is gone (not by this protocol): undo
        log.error("%s: the new directory of an interrupted swap is missing; putting the old one back", target)
        os.rename(old, target)
        fsync_path(parent)
    if not keep and os.path.lexists(old):
        shutil.rmtree(old)
        _step("old_removed")
    journal.unlink()
    fsync_path(parent)
    _step("done")


def _leftovers(parent: Path) -> dict[str, list[tuple[str, str]]]:
    """``{target name: [(entry name, kind), ...]}`` of the swap leftovers in ``parent`` (kind new/old/journal)."""
    found: dict[str, list[tuple[str, str]]] = {}
    try:
        names = [e.name for e in os.scandir(parent) if e.name.startswith(".")]
    except FileNotFoundError:
        return found
    for name in names:
        m = _SWAP_RE.fullmatch(name)
        if m:
            found.setdefault(m["name"], []).append((name, m["kind"] or "journal"))
    return found


def recover_dir(target: str | os.PathLike) -> None:
    """Make ``target`` whole after an interrupted :func:`replace_dir`: finish a committed swap, remove a dead
    writer's staging directory. Costs one directory listing when there is nothing to do (readers call it before
    opening); raises ``OSError`` when it cannot write (a read-only reader then reads what the path holds)."""
    target = Path(target)
    if target.name not in _leftovers(target.parent):
        return
    with _locked(target.parent):
        entries = _leftovers(target.parent).get(target.name, [])
        if any(kind == "journal" for _, kind in entries):
            _finish(target)
        for name, kind in _leftovers(target.parent).get(target.name, []):
            path = target.parent / name
            if kind == "new":
                fd = _flock(path, blocking=False)
                if fd is None:
                    continue  # a live writer's
                try:
                    log.info("removing %s (a staging directory whose writer is gone)", path)
                    shutil.rmtree(path)
                finally:
                    os.close(fd)
            elif kind == "old":  # not left by the protocol (the record outlives the aside); be safe anyway
                if os.path.lexists(target):
                    shutil.rmtree(path)
                else:
                    os.rename(path, target)
            fsync_path(target.parent)


def recover_dirs(parent: str | os.PathLike) -> None:
    """:func:`recover_dir` for every directory in ``parent`` with swap leftovers (a store opening its folder sees
    an index whose swap was interrupted between its two renames, which listing the folder alone would miss)."""
    parent = Path(parent)
    for name in sorted(_leftovers(parent)):
        recover_dir(parent / name)
