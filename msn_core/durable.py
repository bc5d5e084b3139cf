"""Durable file writes: after a crash (or ``kill -9``, or power loss) a file is the old version or the new one.

The recipe: write a temporary file in the same directory, ``fsync`` it, ``rename`` it over the target, ``fsync`` the
directory (which makes the rename itself durable). Temporary names are ``.<name>.<pid>.<random>.tmp`` so concurrent
writers never share one, and a cleaner can recognise leftovers of interrupted writes by the ``.*.tmp`` pattern.
Training checkpoints, feature caches, exported bundles and the service's classifiers and indexes all use this.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_write", "atomic_write_json", "fsync_path", "write_all"]


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
