"""Filling a Milvus index offline, checked, and swapping it in whole: ``msn-index migrate --to milvus``, ``msn-index
migrate`` of a Milvus index to another model, and ``msn-embed --index NAME --index-backend milvus``
(:mod:`msn_serve.corpus.to_milvus`).

Every copy goes into a new collection (:func:`~msn_serve.indexes.milvus_conn.physical_name`) marked ``msn.state =
migrating``, is flushed, read back and compared with what was sent (every id, its vector to float32 rounding, its
metadata); only then does the index's name move to it (:func:`point`: an alias, one Milvus call), so the name
resolves to the old collection or the new one, whole, at every moment. The old one is kept (``msnbak_<name>_<time>``,
a re-embedding) or dropped (``--overwrite-index``) after the name has moved.

A collection made under the name itself (``POST /index``, or before aliases) must be renamed away before an alias
can take the name: the new collection first records the rename (``msn.swap``), and whoever next lists the indexes
(msn-serve at start-up, any of these commands) points the name at it if a ``kill -9`` fell between the two calls
(:meth:`~msn_serve.indexes.milvus_conn.MilvusConnection.finish_swaps`). A copy killed before its swap is left beside an
intact index, never under its name; the next command drops it (``drop_orphans``) and starts again.

``--to milvus`` has two stores to change: the copy stays ``migrating`` while it is aliased and until the FAISS
directory is in the backups (the commit point), so msn-serve serves the FAISS index until then and refuses the copy
after (409 naming the command) until a second run marks it ``ready``. The server must be stopped (the data
directory's lock is taken by the callers).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import fsync_path
from msn_serve.errors import ApiError
from msn_serve.indexes.config import IndexConfig
from msn_serve.indexes.metadata import Texts
from msn_serve.indexes.milvus import MilvusIndex
from msn_serve.indexes.milvus_conn import (
    BACKUP_PREFIX,
    PREFIX,
    MilvusConnection,
    collection_name,
    milvus_errors,
    physical_name,
)

BATCH = 2048
# Test seam: called with each step's name ("copied", "ready", "journaled", "aside", "pointed", "old_removed",
# "done"); the kill tests make a real process SIGKILL itself there.
_checkpoint: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _checkpoint is not None:
        _checkpoint(name)


class CopyError(Exception):
    """The copy cannot be made or did not arrive whole; reported as one line."""


@contextlib.contextmanager
def milvus_steps(what: str) -> Iterator[None]:
    """A failed Milvus call in an offline command: a :class:`CopyError` naming it (what is done stays done; a
    rerun finishes or redoes the rest)."""
    try:
        with milvus_errors(what):
            yield
    except ApiError as e:
        raise CopyError(e.message) from None


def milvus_config(cfg: IndexConfig) -> IndexConfig:
    """The kind a FAISS index becomes on Milvus: flat, ivf and hnsw stay; auto becomes flat (Milvus tunes its own)."""
    if cfg.type == "ivfpq":
        raise CopyError("an ivfpq index keeps compressed codes, not its vectors: rebuild it from the msn-embed shards "
                        "(msn-embed --index NAME --index-backend milvus) instead")
    return replace(cfg, type="flat", auto=False, tuned_at=0) if cfg.auto else cfg


def copy_checked(conn: MilvusConnection, name: str, cfg: IndexConfig, feature: str, ids: np.ndarray,
                 vecs: np.ndarray, meta: dict[int, Any], *, properties: dict[str, str] | None = None) -> MilvusIndex:
    """A new ``migrating`` collection (not under the name yet) holding exactly ``ids``/``vecs``/``meta`` (values,
    JSON-serialisable)."""
    idx = MilvusIndex.create(conn, name, cfg, feature=feature, state="migrating", collection=physical_name(name),
                             properties=properties)
    texts = {i: json.dumps(v, separators=(",", ":"), ensure_ascii=False) for i, v in meta.items() if v is not None}
    try:
        for lo in range(0, len(ids), BATCH):
            part = ids[lo:lo + BATCH].tolist()
            idx.add(part, vecs[lo:lo + BATCH], Texts(texts.get(i) for i in part))
        idx.flush()
        got_ids, got_vecs = idx.stored_vectors()
        order = np.argsort(ids, kind="stable")
        if not np.array_equal(got_ids, ids[order]):
            lost = sorted(set(ids.tolist()) - set(got_ids.tolist()))
            raise CopyError(f"{len(lost)} ids did not arrive in Milvus (first: {lost[:10]}); nothing was retired")
        from msn_serve.indexes.base import prepare_vectors

        sent = prepare_vectors(cfg, vecs[order]) if len(ids) else got_vecs
        if not np.allclose(got_vecs, sent, rtol=1e-6, atol=1e-6):
            raise CopyError("vectors read back from Milvus differ from those sent; nothing was retired")
        stored = idx.metadata_texts(got_ids.tolist())
        bad = [i for i in got_ids.tolist() if stored[i] != texts.get(i)]
        if bad:
            raise CopyError(f"metadata of {len(bad)} ids differs after the copy (first: {bad[:10]}); nothing was "
                            "retired")
    except ApiError as e:
        raise CopyError(e.message) from None
    _step("copied")
    return idx


def point(conn: MilvusConnection, name: str, new: str, *, backup: str | None = None) -> str | None:
    """Make index ``name`` resolve to collection ``new`` (whole and checked). The collection it resolved to is
    renamed ``backup`` (returned: the name it is kept under), or dropped when ``backup`` is None."""
    c, handle = conn.client, collection_name(name)
    with milvus_steps(f"swap index {name!r}"):
        old = conn.resolve(name)
        if old is None:
            c.create_alias(new, handle)
            _step("pointed")
            return None
        if old == handle:  # a collection under the name: renamed away first, the gap bridged by a record on `new`
            aside = backup or physical_name(name)
            c.alter_collection_properties(new, properties={"msn.swap": json.dumps({"old": aside,
                                                                                   "drop": backup is None})})
            c.load_collection(new)  # altering releases it on Milvus Lite
            _step("journaled")
            c.rename_collection(handle, aside)
            _step("aside")
            c.create_alias(new, handle)
        else:
            aside = old
            if backup is not None and not old.startswith(BACKUP_PREFIX):  # (a rerun finds it renamed already)
                c.rename_collection(old, backup)  # its alias follows: the name still resolves to it
                aside = backup
                _step("aside")
            c.alter_alias(new, handle)
        _step("pointed")
        if backup is None:
            c.drop_collection(aside)
            _step("old_removed")
            return None
        return aside


def faiss_to_milvus(path: Path, data_dir: Path, uri: str) -> dict[str, Any]:
    """``msn-index migrate --to milvus``: the FAISS index at ``path`` becomes a Milvus collection of the same name,
    the directory kept in the backups once every id arrived. A run after one killed midway finishes it (the
    directory already in the backups) or makes the copy again (the directory still there)."""
    name = path.name
    conn = MilvusConnection(uri)
    try:
        with milvus_steps(f"move index {name!r} to Milvus"):
            conn.finish_swaps()
            conn.drop_orphans(name)
            current = conn.resolve(name)
            props = conn.client.describe_collection(current).get("properties", {}) if current else {}
            unfinished = props.get("msn.state") == "migrating"
            if not (path / "config.json").is_file():
                if unfinished:  # the directory went to the backups (the commit point); only the marker is left
                    return _finish_move(conn, name, current, props)
                raise CopyError(f"{path}: no FAISS index to move (expected DATA_DIR/indexes/NAME/config.json)")
            if current is not None and not unfinished:
                raise CopyError(f"index {name!r} exists on FAISS ({path}) and in {conn.describe()}: drop one of "
                                "them")
            ids, vecs, meta, cfg = _faiss_contents(path, data_dir)
            backup = data_dir / "backups" / "indexes" / f"{name}.faiss.{time.strftime('%Y%m%dT%H%M%S')}"
            idx = copy_checked(conn, name, cfg, "", ids, vecs, meta, properties={"msn.source": str(backup)})
            point(conn, name, idx.collection)  # still `migrating`: msn-serve serves the FAISS index while it exists
            backup.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, backup)  # the commit point: msn-serve now finds the Milvus copy only
            fsync_path(path.parent)
            fsync_path(backup.parent)
            _step("aside")
            idx.set_state("ready")
            _step("done")
    finally:
        conn.close()
    return {"name": name, "to": "milvus", "uri": conn.uri if conn.lite else "server", "ids": len(ids),
            "type": cfg.type, "model_id": cfg.model_id, "backup": str(backup)}


def _faiss_contents(path: Path, data_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[int, Any], IndexConfig]:
    """``(ids, vectors, {id: metadata}, config on Milvus)`` of what msn-serve would serve: snapshot + WAL."""
    from msn_serve.indexes.managed import ManagedIndex

    faiss_idx = ManagedIndex.load(path, data_dir)
    try:
        try:
            ids, vecs = faiss_idx.stored_vectors()
        except ApiError as e:
            raise CopyError(e.message) from None
        meta = {i: faiss_idx.metadata.value(i) for i in ids.tolist()}
        return ids, vecs, meta, milvus_config(faiss_idx.cfg)
    finally:
        faiss_idx.wal.close()


def _finish_move(conn: MilvusConnection, name: str, current: str, props: dict[str, str]) -> dict[str, Any]:
    """The last step of a ``--to milvus`` run killed after its commit point: mark the copy ``ready``."""
    with milvus_steps(f"finish moving index {name!r}"):
        conn.client.alter_collection_properties(current, properties={"msn.state": "ready"})
        conn.client.load_collection(current)
        cfg = json.loads(props["msn.config"])
        n = conn.client.query(current, filter="", output_fields=["count(*)"], consistency_level="Strong")
    print(f"msn-index: finished moving index {name!r} to Milvus (an earlier run was interrupted after its "
          "copy was checked)", file=sys.stderr)
    return {"name": name, "to": "milvus", "uri": conn.uri if conn.lite else "server", "ids": int(n[0]["count(*)"]),
            "type": cfg["type"], "model_id": cfg["model_id"], "backup": props.get("msn.source", ""),
            "finished": True}


def reembed_milvus(args: Any, conn: MilvusConnection, embed_files: Callable[..., Any], image_base: Path | None
                   ) -> int:
    """``msn-index migrate`` of a Milvus index to ``--bundle``'s model: re-embed from stored paths into a new
    collection, checked, then move the name to it (the old collection kept as ``msnbak_<name>_<time>``)."""
    from msn_core.bundle import load_bundle_info

    with milvus_steps(f"migrate index {args.name!r}"):
        conn.finish_swaps()
        conn.drop_orphans(args.name)
    try:
        old = MilvusIndex.open(conn, args.name)
    except ApiError as e:
        raise CopyError(e.message) from None
    target = load_bundle_info(args.bundle)
    if old.cfg.model_id == target.model_id:
        print(f"msn-index: index {args.name!r} was already made with model {target.model_id!r}; nothing to do",
              file=sys.stderr)
        return 0
    ids = sorted(old.ids)
    meta = {i: json.loads(t) for i, t in old.metadata_texts(ids).items() if t is not None}
    files, missing = [], {}
    for i in ids:
        p = meta.get(i, {}).get("path") if isinstance(meta.get(i), dict) else None
        if not isinstance(p, str) or not p:
            missing[i] = 'no stored path (metadata without a "path")'
        else:
            files.append((i, Path(p) if Path(p).is_absolute() or image_base is None else image_base / p))
    model_id, dim, done, vecs, failed = embed_files(args.bundle, files, args.threads) if files else \
        (target.model_id, target.embed_dim, [], np.zeros((0, target.embed_dim), np.float32), {})
    lost = {**missing, **failed}
    if lost and not args.allow_partial:
        for i, why in list(lost.items())[:10]:
            print(f"msn-index: cannot re-embed id {i}: {why}", file=sys.stderr)
        print(f"msn-index: error: cannot migrate index {args.name!r} completely ({len(lost)} of {len(ids)} ids); "
              "nothing was changed (--allow-partial writes it without those ids)", file=sys.stderr)
        return 1
    cfg = replace(old.cfg, model_id=model_id, dim=dim)
    new = copy_checked(conn, args.name, cfg, target.feature, np.asarray(done, np.int64), vecs,
                       {i: meta.get(i) for i in done})
    with milvus_steps(f"migrate index {args.name!r}"):
        new.set_state("ready")
    _step("ready")
    backup = f"{BACKUP_PREFIX}{collection_name(args.name)[len(PREFIX):]}_{time.strftime('%Y%m%dT%H%M%S')}"
    backup = point(conn, args.name, new.collection, backup=backup)
    _step("done")
    print(json.dumps({"name": args.name, "backend": "milvus", "from_model": old.cfg.model_id, "to_model": model_id,
                      "ids": len(ids), "re_embedded": len(done), "backup_collection": backup,
                      "config": asdict(cfg)["type"]}))
    return 1 if lost else 0
