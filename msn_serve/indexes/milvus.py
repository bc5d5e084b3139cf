"""Milvus as an index store: one index in one collection, behind the same interface as FAISS (:mod:`.base`).

Where the collection is found, and how a copy is swapped in under an index's name, is
:mod:`msn_serve.indexes.milvus_conn`'s; the kind of index Milvus builds and each search's knobs are
:mod:`msn_serve.indexes.milvus_tuning`'s. Fields: ``id`` INT64 primary key, ``vector`` FLOAT_VECTOR, ``meta``
VARCHAR (the metadata's JSON text, nullable). Its properties bind it like a FAISS index's ``config.json``:
``msn.config`` (the :class:`IndexConfig`, with ``model_id``), ``msn.feature`` (the bundle's feature), ``msn.index``
(the name) and ``msn.state``: ``ready``, or ``migrating`` while ``msn-index migrate --to milvus`` has not finished,
which is refused when opened (409 naming the command that finishes it). Adds are upserts, so a retried add never
duplicates an id.

Consistency and durability: collections are created with the **Strong** consistency level, so a search sees every
acknowledged write. An insert is acknowledged by Milvus once it is in its write-ahead log (Milvus Lite: its WAL file,
written to the OS before the call returns, so ``kill -9`` of msn-serve, which is also the engine's process, loses
nothing; a server: its message storage). No flush per write (Milvus discourages it: it seals a tiny segment each
time); msn-serve flushes at shutdown and ``msn-index migrate`` after its copy. The id set and metadata sizes are
held in memory (read at start-up) for the same add/replace counts and metadata limits as FAISS: one msn-serve writes
a collection at a time, as one writes a data directory (Milvus Lite enforces it with a file lock).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from msn_serve.errors import ApiError, conflict, not_found, too_large
from msn_serve.indexes.base import check_add, check_ids, hit_lists, prepare_vectors, score_meaning
from msn_serve.indexes.config import IndexConfig
from msn_serve.indexes.metadata import Metadata
from msn_serve.indexes.milvus_conn import (
    MilvusConnection,
    collection_name,
    milvus_errors,
)
from msn_serve.indexes.milvus_tuning import TOPK_MAX, index_params, search_params

log = logging.getLogger("msn_serve.indexes")
META_MAX = 65_535  # bytes of a VARCHAR field
BATCH = 4096  # rows per get/iterator call
UPSERT_BYTES = 32 * 2**20  # per upsert message: half Milvus' 64 MB insert cap, room for the encoding


class NotReady(ApiError):
    """409: the collection under an index's name is a copy ``msn-index migrate --to milvus`` has not finished."""

    def __init__(self, name: str, props: dict[str, Any]):
        source = props.get("msn.source") or "DATA_DIR/backups/indexes/"
        super().__init__(409, f"index {name!r}: its Milvus collection is a copy `msn-index migrate --to milvus` "
                         f"has not finished (msn.state {props.get('msn.state')!r}), so it is not served. To finish "
                         f"it, run `msn-index migrate --data-dir DATA_DIR --name {name} --to milvus` again (while "
                         f"DATA_DIR/indexes/{name} still exists, that redoes the copy); to undo it, move the FAISS "
                         f"index it was copied from, {source}, back to DATA_DIR/indexes/{name} (a name on both "
                         "backends is served from FAISS)")


