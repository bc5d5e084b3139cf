"""The index store's write-ahead log: CRC-framed records of opaque payloads, each fsync'd before it is acknowledged.

Durability model of an index: a mutation is acknowledged only after its bytes are fsync'd, either a whole new file
(:func:`msn_core.durable.atomic_write`: index configs and snapshots) or one appended record here (add/delete). After
``kill -9`` the state is exactly the acknowledged operations. The generic parts (atomic writes, durable removal,
quarantine, the data directory's lock) live in :mod:`msn_core.durable`; this log is what only the indexes need.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

from msn_core.durable import write_all

log = logging.getLogger("msn_serve.indexes.wal")

_MAGIC = b"MSNW"
_HEAD = struct.Struct("<4sIIQ")  # magic, payload length, crc32(seq + payload), sequence number


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
