"""Disk-fault injection at the operating-system boundary, for the durability tests.

:class:`DiskFaults` wraps ``os.write`` and ``os.fsync`` (every durable write of the service goes through them) so
that calls on files under one directory raise ``OSError(ENOSPC or EIO)``: from the n-th such call on, until
:meth:`DiskFaults.free` ("a full disk": the first failing write still writes half its bytes, as a real write
that runs out of space does, so a torn record is left behind), or at the n-th call only ("a transient error"), or
while a control file names an errno (for a server in another process: ``faulty_serve.py``). Nothing of the
service itself is replaced.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


class DiskFaults:
    def __init__(self, root: Path, *, control: Path | None = None):
        self.root = str(Path(root).resolve())
        self.control = control
        self.calls = 0  # write/fsync calls on files under root since install (or reset)
        self.fail_at: int | None = None
        self.code = errno.ENOSPC
        self.persistent = True
        self._torn = False
        self._real_write, self._real_fsync = os.write, os.fsync

    def install(self) -> DiskFaults:
        os.write, os.fsync = self._write, self._fsync
        return self

    def uninstall(self) -> None:
        os.write, os.fsync = self._real_write, self._real_fsync

    def __enter__(self) -> DiskFaults:  # noqa: PYI034
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def fail(self, at: int, code: int, *, persistent: bool) -> None:
        """Fail the ``at``-th call from now (1-based), and every later one if ``persistent``."""
        self.calls, self.fail_at, self.code, self.persistent, self._torn = 0, at, code, persistent, False

    def free(self) -> None:
        self.fail_at = None

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _failing(self, fd: int) -> int | None:
        """The errno this call on ``fd`` fails with, or ``None``."""
        if not self._under_root(fd):
            return None
        self.calls += 1
        if self.control is not None:
            return self._control_code()
        if self.fail_at is not None and (self.calls == self.fail_at or (self.persistent and self.calls > self.fail_at)):
            return self.code
        return None

    def _control_code(self) -> int | None:
        try:
            name = Path(self.control).read_text().strip()
        except OSError:
            return None
        return ERRNOS.get(name)

    def _write(self, fd: int, data) -> int:
        code = self._failing(fd)
        if code is None:
            return self._real_write(fd, data)
        if self.persistent and self.control is None and not self._torn and len(data) > 1:
            self._torn = True  # the disk fills up in the middle of this write
            return self._real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(code, f"{os.strerror(code)} (injected into write)")

    def _fsync(self, fd: int) -> None:
        code = self._failing(fd)
        if code is not None:
            raise OSError(code, f"{os.strerror(code)} (injected into fsync)")
        self._real_fsync(fd)
