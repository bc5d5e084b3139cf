"""Versioned snapshots: the writer publishes, read-only replicas load (one writer, N readers on one volume).

Layout under the data directory::

    published/CURRENT                                   the newest complete version's name (replaced atomically)
    published/<version>/manifest.json                   version, model_id, per-index ntotal/seq, classifier names
    published/<version>/indexes/<name>/{config.json,index.faiss,state.npz}   (msn_serve.indexes.files)
    published/<version>/classifiers/<name>.npz

A version is written in a staging directory, every file fsync'd and renamed into place
(:func:`msn_core.durable.replace_dir`), and only then named in ``CURRENT``: a reader that follows ``CURRENT`` can
never see a partial version. Versions are never modified; old ones are deleted only when ``keep`` newer ones
exist and the next one has been current for ``grace_s`` (a reader still loading an old version keeps its already
open memory maps even after deletion).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from msn_core.durable import atomic_write, remove_durably, replace_dir
from msn_serve.classifiers.fewshot import ClassifierStore
from msn_serve.indexes.store import IndexStore

log = logging.getLogger("msn_serve.publish")
PUBLISHED, CURRENT, MANIFEST = "published", "CURRENT", "manifest.json"
_publish_lock = threading.Lock()


def published_root(data_dir: Path) -> Path:
    return data_dir / PUBLISHED


def current_version(data_dir: Path) -> str | None:
    """The version ``CURRENT`` names, or ``None`` before the first publish."""
    try:
        name = (published_root(data_dir) / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    if not name.isdigit():
        raise ValueError(f"{published_root(data_dir) / CURRENT} is corrupt: {name[:40]!r}")
    return name


def _versions(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=int) \
        if root.is_dir() else []


def state_signature(indexes: IndexStore, classifiers: ClassifierStore) -> tuple:
    """Changes whenever an index or classifier is created, dropped or mutated (used to skip no-op publishes)."""
    return (tuple(sorted((n, i.seq, i.created) for n, i in list(indexes.indexes.items()))),
            tuple(sorted((n, c.info.get("created")) for n, c in list(classifiers.items.items()))))


def publish(data_dir: Path, indexes: IndexStore, classifiers: ClassifierStore, *, model_id: str, keep: int = 3,
            grace_s: float = 300.0) -> dict[str, Any]:
    """Write every index and classifier as a new version and point ``CURRENT`` at it (writer only)."""
    with _publish_lock:
        t0 = time.perf_counter()
        root = published_root(data_dir)
        root.mkdir(parents=True, exist_ok=True)
        existing = _versions(root)
        version = f"{int(existing[-1]) + 1 if existing else 1:08d}"
        manifest: dict[str, Any] = {"version": version, "model_id": model_id, "created": time.time(),
                                    "indexes": {}, "classifiers": []}
        with replace_dir(root / version, replace=False) as staging:  # a crash leaves no partial version
            for name, idx in sorted(indexes.indexes.items(), key=lambda kv: kv[0]):
                try:
                    idx.export(staging / "indexes" / name)
                except Exception as e:
                    if getattr(e, "status", None) == 404:  # dropped while we were publishing: not part of it
                        continue
                    raise
                manifest["indexes"][name] = {"ntotal": idx.ntotal, "seq": idx.seq, "type": idx.cfg.type}
            cdir = staging / "classifiers"
            cdir.mkdir()
            for name, clf in sorted(classifiers.items.items(), key=lambda kv: kv[0]):
                (cdir / f"{name}.npz").write_bytes(clf.to_bytes())
                manifest["classifiers"].append(name)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        atomic_write(root / CURRENT, f"{version}\n".encode())
        removed = _collect_garbage(root, keep=keep, grace_s=grace_s)
        manifest["seconds"] = round(time.perf_counter() - t0, 3)
        manifest["removed_versions"] = removed
        log.info("published version %s: %d indexes, %d classifiers in %.3fs", version, len(manifest["indexes"]),
                 len(manifest["classifiers"]), manifest["seconds"])
        return manifest


def _collect_garbage(root: Path, *, keep: int, grace_s: float) -> list[str]:
    versions = _versions(root)
    removed = []
    for old, successor in zip(versions[:-keep] if keep else versions, versions[1:], strict=False):
        if time.time() - (root / successor).stat().st_mtime >= grace_s:
            remove_durably(root / old)
            removed.append(old)
    return removed


def load_version(data_dir: Path, version: str, *, model_id: str, default_dim: int,
                 device: str = "cpu") -> tuple[IndexStore, ClassifierStore, dict[str, Any]]:
    """Open one published version read-only (indexes memory-mapped); raises if anything is missing or corrupt,
    or if it was published for another model (its vectors would be meaningless for this replica's embeddings)."""
    vdir = published_root(data_dir) / version
    manifest = json.loads((vdir / MANIFEST).read_text())
    if manifest.get("model_id") != model_id:
        raise ValueError(f"published version {version} was made with model {manifest.get('model_id')!r}, "
                         f"this replica serves {model_id!r}")
    indexes = IndexStore(data_dir, default_dim=default_dim, model_id=model_id, root=vdir / "indexes",
                         read_only=True, device=device)
    indexes.load_all()
    classifiers = ClassifierStore(data_dir, model_id, root=vdir / "classifiers", read_only=True)
    classifiers.load_all()
    if set(indexes.indexes) != set(manifest["indexes"]) or set(classifiers.items) != set(manifest["classifiers"]):
        raise ValueError(f"published version {version} does not match its manifest")
    return indexes, classifiers, manifest