class MilvusIndex:
    """One index in a Milvus collection (a :class:`~msn_serve.indexes.base.VectorIndex`)."""

    backend = "milvus"
    compact_bytes = 0  # the store sets both; Milvus compacts by itself
    metadata_limit: int | None = None

    def __init__(self, conn: MilvusConnection, name: str, cfg: IndexConfig, *, feature: str = "",
                 collection: str | None = None):
        self.conn, self.client, self.cfg, self.feature = conn, conn.client, cfg, feature
        self._name, self.collection = name, collection or collection_name(name)
        self.ids: set[int] = set()
        self._meta_bytes: dict[int, int] = {}  # id -> bytes of its metadata (ids with some)
        self.lock = threading.RLock()
        self.meta_total = 0
        self.seq, self.created, self.closed = 0, time.time(), False
        self.physical = self.collection  # the collection behind the name (an alias') when opened

    @property
    def name(self) -> str:
        return self._name

    @property
    def ntotal(self) -> int:
        """Items stored. Milvus Lite has one process, this one, so its own count is exact; a Milvus server may be
        written by other msn-serve processes, so there the engine counts (Strong consistency: every acknowledged
        write of any of them)."""
        if self.conn.lite:
            return len(self.ids)
        with milvus_errors(f"count index {self.name!r}"):
            rows = self.client.query(self.collection, filter="", output_fields=["count(*)"],
                                     consistency_level="Strong")
        return int(rows[0]["count(*)"])

    def _present(self, ids: list[int]) -> set[int]:
        """Which of ``ids`` are stored: this process' record on Milvus Lite, the engine's on a shared server."""
        if self.conn.lite:
            return {i for i in ids if i in self.ids}
        found: set[int] = set()
        for lo in range(0, len(ids), BATCH):
            rows = self.client.get(self.collection, ids=ids[lo:lo + BATCH], output_fields=["id"])
            found.update(int(r["id"]) for r in rows)
        return found

    # ---- create, open, drop, close --------------------------------------------------------------------------
    @classmethod
    def create(cls, conn: MilvusConnection, name: str, cfg: IndexConfig, *, feature: str = "",
               state: str = "ready", collection: str | None = None,
               properties: dict[str, str] | None = None) -> MilvusIndex:
        """A new collection (``collection``: a :func:`~.milvus_conn.physical_name`, for a copy swapped in later by
        an alias; ``properties``: more of them, e.g. ``msn.source``)."""
        from pymilvus import DataType

        c, coll = conn.client, collection or collection_name(name)
        if c.has_collection(coll):  # not one this server loaded: another writer's, or another server's
            raise conflict(f"index {name!r} already exists in {conn.describe()} (collection {coll!r})")
        schema = c.create_schema(auto_id=False, enable_dynamic_field=False,
                                 description=f"msn-serve index {name!r} of model {cfg.model_id!r}")
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=cfg.dim)
        schema.add_field("meta", DataType.VARCHAR, max_length=META_MAX, nullable=True)
        params = index_params(c, cfg)
        with milvus_errors(f"create index {name!r}"):
            c.create_collection(coll, schema=schema, consistency_level="Strong",
                                properties={**_properties(name, cfg, feature, state), **(properties or {})})
            # not waited for: pymilvus' wait asks for a timestamp Milvus Lite does not serve (an error logged and
            # half a second lost per create); loading the collection waits for the index anyway
            c.create_index(coll, params, sync=False)
            c.load_collection(coll)
        return cls(conn, name, cfg, feature=feature, collection=coll)

    @classmethod
    def open(cls, conn: MilvusConnection, name: str) -> MilvusIndex:
        """Load the collection ``name`` resolves to and (Milvus Lite: this process is its only writer) read its ids
        and metadata sizes; raises when it is not one of ours, 404 when there is none and :class:`NotReady` (409)
        when it is an unfinished copy. On a server the engine is asked instead, so opening reads nothing per item
        however large the collection. Reads and writes go through the name (an alias follows a swap)."""
        c, coll = conn.client, collection_name(name)
        physical = conn.resolve(name)
        if physical is None:
            raise not_found(f"no index {name!r} in {conn.describe()}")
        props = c.describe_collection(physical).get("properties", {})
        if "msn.config" not in props:
            raise ValueError(f"collection {physical!r} has no msn.config property: not an msn-serve index")
        if props.get("msn.state", "ready") != "ready":
            raise NotReady(name, props)
        cfg = IndexConfig(**json.loads(props["msn.config"]))
        c.load_collection(coll)
        idx = cls(conn, name, cfg, feature=props.get("msn.feature", ""))
        idx.physical = physical
        if not conn.lite:
            return idx
        it = c.query_iterator(coll, batch_size=BATCH, filter="id >= 0", output_fields=["id", "meta"])
        try:
            while rows := it.next():
                for r in rows:
                    idx.ids.add(int(r["id"]))
                    if r.get("meta") is not None:
                        idx._meta_bytes[int(r["id"])] = size = len(r["meta"].encode())
                        idx.meta_total += size
        finally:
            it.close()
        return idx

    def set_state(self, state: str) -> None:
        """``msn.state``: ``migrating`` while ``msn-index migrate --to milvus`` copies into it, then ``ready``."""
        with milvus_errors(f"mark index {self.name!r} {state}"):
            self.client.alter_collection_properties(self.collection, properties={"msn.state": state})
            self.client.load_collection(self.collection)  # altering releases it on Milvus Lite

    def drop(self) -> None:
        """Drop the name (the alias first: a Milvus server refuses to drop an aliased collection) and its data."""
        with self.lock, milvus_errors(f"delete index {self.name!r}"):
            target = self.conn.aliases().get(self.collection)
            if target is not None:
                self.client.drop_alias(self.collection)
            self.client.drop_collection(target or self.collection)
            self.closed = True

    def flush(self) -> None:
        with self.lock, milvus_errors(f"flush index {self.name!r}"):
            self.client.flush(self.collection)

    def close(self) -> None:
        """Seal what the WAL holds into segments (not needed for durability; a faster next start)."""
        with self.lock:
            if not self.closed:
                try:
                    self.flush()
                except ApiError:
                    log.warning("index %s: flush at shutdown failed; Milvus replays its WAL", self.name)
                self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise not_found(f"index {self.name!r} was deleted")

    # ---- writes ---------------------------------------------------------------------------------------------
    def add(self, ids: Any, vecs: np.ndarray, metadata: list | None = None) -> dict[str, int]:
        arr, v, texts = check_add(self.cfg, ids, vecs, metadata)
        sizes = [0 if t is None else len(t.encode()) for t in (texts or [None] * arr.size)]
        if max(sizes) > META_MAX:
            j = int(np.argmax(sizes))
            raise too_large(f"metadata of id {int(arr[j])} is {sizes[j]} bytes; a Milvus index holds at most "
                            f"{META_MAX} bytes per id (a VARCHAR field)")
        id_list = arr.tolist()
        with self.lock, milvus_errors(f"add to index {self.name!r}"):
            self._check_open()
            present = len(self._present(id_list))
            total = self.meta_total + sum(sizes) - sum(self._meta_bytes.get(i, 0) for i in id_list)
            if self.metadata_limit is not None and self.conn.lite and total > self.metadata_limit:
                raise too_large(f"index {self.name!r} would hold more than {self.metadata_limit} bytes of "
                                "metadata (max_index_metadata_mb)")
            rows = [{"id": i, "vector": row, "meta": None if texts is None else texts[j]}
                    for j, (i, row) in enumerate(zip(id_list, v.tolist(), strict=True))]
            for chunk in _chunks(rows, sizes, self.cfg.dim):  # one gRPC message each, under Milvus' 64 MB insert cap
                self.client.upsert(self.collection, chunk)
            self.seq += 1
            self.ids.update(id_list)
            self.meta_total = total
            for i, size in zip(id_list, sizes, strict=True):
                if size:
                    self._meta_bytes[i] = size
                else:
                    self._meta_bytes.pop(i, None)
        return {"added": arr.size - present, "replaced": present}

    def remove(self, ids: Any) -> dict[str, Any]:
        arr = check_ids(ids)
        with self.lock, milvus_errors(f"delete from index {self.name!r}"):
            self._check_open()
            stored = self._present(arr.tolist())
            present = [i for i in arr.tolist() if i in stored]
            missing = sorted(set(arr.tolist()) - set(present))
            if present:
                self.client.delete(self.collection, ids=present)
                self.seq += 1
                self.ids.difference_update(present)
                for i in present:
                    self.meta_total -= self._meta_bytes.pop(i, 0)
        return {"removed": len(present), "not_found": missing}

    # ---- reads ----------------------------------------------------------------------------------------------
    def query(self, vecs: np.ndarray, k: int, nprobe: int | None = None,
              ef_search: int | None = None) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        q = prepare_vectors(self.cfg, vecs)
        if len(q) > TOPK_MAX:
            raise too_large(f"{len(q)} queries: Milvus answers at most {TOPK_MAX} per search")
        with self.lock:
            self._check_open()
            k = int(k)  # not capped by this process' count: on a server, other processes may have added since
            if k <= 0:
                return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64), {}
            params = search_params(self.cfg, k, nprobe, ef_search)
            with milvus_errors(f"search index {self.name!r}"):
                res = self.client.search(self.collection, data=q.tolist(), limit=k, output_fields=["meta"],
                                         search_params=params)
        width = max((len(hits) for hits in res), default=0)  # k' = min(k, stored), as FAISS answers
        scores, labels = np.zeros((len(q), width), np.float32), np.full((len(q), width), -1, np.int64)
        texts: dict[int, str] = {}
        for r, hits in enumerate(res):
            for j, h in enumerate(hits):
                labels[r, j], scores[r, j] = int(h["id"]), float(h["distance"])
                meta = (h.get("entity") or {}).get("meta")
                if meta is not None:
                    texts[int(h["id"])] = meta
        return scores, labels, texts

    def search(self, vecs: np.ndarray, k: int, nprobe: int | None = None, ef_search: int | None = None) -> list:
        return hit_lists(*self.query(vecs, k, nprobe, ef_search))

    def _rows(self, ids: list[int], field: str) -> Iterator[dict[str, Any]]:
        for lo in range(0, len(ids), BATCH):
            with milvus_errors(f"read index {self.name!r}"):
                yield from self.client.get(self.collection, ids=ids[lo:lo + BATCH], output_fields=[field])

    def stored_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every vector, as stored (FLAT, IVF_FLAT and HNSW all keep them raw), read by id."""
        with self.lock:
            self._check_open()
            ids = sorted(self.ids)
            got = {int(r["id"]): r["vector"] for r in self._rows(ids, "vector")}
        if len(got) != len(ids):
            raise ApiError(503, f"index {self.name!r}: Milvus gave back {len(got)} of {len(ids)} vectors")
        vecs = np.asarray([got[i] for i in ids], dtype=np.float32).reshape(len(ids), self.cfg.dim)
        return np.asarray(ids, dtype=np.int64), vecs

    def metadata_texts(self, ids: list[int]) -> dict[int, str | None]:
        out: dict[int, str | None] = dict.fromkeys(ids)
        wanted = [i for i in ids if i in self._meta_bytes]
        out.update({int(r["id"]): r.get("meta") for r in self._rows(wanted, "meta")})
        return out

    def export(self, dest: Path) -> None:
        """The published form is FAISS' (read-only replicas serve an exact flat copy of the collection)."""
        from msn_serve.indexes.config import build_index
        from msn_serve.indexes.files import write_index_dir

        with self.lock:
            ids, vecs = self.stored_vectors()
            cfg = IndexConfig(**{**asdict(self.cfg), "type": "flat"})
            index = build_index(cfg)
            if len(ids):
                index.add_with_ids(np.ascontiguousarray(vecs), ids)
            meta = self.metadata_texts(ids.tolist())
            write_index_dir(dest, asdict(cfg), index, ids, Metadata({i: t for i, t in meta.items() if t}), self.seq)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"name": self.name, "backend": self.backend, **asdict(self.cfg), "ntotal": self.ntotal,
                    "device": "milvus", "auto_tuning": None, "trained": True,
                    # one process' record: exact on Milvus Lite; a server's writers each see only their own
                    "with_metadata": len(self._meta_bytes) if self.conn.lite else None,
                    "metadata_bytes": self.meta_total if self.conn.lite else None,
                    "wal_bytes": 0, "seq": self.seq,
                    "milvus": {"collection": self.collection, "physical": self.physical, "feature": self.feature,
                               "consistency": "Strong",
                               "lite": self.conn.lite},
                    "score": score_meaning(self.cfg)}


def _chunks(rows: list[dict[str, Any]], meta_sizes: list[int], dim: int) -> Iterator[list[dict[str, Any]]]:
    """``rows`` in runs of at most ``UPSERT_BYTES`` (vectors and metadata): a 256,000 x 384 add in one upsert is a
    400 MB message, which Milvus refuses (its gRPC cap is 256 MB, its insert cap 64 MB). An add split this way is
    not atomic; a retry after a failure is safe (upserts)."""
    start, size = 0, 0
    for j, meta in enumerate(meta_sizes):
        row = 8 + 4 * dim + meta
        if j > start and size + row > UPSERT_BYTES:
            yield rows[start:j]
            start, size = j, 0
        size += row
    if start < len(rows):
        yield rows[start:]


def _properties(name: str, cfg: IndexConfig, feature: str, state: str) -> dict[str, str]:
    return {"msn.index": name, "msn.config": json.dumps(asdict(cfg)), "msn.feature": feature, "msn.state": state}
