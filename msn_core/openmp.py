"""OpenMP settings that a native library changes behind torch's back, put back.

torch, faiss-cpu and cyanure each ship a GNU OpenMP runtime (``libgomp``). torch loads its copy with ``RTLD_GLOBAL``,
so a library imported after torch binds its OpenMP calls to *torch's* runtime, and whatever it sets there is set for
torch too. cyanure's fit calls ``omp_set_dynamic(1)``, ``omp_set_max_active_levels(1)`` and
``omp_set_num_threads(n)`` and leaves them so (checked with ``omp_get_dynamic()`` after a fit). With the dynamic
adjustment on, libgomp hands a parallel region fewer threads than it asked for whenever the 15-minute load average
is high; oneDNN's convolution backward-weights sizes its work for the threads it asked for and waits on its own spin
barrier for the missing ones: torch's backward then spins at 100 % of a core for ever (seen in the test suite after a
low-shot fit in the same process). :func:`openmp_kept` records the calling thread's settings in every OpenMP runtime
loaded in the process and restores them afterwards; every cyanure fit and every FAISS thread-count change of ours
runs inside it. Only the standard library: the core is imported on both sides of the torch boundary.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OpenMPState", "loaded_runtimes", "openmp_kept", "openmp_state"]

# File names of the OpenMP runtimes wheels bundle (auditwheel renames them: libgomp-e985bcbb.so.1.0.0).
_RUNTIME_PREFIXES = ("libgomp", "libiomp5", "libomp")


@dataclass(frozen=True)
class OpenMPState:
    """The settings of one runtime that a library can leave changed (as the calling thread sees them)."""

    path: str
    dynamic: bool
    max_threads: int
    max_active_levels: int


def loaded_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process now (none loads here: only what is already mapped)."""
    try:
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    except OSError:  # not Linux: nothing to look at, nothing to restore
        return []
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith(_RUNTIME_PREFIXES) and ".so" in path:
            seen.setdefault(path)
    return list(seen)


def _open(path: str) -> ctypes.CDLL | None:
    """A handle on an already-loaded runtime (``RTLD_NOLOAD``: never loads a second copy)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        for name in ("omp_get_dynamic", "omp_get_max_threads", "omp_get_max_active_levels"):
            getattr(lib, name)
    except (OSError, AttributeError):
        return None
    return lib


def openmp_state() -> list[OpenMPState]:
    """Each loaded runtime's settings, as the calling thread sees them."""
    states = []
    for path in loaded_runtimes():
        lib = _open(path)
        if lib is not None:
            states.append(OpenMPState(path, bool(lib.omp_get_dynamic()), int(lib.omp_get_max_threads()),
                                      int(lib.omp_get_max_active_levels())))
    return states


def _restore(states: list[OpenMPState]) -> None:
    for state in states:
        lib = _open(state.path)
        if lib is None:
            continue
        lib.omp_set_dynamic(ctypes.c_int(int(state.dynamic)))
        lib.omp_set_max_active_levels(ctypes.c_int(state.max_active_levels))
        lib.omp_set_num_threads(ctypes.c_int(state.max_threads))


@contextmanager
def openmp_kept() -> Iterator[None]:
    """Run the body, then put every loaded OpenMP runtime's settings back as they were before it.

    A runtime the body loaded (cyanure imported for the first time, before torch) had no settings before: it is
    left with the dynamic adjustment off, since nothing of ours wants libgomp to shrink a parallel region.
    """
    before = openmp_state()
    known = {state.path for state in before}
    try:
        yield
    finally:
        _restore(before)
        for path in loaded_runtimes():
            lib = _open(path) if path not in known else None
            if lib is not None:
                lib.omp_set_dynamic(ctypes.c_int(0))
