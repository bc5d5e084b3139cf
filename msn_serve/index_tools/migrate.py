"""``msn-index migrate``: re-embed an index for another model from the images it was built from.

An index holds one model's vectors; a server running another model refuses it (409, :class:`ModelMismatch`). When
the index kept each image's path as metadata (``msn-index build --store-paths``, or ``{"path": ...}`` metadata sent
with ``POST /index/{name}/add``), this tool embeds those images again with the new bundle, through the server's own
engine and preprocessing (so the vectors are exactly what ``msn-serve`` computes; no torch), and replaces the index
**in place**: the new index is written in a staging directory and swapped in by
:func:`msn_core.durable.replace_dir`, the old one moved to ``<data-dir>/backups/indexes/<name>.<old model>.<time>``
(after ``kill -9`` at any moment the next ``msn-index`` or ``msn-serve`` finds the old index or the new one at the
path, and the old one in the backups once the new one is in). The options, ids and metadata stay; only
``model_id`` (and ``dim``, if the width changed) change.

Ids without a stored path, or whose file cannot be read, cannot be re-embedded: they are counted and listed, nothing
is changed, and the exit status is 1, unless ``--allow-partial`` writes the index without them (still exit status 1,
with the counts). The server must be stopped (the data directory's lock is taken).

A Milvus index (:mod:`msn_serve.indexes.milvus`) is migrated the same way, into a new collection swapped in under
its name by an alias (:mod:`msn_serve.index_tools.milvus_copy`: the name resolves to the old collection or the new one,
whole, at every step). ``--to milvus`` instead moves a FAISS index, as it is (ids, vectors, metadata, model), into a
Milvus collection of the same name, checked id by id before the FAISS directory goes to the backups; a run killed
midway is finished or redone by running it again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from msn_core.bundle import load_bundle_info
from msn_core.durable import lock_data_dir, recover_dir, replace_dir
from msn_serve.errors import ApiError
from msn_serve.indexes import persist
from msn_serve.indexes.config import IndexConfig, build_index
from msn_serve.indexes.files import decode_record, write_index_dir
from msn_serve.indexes.metadata import Metadata

BATCH = 64
MAX_PIXELS = 40_000_000  # msn-serve's default max_image_pixels


class MigrateError(Exception):
    """Unusable input or options; reported as one line."""


def read_contents(path: Path) -> tuple[IndexConfig, list[int], dict[int, Any]]:
    """``(config, ids, {id: metadata value})`` of a writer's index directory, read without changing a byte (the
    snapshot or built files, then the WAL's valid records, as msn-serve replays them, on the id set and metadata
    only)."""
    state = persist.saved(path, with_index=False)
    ids, meta = state.ids, state.metadata
    for rseq, payload in state.records:
        if rseq <= state.seq:
            continue
        op, rec_ids, _, texts = decode_record(payload)
        for j, i in enumerate(rec_ids.tolist()):
            if op == "add":
                ids.add(i)
                text = None if texts is None else texts[j]
                meta.pop(i, None)
                if text is not None:
                    meta[i] = json.loads(text)
            else:
                ids.discard(i)
                meta.pop(i, None)
    return state.cfg, sorted(ids), meta


def image_base(path: Path, given: Path | None) -> Path | None:
    """Where relative paths point: ``--image-root``, else the folder ``msn-index build`` recorded."""
    if given is not None:
        return given
    info = path / "build_info.json"
    if info.is_file():
        base = json.loads(info.read_text()).get("image_base")
        return Path(base) if base else None
    return None


def stored_path(value: Any, base: Path | None) -> Path | None:
    if not isinstance(value, dict) or not isinstance(value.get("path"), str) or not value["path"]:
        return None
    p = Path(value["path"])
    return p if p.is_absolute() or base is None else base / p


def embed_files(bundle: Path, files: list[tuple[int, Path]], threads: int
                ) -> tuple[str, int, list[int], np.ndarray, dict[int, str]]:
    """``(model_id, dim, embedded ids, vectors, {id: why not})`` through msn-serve's engine and preprocessing."""
    from msn_serve.embedding.engine import Engine  # onnxruntime only when there is something to embed
    from msn_serve.embedding.preprocess import preprocess_bytes

    info = load_bundle_info(bundle)
    engine = Engine(info, intra_op_threads=threads)
    keep = np.arange(info.num_patches, dtype=np.int64)
    done, chunks, failed = [], [], {}
    for lo in range(0, len(files), BATCH):
        pixels, batch_ids = [], []
        for i, file in files[lo:lo + BATCH]:
            try:
                pixels.append(preprocess_bytes(file.read_bytes(), info.preprocessing, max_pixels=MAX_PIXELS,
                                               what=str(file)))
                batch_ids.append(i)
            except (OSError, ApiError) as e:
                failed[i] = f"{file}: {getattr(e, 'message', None) or e}"
        if pixels:
            x = np.stack(pixels)
            chunks.append(np.asarray(engine.run(x, np.broadcast_to(keep, (len(x), keep.size)).copy()), np.float32))
            done += batch_ids
    vecs = np.concatenate(chunks) if chunks else np.zeros((0, info.embed_dim), np.float32)
    return info.model_id, int(info.embed_dim), done, vecs, failed


