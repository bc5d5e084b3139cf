"""Filling a Milvus index offline, checked: ``msn-index migrate --to milvus``, ``msn-index migrate`` of a Milvus index
to another model, and ``msn-embed --index NAME --index-backend milvus`` (:mod:`msn_serve.corpus.to_milvus`).

Every copy goes into a collection marked ``msn.state = migrating``, is flushed, read back and compared with what was
sent (every id, its vector to float32 rounding, its metadata) before anything else changes; only then is the source
retired (a FAISS directory moved to ``<data-dir>/backups/indexes/``, an older collection renamed ``msnbak_...``)
and the copy marked ``ready``. A copy killed before that is left ``migrating`` beside an intact source: msn-serve
keeps serving the source and the next run drops the copy and starts again. The server must be stopped (the data
directory's lock is taken by the callers).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import fsync_path
from msn_serve.errors import ApiError
from msn_serve.indexes.config import IndexConfig
from msn_serve.indexes.metadata import Texts
from msn_serve.indexes.milvus import PREFIX, MilvusConnection, MilvusIndex, collection_name

BATCH = 2048


class CopyError(Exception):
    """The copy cannot be made or did not arrive whole; reported as one line."""


def milvus_config(cfg: IndexConfig) -> IndexConfig:
    """The kind a FAISS index becomes on Milvus: flat, ivf and hnsw stay; auto becomes flat (Milvus tunes its own)."""
    if cfg.type == "ivfpq":
        raise CopyError("an ivfpq index keeps compressed codes, not its vectors: rebuild it from the msn-embed shards "
                        "(msn-embed --index NAME --index-backend milvus) instead")
    return replace(cfg, type="flat", auto=False, tuned_at=0) if cfg.auto else cfg


def copy_checked(conn: MilvusConnection, name: str, cfg: IndexConfig, feature: str, ids: np.ndarray,
                 vecs: np.ndarray, meta: dict[int, Any], *, collection: str | None = None) -> MilvusIndex:
    """A new ``migrating`` collection holding exactly ``ids``/``vecs``/``meta`` (values, JSON-serialisable)."""
    coll = collection or collection_name(name)
    if conn.client.has_collection(coll):
        props = conn.client.describe_collection(coll).get("properties", {})
        if props.get("msn.state") != "migrating":
            raise CopyError(f"index {name!r} already exists in {conn.describe()} (collection {coll!r})")
        conn.client.drop_collection(coll)  # an interrupted copy's leftover
    idx = MilvusIndex.create(conn, name, cfg, feature=feature, state="migrating", collection=coll)
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
    return idx


def faiss_to_milvus(path: Path, data_dir: Path, uri: str) -> dict[str, Any]:
    """``msn-index migrate --to milvus``: the FAISS index at ``path`` becomes a Milvus collection of the same name,
    the directory kept in the backups once every id arrived."""
    from msn_serve.indexes.managed import ManagedIndex

    faiss_idx = ManagedIndex.load(path, data_dir)  # what msn-serve would serve: snapshot + WAL
    try:
        try:
            ids, vecs = faiss_idx.stored_vectors()
        except ApiError as e:
            raise CopyError(e.message) from None
        meta = {i: faiss_idx.metadata.value(i) for i in ids.tolist()}
        cfg = milvus_config(faiss_idx.cfg)
    finally:
        faiss_idx.wal.close()
    conn = MilvusConnection(uri)
    try:
        idx = copy_checked(conn, path.name, cfg, "", ids, vecs, meta)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        backup = data_dir / "backups" / "indexes" / f"{path.name}.faiss.{stamp}"
        backup.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, backup)  # the commit point: msn-serve now finds the Milvus copy only
        fsync_path(path.parent)
        fsync_path(backup.parent)
        idx.set_state("ready")
    finally:
        conn.close()
    return {"name": path.name, "to": "milvus", "uri": conn.uri if conn.lite else "server", "ids": len(ids),
            "type": cfg.type, "model_id": cfg.model_id, "backup": str(backup)}


def reembed_milvus(args: Any, conn: MilvusConnection, embed_files, image_base) -> int:
    """``msn-index migrate`` of a Milvus index to ``--bundle``'s model: re-embed from stored paths into a new
    collection, checked, then swap the names (the old collection kept as ``msnbak_<name>_<time>``)."""
    from msn_core.bundle import load_bundle_info

    old = MilvusIndex.open(conn, args.name)
    target = load_bundle_info(args.bundle)
    if old.cfg.model_id == target.model_id:
        print(f"msn-index: index {args.name!r} was already made with model {target.model_id!r}; nothing to do",
              file=sys.stderr)
        return 0
    ids = sorted(old.ids)
    meta = {i: json.loads(t) for i, t in old.metadata_texts(ids).items() if t is not None}
    base = image_base
    files, missing = [], {}
    for i in ids:
        p = meta.get(i, {}).get("path") if isinstance(meta.get(i), dict) else None
        if not isinstance(p, str) or not p:
            missing[i] = 'no stored path (metadata without a "path")'
        else:
            files.append((i, Path(p) if Path(p).is_absolute() or base is None else base / p))
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
    staging = collection_name(args.name) + "__new"
    new = copy_checked(conn, args.name, cfg, target.feature, np.asarray(done, np.int64), vecs,
                       {i: meta.get(i) for i in done}, collection=staging)
    backup = f"msnbak{old.collection[len(PREFIX) - 1:]}_{time.strftime('%Y%m%dT%H%M%S')}"
    conn.client.rename_collection(old.collection, backup)
    conn.client.rename_collection(staging, collection_name(args.name))
    new.collection = collection_name(args.name)
    new.set_state("ready")
    print(json.dumps({"name": args.name, "backend": "milvus", "from_model": old.cfg.model_id, "to_model": model_id,
                      "ids": len(ids), "re_embedded": len(done), "backup_collection": backup,
                      "config": asdict(cfg)["type"]}))
    return 1 if lost else 0

