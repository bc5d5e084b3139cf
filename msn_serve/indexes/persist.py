"""What one FAISS index of the writer keeps on disk, and in which order it is written.

``indexes/<name>/config.json`` (fixed at create; an auto index rewrites it when it changes kind), ``snapshot.npz``
(serialised FAISS index + metadata + last applied WAL sequence + config, replaced atomically) and ``wal.log``
(:class:`~msn_serve.indexes.wal.WriteAheadLog`). Start-up = snapshot + replay of the records newer than it. A
directory ``msn-index build`` wrote (the :mod:`msn_serve.indexes.files` form) loads too, into memory since the writer
mutates it, and the first snapshot supersedes its files.

:class:`~msn_serve.indexes.durability.Durability` decides *when* to snapshot (an IVF index's first add, a WAL
grown past ``compact_bytes``, close) and replays the records; the steps that keep every moment loadable are here, in
one place, apart from the index's mutations and searches. ``msn-index migrate`` reads a directory through
:func:`saved` too, which changes nothing, so the two readers cannot disagree about what an index holds.
"""
from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.durable import atomic_write, quarantine, remove_durably, replace_dir
from msn_serve.indexes.config import IndexConfig, build_index
from msn_serve.indexes.files import INDEX_FILE, STATE_FILE, read_index_dir
from msn_serve.indexes.metadata import Metadata
from msn_serve.indexes.wal import WriteAheadLog

log = logging.getLogger("msn_serve.indexes")
CONFIG, SNAPSHOT, WAL = "config.json", "snapshot.npz", "wal.log"


@dataclass
class Saved:
    """An index as its directory holds it: the state of its snapshot (or built files) and the valid WAL records, of
    which those numbered above ``seq`` are still to be replayed; ``wal_valid`` bytes of the WAL hold them and
    ``wal_problem`` says what follows (``None``: nothing)."""

    cfg: IndexConfig
    index: faiss.Index | None
    metadata: dict[int, Any]
    seq: int
    ids: set[int]
    records: list[tuple[int, bytes]]
    wal_valid: int
    wal_problem: str | None


def create(path: Path, cfg: IndexConfig) -> None:
    """Make the directory in a staging directory and swap it in, so a failed create (full disk) leaves nothing
    a restart would load or quarantine."""
    with replace_dir(path, replace=False) as staging:
        atomic_write(staging / CONFIG, json.dumps(asdict(cfg), indent=1).encode())
        os.close(os.open(staging / WAL, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


def saved(path: Path, *, with_index: bool = True) -> Saved:
    """What a directory holds, changing nothing; a corrupt config or snapshot raises. ``with_index=False`` skips the
    FAISS index (``index`` is ``None``): ``msn-index migrate`` reads the ids and metadata only."""
    cfg = IndexConfig(**json.loads((path / CONFIG).read_text()))
    index, metadata, seq, ids = None, {}, 0, set()
    if (path / SNAPSHOT).exists():
        with np.load(path / SNAPSHOT, allow_pickle=False) as z:
            if with_index:
                index = faiss.deserialize_index(np.ascontiguousarray(z["index"]))
            meta = json.loads(bytes(z["meta"]).decode())
            ids = set(np.asarray(z["ids"], dtype=np.int64).tolist())
        if index is not None and len(ids) != index.ntotal:
            raise ValueError(f"snapshot has {index.ntotal} vectors but {len(ids)} ids")
        metadata = {int(k): v for k, v in meta["metadata"].items()}
        seq = int(meta["seq"])
        if "config" in meta:  # an auto index's current kind and tuning, as of this snapshot
            cfg = IndexConfig(**meta["config"])
        if index is not None and index.d != cfg.dim:
            raise ValueError(f"snapshot dim {index.d} != config dim {cfg.dim}")
    elif (path / INDEX_FILE).exists():  # built by msn-index: in memory for the writer, which mutates it
        _, index, id_arr, metadata, seq = read_index_dir(path, mmap=not with_index)
        ids = set(id_arr.tolist())
    if not with_index:
        index = None
    elif index is None:
        index = build_index(cfg)
    records, valid, problem = WriteAheadLog.read(path / WAL)
    return Saved(cfg, index, metadata, seq, ids, records, valid, problem)


def load(path: Path, data_dir: Path) -> Saved:
    """:func:`saved`, and the WAL cut to its valid prefix: a corrupt record is quarantined (a copy of the log) and
    what follows it dropped, as is a torn tail (an unacknowledged write)."""
    state = saved(path)
    if state.wal_problem is not None:
        if state.wal_problem.startswith("torn tail"):
            log.warning("%s: WAL %s; dropping the unacknowledged tail", path.name, state.wal_problem)
        else:
            quarantine(data_dir, _copy(path / WAL), f"WAL {state.wal_problem}; replaying the valid prefix")
        with open(path / WAL, "r+b") as f:
            f.truncate(state.wal_valid)
    return state


def write(path: Path, cfg: IndexConfig, index: faiss.Index, ids: set[int], metadata: Metadata, seq: int) -> None:
    """Replace ``snapshot.npz`` with this state, then an auto index's ``config.json`` and a built index's files.
    The caller empties the WAL after: a failure at any step leaves a state that loads (the old snapshot + the whole
    WAL, or the new snapshot + records it already holds)."""
    meta = f'{{"seq":{int(seq)},"config":{json.dumps(asdict(cfg))},"metadata":{metadata.to_json()}}}'
    buf = io.BytesIO()
    np.savez(buf, index=faiss.serialize_index(index), meta=np.frombuffer(meta.encode(), np.uint8),
             ids=np.fromiter(ids, dtype=np.int64, count=len(ids)))
    atomic_write(path / SNAPSHOT, buf.getvalue())
    if cfg.auto:  # its kind changes; the snapshot (written first) is what saved() trusts
        atomic_write(path / CONFIG, json.dumps(asdict(cfg), indent=1).encode())
    for stale in (INDEX_FILE, STATE_FILE):  # a built index's files are superseded by the snapshot
        if (path / stale).exists():
            remove_durably(path / stale)


def _copy(path: Path) -> Path:
    """A copy to quarantine: the original is cut to its valid prefix and kept in use."""
    dest = path.with_name(path.name + ".corrupt-copy")
    dest.write_bytes(path.read_bytes())
    return dest
