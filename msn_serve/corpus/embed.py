"""Embedding a listed corpus into :mod:`msn_core.corpus` shards, without torch.

Each image goes through exactly what ``POST /embed`` does to an upload (:func:`msn_serve.embedding.preprocess.
preprocess_bytes`: EXIF-upright, any Pillow mode to RGB or L, resize, crop, normalise) and the engine the server
would run (:func:`msn_serve.embedding.choice.choose_engine`), so a vector written here equals the one ``/embed``
returns for the same file.

Decoding runs in a thread pool (Pillow's decoders and resizes release the GIL; no worker processes to start or
copy arrays between) a few batches ahead of the engine, whose own threads also run without the GIL, so decoding
hides behind inference. A file that cannot be read or decoded is skipped, counted and listed in its shard's
record, never fatal.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.bundle import Preprocessing
from msn_core.corpus import Item, shard_done, shard_slices, write_shard
from msn_serve.embedding.engine import InferenceEngine
from msn_serve.embedding.preprocess import preprocess_bytes
from msn_serve.errors import ApiError

log = logging.getLogger("msn_serve.corpus")

PREFETCH_BATCHES = 3  # decoded batches kept ahead of the engine: enough to ride out a slow file


@dataclass
class Batch:
    """One batch of a shard: ``pixels[j]`` is image ``ids[j]``; ``bad`` the ``(id, why)`` of unreadable files."""

    shard: int
    ids: list[int]
    pixels: np.ndarray | None
    bad: list[tuple[int, str]] = field(default_factory=list)
    last: bool = False  # the shard's last batch: commit the shard after it


def decode_file(path: str, pre: Preprocessing, max_pixels: int) -> np.ndarray | str:
    """The graph input of one file, or why it cannot be read (a string, not an exception: one bad file among
    millions is counted, not raised)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return preprocess_bytes(data, pre, max_pixels=max_pixels, what=path)
    except ApiError as e:
        return e.message
    except OSError as e:
        return f"{path}: cannot read ({e.strerror or e})"
    except Exception as e:  # noqa: BLE001 - a decoder bug on one odd file must not stop a million-image run
        return f"{path}: {type(e).__name__}: {e}"


def _decode_chunk(files: Sequence[str], pre: Preprocessing, max_pixels: int) -> list[np.ndarray | str]:
    return [decode_file(f, pre, max_pixels) for f in files]


class Decoder:
    """Decodes batches in a thread pool, :data:`PREFETCH_BATCHES` ahead of whoever iterates :meth:`batches`."""

    def __init__(self, pre: Preprocessing, *, workers: int, max_pixels: int) -> None:
        self.pre, self.workers, self.max_pixels = pre, max(1, workers), max_pixels
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="msn-embed-decode")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)  # after an error: do not wait for queued files

    def _submit(self, files: Sequence[str]) -> list[Future]:
        """One task per worker and batch (a task per image would cost more in futures than small images decode in)."""
        step = -(-len(files) // self.workers)
        return [self.pool.submit(_decode_chunk, files[i:i + step], self.pre, self.max_pixels)
                for i in range(0, len(files), step)]

    def batches(self, plan: Sequence[tuple[int, int, int, bool]], items: Sequence[Item]) -> Iterator[Batch]:
        """Decoded :class:`Batch` es for ``plan``'s ``(shard, first id, end id, last of its shard)``, in order."""
        pending: deque[tuple[tuple[int, int, int, bool], list[Future]]] = deque()
        todo = iter(plan)
        for step in todo:
            pending.append((step, self._submit([items[i][2] for i in range(step[1], step[2])])))
            if len(pending) > PREFETCH_BATCHES:
                break
        while pending:
            (shard, lo, _, last), futures = pending.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, self._submit([items[i][2] for i in range(nxt[1], nxt[2])])))
            decoded = [x for f in futures for x in f.result()]
            good = [(lo + j, x) for j, x in enumerate(decoded) if not isinstance(x, str)]
            bad = [(lo + j, x) for j, x in enumerate(decoded) if isinstance(x, str)]
            pixels = np.stack([x for _, x in good]) if good else None
            yield Batch(shard, [i for i, _ in good], pixels, bad, last)


def batch_plan(shards: Sequence[int], n_items: int, shard_size: int, batch_size: int
               ) -> list[tuple[int, int, int, bool]]:
    """``(shard, first id, end id, last of its shard)`` of every batch of ``shards``, in order."""
    slices = shard_slices(n_items, shard_size)
    plan = []
    for s in shards:
        lo, hi = slices[s]
        starts = list(range(lo, hi, batch_size))
        plan += [(s, a, min(a + batch_size, hi), a == starts[-1]) for a in starts]
    return plan


def pending_shards(out: Path, n_items: int, shard_size: int) -> list[int]:
    """The shards without a complete commit record in ``out`` (all of them in a fresh directory)."""
    return [s for s, (lo, hi) in enumerate(shard_slices(n_items, shard_size)) if shard_done(out, s, hi - lo) is None]


def embed_shards(out: Path, items: Sequence[Item], shards: Sequence[int], engine: InferenceEngine, *,
                 shard_size: int, batch_size: int, workers: int, max_pixels: int, progress: Any = None
                 ) -> list[dict[str, Any]]:
    """Embed and commit each of ``shards`` (of ``shard_size`` consecutive ``items``) into ``out``; returns their
    records. ``progress.update(n, skipped)`` is called after each batch when given."""
    info = engine.info
    keep = np.arange(info.num_patches, dtype=np.int64)
    slices = shard_slices(len(items), shard_size)
    records: list[dict[str, Any]] = []
    chunks: list[np.ndarray] = []
    ids: list[int] = []
    skipped: list[dict[str, Any]] = []
    decoder = Decoder(info.preprocessing, workers=workers, max_pixels=max_pixels)
    try:
        for batch in decoder.batches(batch_plan(shards, len(items), shard_size, batch_size), items):
            lo, hi = slices[batch.shard]
            for i, why in batch.bad:
                log.warning("skipping unreadable image %s (%s)", items[i][0], why)
                skipped.append({"id": i, "path": items[i][0], "error": why})
            if batch.pixels is not None:
                n = len(batch.pixels)
                vectors = engine.run(batch.pixels, np.ascontiguousarray(np.broadcast_to(keep, (n, keep.size))))
                chunks.append(np.asarray(vectors, dtype=np.float32))
                ids += batch.ids
            if progress is not None:
                progress.update(len(batch.ids) + len(batch.bad), len(batch.bad))
            if batch.last:
                emb = np.concatenate(chunks) if chunks else np.zeros((0, info.embed_dim), np.float32)
                records.append(write_shard(out, batch.shard, items[lo:hi], lo, ids, emb, skipped))
                chunks, ids, skipped = [], [], []
    finally:
        decoder.close()
    return records
