"""The memory-mappable on-disk form of one index: ``config.json`` + ``index.faiss`` + ``state.npz``.

``msn-index build`` writes it into ``<data-dir>/indexes/<name>/`` and the writer's ``POST /admin/snapshot`` into
``<data-dir>/published/<version>/indexes/<name>/``. Unlike the writer's ``snapshot.npz`` (FAISS bytes inside an
npz), ``index.faiss`` is a plain ``faiss.write_index`` file, so read-only replicas open it with FAISS' mmap flags
and share the page cache instead of each holding a private copy. Files are written in place and fsync'd; the caller
makes the directory visible atomically (rename of a staging directory, or a ``CURRENT`` pointer).
"""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.durable import fsync_path
from msn_serve.indexes.metadata import Metadata, Texts, to_texts
from msn_serve.jsontext import dumps

CONFIG_FILE, INDEX_FILE, STATE_FILE = "config.json", "index.faiss", "state.npz"
IVF_TYPES = ("ivf", "ivfpq")


def write_index_dir(path: Path, config: dict[str, Any], index: faiss.Index, ids: np.ndarray,
                    metadata: Metadata | dict[int, Any], seq: int, extra: dict[str, bytes] | None = None) -> None:
    """Write the three files (plus ``extra`` name -> bytes) into ``path`` and fsync them and the directory."""
    path.mkdir(parents=True, exist_ok=True)
    if index.ntotal != len(ids):
        raise ValueError(f"index holds {index.ntotal} vectors but {len(ids)} ids were given")
    meta = f'{{"seq":{int(seq)},"metadata":{Metadata.coerce(metadata).to_json()}}}'.encode()
    buf = io.BytesIO()
    np.savez(buf, ids=np.asarray(ids, dtype=np.int64), meta=np.frombuffer(meta, np.uint8))
    files = {CONFIG_FILE: json.dumps(config, indent=1).encode(), STATE_FILE: buf.getvalue(), **(extra or {})}
    for name, data in files.items():
        (path / name).write_bytes(data)
    faiss.write_index(index, str(path / INDEX_FILE))
    for name in [*files, INDEX_FILE]:
        fsync_path(path / name)
    fsync_path(path)


def mmap_flags(kind: str) -> int:
    """FAISS read flags that memory-map ``kind``: IVF inverted lists (``IO_FLAG_MMAP``) or the flat vector
    storage of flat/HNSW indexes (``IO_FLAG_MMAP_IFC``); both read-only (mmap only works on real files)."""
    flag = faiss.IO_FLAG_MMAP if kind in IVF_TYPES else faiss.IO_FLAG_MMAP_IFC
    return flag | faiss.IO_FLAG_READ_ONLY


def read_index_dir(path: Path, *, mmap: bool) -> tuple[dict[str, Any], faiss.Index, np.ndarray, dict[int, Any], int]:
    """``(config, index, ids, metadata, seq)``; raises ``ValueError``/``OSError`` on anything inconsistent."""
    config = json.loads((path / CONFIG_FILE).read_text())
    flags = mmap_flags(config.get("type", "flat")) if mmap else 0
    index = faiss.read_index(str(path / INDEX_FILE), flags)
    with np.load(path / STATE_FILE, allow_pickle=False) as z:
        ids = np.asarray(z["ids"], dtype=np.int64)
        meta = json.loads(bytes(z["meta"]).decode())
    if index.ntotal != len(ids):
        raise ValueError(f"{path}: index has {index.ntotal} vectors but state.npz lists {len(ids)} ids")
    if index.d != int(config["dim"]):
        raise ValueError(f"{path}: index dim {index.d} != config dim {config['dim']}")
    return config, index, ids, {int(k): v for k, v in meta["metadata"].items()}, int(meta["seq"])


def encode_record(op: str, ids: np.ndarray, vecs: np.ndarray | None, texts: Texts | None) -> bytes:
    """One WAL record of a live index: JSON head (op, count, dim, metadata as stored JSON texts), then int64 ids
    and float32 vectors."""
    meta = "null" if texts is None else "[" + ",".join("null" if t is None else t for t in texts) + "]"
    head = (f'{{"op":{dumps(op)},"n":{int(ids.size)},"dim":{0 if vecs is None else int(vecs.shape[1])},'
            f'"metadata":{meta}}}').encode()
    body = ids.astype("<i8").tobytes() + (b"" if vecs is None else vecs.astype("<f4").tobytes())
    return struct.pack("<I", len(head)) + head + body


def decode_record(payload: bytes) -> tuple[str, np.ndarray, np.ndarray | None, Texts | None]:
    (hl,) = struct.unpack_from("<I", payload)
    head = json.loads(payload[4: 4 + hl])
    n, dim = head["n"], head["dim"]
    ids = np.frombuffer(payload, dtype="<i8", count=n, offset=4 + hl).astype(np.int64)
    vecs = None
    if dim:
        vecs = np.frombuffer(payload, dtype="<f4", count=n * dim, offset=4 + hl + 8 * n).reshape(n, dim)
    return head["op"], ids, vecs, to_texts(head["metadata"], n)
