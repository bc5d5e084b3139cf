"""A ring of fixed-size image slots in one shared mapping, one ring per HTTP process.

The engine process makes each ring once, as an anonymous ``memfd`` (not a file under ``/dev/shm``, whose 64 MB
default in containers would cap the slots), and hands its descriptor to the HTTP process it belongs to; a restarted
HTTP process gets the same ring back with every slot free. A slot holds one prepared image as the graph takes it,
float32 ``(C, H, W)`` normalised (the one form the batcher takes: :mod:`msn_serve.http.embedder`), followed by its
kept patch indices as int32.

Slots are sized at start-up for the models served (:func:`slot_bytes_for`: the largest input and patch count of
them, rounded up to whole pages), so every image of every model fits; a model added while serving that would not fit
is refused (:class:`msn_serve.workers.supervisor.HttpWorkers`), and :meth:`CropRing.write` and the views check
:meth:`CropRing.fits`, so no slot is ever overrun. A slot's pages are touched only where an image is written.

Only the HTTP process allocates and frees slots (:class:`SlotPool`): a slot is taken before its crop is written and
given back when the engine's answer for it arrives, never earlier, so the engine never reads a slot being rewritten.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from msn_core.bundle import BundleInfo

PAGE = 4096


def image_bytes(info: BundleInfo) -> int:
    """A slot's bytes for one image of this model: its float32 input and every patch's index."""
    return 4 * info.in_chans * info.image_size ** 2 + 4 * info.num_patches


def describe_input(info: BundleInfo) -> str:
    return f"{info.in_chans} x {info.image_size} x {info.image_size} float32 and {info.num_patches} patches"


def slot_bytes_for(infos: Iterable[BundleInfo]) -> int:
    """The slot size that holds an image of each of these models: the largest need, in whole pages."""
    need = max(image_bytes(i) for i in infos)
    return -(-need // PAGE) * PAGE


@dataclass(frozen=True)
class RingLayout:
    slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


class CropRing:
    """The shared mapping of ``slots`` slots of ``slot_bytes`` each, opened from a memfd (:meth:`create` in the
    engine process, then the same descriptor in the HTTP process)."""

    def __init__(self, fd: int, slots: int, slot_bytes: int):
        if slot_bytes % PAGE or slot_bytes <= 0:
            raise ValueError(f"slot size {slot_bytes} is not a positive multiple of {PAGE} bytes")
        self.fd, self.layout = fd, RingLayout(slots, slot_bytes)
        self._map = mmap.mmap(fd, self.layout.nbytes)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, slots: int, slot_bytes: int, name: str = "msn-crops") -> CropRing:
        fd = os.memfd_create(name, 0)  # inheritable only where passed (subprocess pass_fds)
        os.ftruncate(fd, RingLayout(slots, slot_bytes).nbytes)
        return cls(fd, slots, slot_bytes)

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    def fits(self, pixel_bytes: int, kept: int) -> bool:
        """Whether one image of ``pixel_bytes`` float32 bytes and ``kept`` patch indices fits a slot."""
        return 0 <= pixel_bytes and 0 <= kept and pixel_bytes % 4 == 0 and pixel_bytes + 4 * kept <= self.slot_bytes

    def _start(self, slot: int, pixel_bytes: int, kept: int) -> int:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside a ring of {self.slots}")
        if not self.fits(pixel_bytes, kept):
            raise ValueError(f"an image of {pixel_bytes} bytes with {kept} patch indices does not fit a slot of "
                             f"{self.slot_bytes} bytes")
        return slot * self.slot_bytes

    def pixels(self, slot: int, channels: int, height: int, width: int) -> np.ndarray:
        """The slot's image as a ``(C, H, W)`` float32 view (no copy)."""
        size = 4 * channels * height * width
        start = self._start(slot, size, 0)
        return self._buf[start: start + size].view(np.float32).reshape(channels, height, width)

    def keep(self, slot: int, pixel_bytes: int, kept: int) -> np.ndarray:
        """The slot's kept patch indices (after its ``pixel_bytes`` of image) as an int32 view of length ``kept``."""
        start = self._start(slot, pixel_bytes, kept) + pixel_bytes
        return self._buf[start: start + 4 * kept].view(np.int32)

    def write(self, slot: int, pixels: np.ndarray, keep: np.ndarray) -> None:
        """Copy one prepared image (float32 ``(C, H, W)``) and its kept indices into ``slot``; a ``ValueError``,
        with nothing written, for one that does not fit."""
        if pixels.ndim != 3:
            raise ValueError(f"expected a (C, H, W) image, got shape {pixels.shape}")
        self._start(slot, 4 * pixels.size, len(keep))
        self.pixels(slot, *pixels.shape)[...] = pixels
        self.keep(slot, 4 * pixels.size, len(keep))[...] = keep


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