def fill(cfg: IndexConfig, ids: list[int], vecs: np.ndarray) -> faiss.Index:
    index = build_index(cfg)
    v = np.ascontiguousarray(vecs, dtype=np.float32)
    if cfg.normalize and len(v):
        v = v.copy()
        faiss.normalize_L2(v)
    if not index.is_trained:
        if len(v) < max(cfg.nlist, 1):
            raise MigrateError(f"a {cfg.type} index trains on its vectors: {len(v)} re-embedded, it needs at least "
                               f"nlist={cfg.nlist}")
        index.train(v)
    if len(v):
        index.add_with_ids(v, np.asarray(ids, dtype=np.int64))
    return index


def migrate(args: argparse.Namespace) -> int:
    path = args.data_dir / "indexes" / args.name
    try:
        lock = lock_data_dir(args.data_dir, owner="msn-serve")
    except OSError as e:
        raise MigrateError(f"{e}: stop msn-serve first, then start it again to load the migrated index") from None
    try:
        recover_dir(path)  # an earlier build or migrate killed mid-swap: its index is the one there is
        uri = args.milvus_uri or str(args.data_dir / "milvus.db")
        if args.to == "milvus":
            return _to_milvus(path, args.data_dir, uri)
        if not (path / "config.json").is_file():
            if args.milvus_uri or Path(uri).exists():
                return _milvus_reembed(args, uri)
            raise MigrateError(f"{path}: no such index (expected DATA_DIR/indexes/NAME/config.json)")
        if args.bundle is None:
            raise MigrateError("give --bundle (the model to migrate to) or --to milvus")
        return _migrate(args, path)
    finally:
        os.close(lock)


def _to_milvus(path: Path, data_dir: Path, uri: str) -> int:
    from msn_serve.index_tools.milvus_copy import CopyError, faiss_to_milvus

    if not (path / "config.json").is_file() and not Path(uri).exists() and "://" not in uri:
        raise MigrateError(f"{path}: no FAISS index to move (expected DATA_DIR/indexes/NAME/config.json)")
    try:  # no FAISS directory: an earlier run may have moved it and been killed before marking the copy ready
        out = faiss_to_milvus(path, data_dir, uri)
    except CopyError as e:
        raise MigrateError(str(e)) from None
    print(json.dumps(out))
    print(f"msn-index: index {path.name!r} moved to Milvus ({out['ids']} ids, every one checked); the FAISS "
          f"directory is kept in {out['backup']}", file=sys.stderr)
    return 0


def _milvus_reembed(args: argparse.Namespace, uri: str) -> int:
    from msn_serve.index_tools.milvus_copy import CopyError, reembed_milvus
    from msn_serve.indexes.milvus_conn import MilvusConnection

    if args.bundle is None:
        raise MigrateError("give --bundle: the model to migrate the Milvus index to")
    conn = MilvusConnection(uri)
    try:
        if args.name not in conn.collections():
            raise MigrateError(f"no index {args.name!r} on FAISS ({args.data_dir / 'indexes'}) or in "
                               f"{conn.describe()}")
        return reembed_milvus(args, conn, embed_files, args.image_root)
    except CopyError as e:
        raise MigrateError(str(e)) from None
    finally:
        conn.close()


