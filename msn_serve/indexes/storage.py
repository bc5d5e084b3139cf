"""Crash-safe file primitives of the service: a CRC-framed write-ahead log, durable removal, and quarantine.

Durability model: a mutation is acknowledged only after its bytes are fsync'd — either a whole new file
(:func:`msn_core.durable.atomic_write`: classifiers, index configs and snapshots) or one appended WAL record
(index add/delete). After ``kill -9`` the state is exactly the acknowledged operations. Files that fail to parse
at start-up are moved under ``<data-dir>/quarantine/`` with a logged reason instead of being dropped.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from msn_core.durable import fsync_path, write_all
from msn_serve.errors import storage_error

log = logging.getLogger("msn_serve.indexes.storage")

_MAGIC = b"MSNW"
_HEAD = struct.Struct("<4sIIQ")  # magic, payload length, crc32(seq + payload), sequence number


@contextlib.contextmanager
def persisting(what: str) -> Iterator[None]:
    """Turn a failed disk operation (ENOSPC, EIO, ...) into a 507/503 for the client, logged once here.

    The code inside must leave memory and disk as they were when it raises (or in a state a restart reads as
    either the old or the new one), so the client can simply retry.
    """
    try:
        yield
    except OSError as e:
        log.error("%s: write failed (%s); rolled back", what, e)
        raise storage_error(e, what) from e


def remove_durably(path: Path) -> None:
    if path.is_dir():
        trash = path.with_name(f".{path.name}.deleted.{time.time_ns()}")
        os.replace(path, trash)  # atomic: the name is gone even if rmtree is interrupted
        fsync_path(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        fsync_path(path.parent)


def clean_temp_files(root: Path) -> None:
    """Delete leftovers of interrupted atomic writes / deletions (never acknowledged, safe to drop)."""
    for p in list(root.rglob(".*.tmp")) + list(root.rglob(".*.deleted.*")):
        if "quarantine" in p.relative_to(root).parts:
            continue
        log.info("removing leftover %s", p)
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def quarantine(data_dir: Path, path: Path, reason: str) -> Path:
    """Move a corrupt file/dir aside (never delete user data) and log why."""
    qdir = data_dir / "quarantine"
    qdir.mkdir(parents=True, exist_ok=True)
    rel = "__".join(path.relative_to(data_dir).parts) if path.is_relative_to(data_dir) else path.name
    dest = qdir / f"{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6:06d}-{rel}"
    os.replace(path, dest)
    fsync_path(qdir)
    fsync_path(path.parent)
    log.error("QUARANTINED %s -> %s: %s", path, dest, reason)
    return dest


def lock_data_dir(data_dir: Path) -> int:
    """Take an exclusive ``flock`` on ``<data-dir>/.lock`` for the life of the process.

    Two servers appending to the same WAL would corrupt it; the kernel drops the lock when the process dies
    (even on ``kill -9``), so there is no stale lock to clean up.
    """
    import fcntl

    fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"data directory {data_dir} is in use by another msn-serve process") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


class WriteAheadLog:
    """Append-only log of opaque payloads; each ``append`` is fsync'd before it returns, or rolled back.

    A failed append (ENOSPC, EIO, from the write or from the fsync) leaves no trace: the file is cut back to the last
    good offset before the error propagates, and if even that fails, before the next append. So a later append never
    carries a failed one's bytes with it, and the caller's sequence number is only advanced after a success.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._good = os.fstat(self._fd).st_size  # end of the last record known to be durable
        self._dirty = False  # bytes past _good may exist (a failed append not yet cut off)

    @staticmethod
    def read(path: Path) -> tuple[list[tuple[int, bytes]], int, str | None]:
        """Records ``(seq, payload)`` up to the first bad one; returns them, the valid byte length, and a
        problem description (``None`` if the whole file is valid). A torn tail is reported as such."""
        if not path.exists():
            return [], 0, None
        data = path.read_bytes()
        out, pos = [], 0
        while pos < len(data):
            if len(data) - pos < _HEAD.size:
                return out, pos, f"torn tail ({len(data) - pos} stray bytes)"
            magic, length, crc, seq = _HEAD.unpack_from(data, pos)
            if magic != _MAGIC:
                return out, pos, f"bad record magic at byte {pos}"
            end = pos + _HEAD.size + length
            if end > len(data):
                return out, pos, f"torn tail (record at byte {pos} is incomplete)"
            payload = data[pos + _HEAD.size: end]
            if zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq))) != crc:
                return out, pos, f"checksum mismatch at byte {pos}"
            out.append((seq, payload))
            pos = end
        return out, pos, None

    def append(self, seq: int, payload: bytes) -> None:
        self._cut_back()
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq)))
        record = _HEAD.pack(_MAGIC, len(payload), crc, seq) + payload
        try:
            write_all(self._fd, record)
            os.fsync(self._fd)
        except OSError:
            self._dirty = True
            try:
                self._cut_back()
            except OSError:
                log.error("%s: cannot cut back a failed append yet; the next append will retry", self.path)
            raise
        self._good += len(record)

    def _cut_back(self) -> None:
        if self._dirty:
            os.ftruncate(self._fd, self._good)
            os.fsync(self._fd)
            self._dirty = False

    def size(self) -> int:
        return self._good

    def truncate(self, length: int = 0) -> None:
        os.ftruncate(self._fd, length)
        self._good, self._dirty = length, True  # until the fsync below, the old bytes may come back
        os.fsync(self._fd)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
