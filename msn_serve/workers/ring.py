"""A ring of fixed-size uint8 crop slots in one shared mapping, one ring per HTTP process.

The engine process makes each ring once, as an anonymous ``memfd`` (not a file under ``/dev/shm``, whose 64 MB
default in containers would cap the slots), and hands its descriptor to the HTTP process it belongs to; a restarted
HTTP process gets the same ring back with every slot free. A slot holds one crop as ``H x W x C`` uint8 (what
Pillow decodes: the engine normalises while it packs a batch) followed by the image's kept patch indices as int32.
Slots are sized for a 512-px RGB crop with up to 4,096 patches: the pages are touched only where a crop is written,
so a 224-px crop costs its 150 KB of memory, not the slot's size.

Only the HTTP process allocates and frees slots (:class:`SlotPool`): a slot is taken before its crop is written and
given back when the engine's answer for it arrives, never earlier, so the engine never reads a slot being rewritten.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

SLOT_CROP = 3 * 512 * 512  # crop bytes a slot holds (the largest crop the HTTP processes prepare)
SLOT_PATCHES = 4096  # kept patch indices a slot holds
_SLOT = SLOT_CROP + 4 * SLOT_PATCHES


@dataclass(frozen=True)
class RingLayout:
    slots: int

    @property
    def nbytes(self) -> int:
        return self.slots * _SLOT


def fits(height: int, width: int, channels: int, kept: int) -> bool:
    """Whether one image of this crop and kept-patch count fits a slot."""
    return height * width * channels <= SLOT_CROP and kept <= SLOT_PATCHES


class CropRing:
    """The shared mapping of ``slots`` slots, opened from a memfd (:meth:`create` in the engine process, then the
    same descriptor in the HTTP process)."""

    def __init__(self, fd: int, slots: int):
        self.fd, self.layout = fd, RingLayout(slots)
        self._map = mmap.mmap(fd, self.layout.nbytes)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, slots: int, name: str = "msn-crops") -> CropRing:
        fd = os.memfd_create(name, 0)  # inheritable only where passed (subprocess pass_fds)
        os.ftruncate(fd, RingLayout(slots).nbytes)
        return cls(fd, slots)

    @property
    def slots(self) -> int:
        return self.layout.slots

    def crop(self, slot: int, height: int, width: int, channels: int) -> np.ndarray:
        """The slot's crop as a ``(H, W, C)`` uint8 view (no copy)."""
        start = slot * _SLOT
        return self._buf[start: start + height * width * channels].reshape(height, width, channels)

    def keep(self, slot: int, kept: int) -> np.ndarray:
        """The slot's kept patch indices as an int32 view of length ``kept``."""
        start = slot * _SLOT + SLOT_CROP
        return self._buf[start: start + 4 * kept].view(np.int32)

    def write(self, slot: int, crop: np.ndarray, keep: np.ndarray) -> None:
        """Copy one prepared image (uint8 ``(H, W, C)``, or ``(H, W)`` grey) and its kept indices into ``slot``."""
        hwc = crop if crop.ndim == 3 else crop[:, :, None]
        self.crop(slot, *hwc.shape)[...] = hwc
        self.keep(slot, len(keep))[...] = keep


class SlotPool:
    """The free slots of one ring, as the HTTP process sees them: taken all at once for a request, or none."""

    def __init__(self, slots: int):
        self._free = list(range(slots - 1, -1, -1))  # a stack: the most recently freed (warm) slot goes out first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