def _migrate(args: argparse.Namespace, path: Path) -> int:
    cfg, ids, meta = read_contents(path)
    target = load_bundle_info(args.bundle).model_id
    if cfg.model_id == target:
        print(f"msn-index: index {args.name!r} was already made with model {target!r}; nothing to do", file=sys.stderr)
        return 0
    base = image_base(path, args.image_root)
    files, missing = [], {}
    for i in ids:
        p = stored_path(meta.get(i), base)
        if p is None:
            missing[i] = "no stored path (metadata without a \"path\")"
        else:
            files.append((i, p))
    if files:
        model_id, dim, done, vecs, failed = embed_files(args.bundle, files, args.threads)
    else:
        dim = int(load_bundle_info(args.bundle).embed_dim)
        model_id, done, vecs, failed = target, [], np.zeros((0, dim), np.float32), {}
    lost = {**missing, **failed}
    summary = (f"{len(ids)} ids: {len(done)} re-embedded, {len(missing)} without a stored path, "
               f"{len(failed)} unreadable")
    if lost and not args.allow_partial:
        _report_lost(lost)
        print(f"msn-index: error: cannot migrate index {args.name!r} completely ({summary}); nothing was changed "
              "(--allow-partial writes it without those ids)", file=sys.stderr)
        return 1
    new_cfg = replace(cfg, model_id=model_id, dim=dim)
    index = fill(new_cfg, done, vecs)
    kept = {i: meta[i] for i in done if i in meta}
    backup = _swap(path, args.data_dir, new_cfg, index, done, kept, old_model=cfg.model_id)
    print(json.dumps({"name": args.name, "from_model": cfg.model_id, "to_model": model_id, "ids": len(ids),
                      "re_embedded": len(done), "without_path": len(missing), "unreadable": len(failed),
                      "backup": str(backup)}))
    if lost:
        _report_lost(lost)
        print(f"msn-index: warning: index {args.name!r} migrated without {len(lost)} ids ({summary}); old index "
              f"kept in {backup}", file=sys.stderr)
        return 1
    print(f"msn-index: index {args.name!r} migrated to model {model_id!r} ({summary}); old index kept in {backup}",
          file=sys.stderr)
    return 0


def _report_lost(lost: dict[int, str], shown: int = 10) -> None:
    for i, why in list(lost.items())[:shown]:
        print(f"msn-index: cannot re-embed id {i}: {why}", file=sys.stderr)
    if len(lost) > shown:
        print(f"msn-index: ... and {len(lost) - shown} more", file=sys.stderr)


def _swap(path: Path, data_dir: Path, cfg: IndexConfig, index: faiss.Index, ids: list[int], meta: dict[int, Any],
          *, old_model: str) -> Path:
    """Write the new index in a staging directory and swap it in, the old one moved to the backups."""
    extra = {}
    if (path / "build_info.json").is_file():
        extra["build_info.json"] = (path / "build_info.json").read_bytes()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    backup = data_dir / "backups" / "indexes" / f"{path.name}.{old_model or 'unknown'}.{stamp}"
    with replace_dir(path, keep_old=backup) as staging:
        write_index_dir(staging, asdict(cfg), index, np.asarray(ids, dtype=np.int64), Metadata.coerce(meta), 0,
                        extra=extra)
    return backup


def add_parser(sub: Any) -> None:
    m = sub.add_parser("migrate", help="re-embed an index for another model from its images' stored paths")
    m.add_argument("--data-dir", type=Path, required=True, help="msn-serve data directory (server stopped)")
    m.add_argument("--name", required=True, help="index name")
    m.add_argument("--bundle", type=Path, help="the bundle msn-serve will run (re-embeds the index for it)")
    m.add_argument("--to", choices=["milvus"], help="instead: move the FAISS index as it is into Milvus")
    m.add_argument("--milvus-uri", help="Milvus Lite PATH.db or server URL (default DATA_DIR/milvus.db, as "
                   "msn-serve)")
    m.add_argument("--image-root", type=Path, help="where relative paths point (default: the folder msn-index "
                   "build recorded)")
    m.add_argument("--allow-partial", action="store_true", help="write the index without the ids that cannot be "
                   "re-embedded (exit status still 1)")
    m.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all cores)")


def run(args: argparse.Namespace) -> int:
    try:
        return migrate(args)
    except (MigrateError, ValueError) as e:  # BundleError and MilvusUnavailable are ValueErrors
        print(f"msn-index: error: {e}", file=sys.stderr)
        return 2
