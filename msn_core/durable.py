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
* :func:`lock_data_dir`: one process per data directory, by a kernel lock that dies with the process.

Appending (the index store's write-ahead log) builds on :func:`write_all` and :func:`fsync_path`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "atomic_write",
    "atomic_write_json",
    "clean_temp_files",
    "fsync_path",
    "lock_data_dir",
    "quarantine",
    "remove_durably",
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
    """Delete leftovers of interrupted atomic writes / removals under ``root`` (never acknowledged, safe to drop);
    ``quarantine/`` is left alone."""
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
