"""The on-disk form of an embedded corpus: what ``msn-embed`` writes and ``msn-index build`` reads
(:func:`load_corpus`).

Both embedding drivers use it: the torch-free one (:mod:`msn_serve.corpus`, the serving engine) and the torchrun
one (``training.bundle.embed``, several ranks). Image *i* of the listing gets id *i*; the listing is cut into shards
of ``shard_size`` consecutive images. Per shard ``OUT/shard-SSSSS.{emb.npy,ids.npy,paths.jsonl}`` are written
through temporary files (fsync + rename), then ``shard-SSSSS.json`` commits it: a restart skips every committed
shard, so a killed job loses at most the shard in progress. ``run.json`` holds the run's identity (weights, backend,
corpus, shard size): a restart with anything else is refused rather than mixing two runs' vectors. Finally
``manifest.json`` (model id, dim, shards, counts) says the corpus is complete.

Standard library + numpy: the layout is knowledge both sides of the torch boundary need.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import atomic_write, atomic_write_json
from msn_core.sources import SourceListing

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "IDENTITY",
    "Corpus",
    "CorpusError",
    "RunMismatch",
    "bundle_fingerprint",
    "check_run",
    "corpus_items",
    "listing_sha256",
    "load_corpus",
    "recorded_run",
    "shard_dims",
    "shard_done",
    "shard_name",
    "shard_slices",
    "write_manifest",
    "write_shard",
]

FORMAT = "msn-embeddings"
FORMAT_VERSION = 1
# What must not change between a run and its restart (paths are not compared: the same job may be restarted from
# another working directory or mount point).
IDENTITY = ("model_id", "bundle_sha256", "feature", "backend", "num_files", "files_sha256", "shard_size")

Item = tuple[str, "str | None", str]  # (path as recorded, class name or None, path to open)


class RunMismatch(ValueError):
    """The output directory holds shards of another run; the message names what differs."""


def corpus_items(listing: SourceListing) -> list[Item]:
    """``[(path as recorded, class name or None, path to open)]`` in id order."""
    classes, labels = listing.classes, listing.labels
    names = [classes[k] for k in labels] if classes is not None and labels is not None else [None] * len(listing)
    return list(zip(listing.names, names, listing.files))


def listing_sha256(items: Sequence[Item]) -> str:
    return hashlib.sha256("\n".join(p for p, _, _ in items).encode()).hexdigest()


def bundle_fingerprint(bundle_dir: str | os.PathLike) -> str:
    """sha256 over the names and contents of every regular file in the bundle directory."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(bundle_dir).iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def shard_name(s: int) -> str:
    return f"shard-{s:05d}"


def shard_slices(n_items: int, shard_size: int) -> list[tuple[int, int]]:
    """``[(first id, end id)]`` of every shard."""
    return [(lo, min(lo + shard_size, n_items)) for lo in range(0, n_items, shard_size)]


def write_shard(out: Path, s: int, items: Sequence[Item], first_id: int, ids: Sequence[int], emb: np.ndarray,
                skipped: list[dict[str, Any]]) -> dict[str, Any]:
    """Write shard ``s`` (``emb[j]`` is image ``ids[j]``) and commit it; returns the record in ``shard-SSSSS.json``.

    ``items`` are the shard's images (``items[i - first_id]`` is image ``i``); ``skipped`` lists the unreadable
    ones as ``{"id", "path", "error"}``.
    """
    if not np.isfinite(emb).all():
        raise RuntimeError(f"{shard_name(s)}: the model produced NaN/inf embeddings")
    name = shard_name(s)
    rows = [json.dumps({"id": i, "path": items[i - first_id][0], "label": items[i - first_id][1]}) for i in ids]
    atomic_write(out / f"{name}.emb.npy", lambda f: np.save(f, emb))
    atomic_write(out / f"{name}.ids.npy", lambda f: np.save(f, np.asarray(ids, dtype=np.int64)))
    atomic_write(out / f"{name}.paths.jsonl", lambda f: f.write("".join(r + "\n" for r in rows).encode()))
    record = {"shard": s, "embeddings": f"{name}.emb.npy", "ids": f"{name}.ids.npy", "paths": f"{name}.paths.jsonl",
              "first_id": first_id, "files": len(items), "count": len(ids),
              "dim": int(emb.shape[1]) if len(ids) else 0, "skipped": skipped}
    atomic_write_json(out / f"{name}.json", record)  # the commit point: a shard without it is redone
    return record


def shard_done(out: Path, s: int, n_files: int) -> dict[str, Any] | None:
    """The committed record of shard ``s`` if it is complete for ``n_files`` images, else None (redo it)."""
    path = out / f"{shard_name(s)}.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    if rec.get("files") != n_files or not all((out / rec[k]).is_file() for k in ("embeddings", "ids", "paths")):
        return None
    return rec


def check_run(out: Path, run: dict[str, Any]) -> None:
    """Record ``run`` in ``out/run.json``, or check it is the run recorded there (:class:`RunMismatch` if not)."""
    path = out / "run.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in IDENTITY if old.get(k) != run[k])
        if diff:
            raise RunMismatch(f"{out} holds embeddings of a different run (differs in {diff}); use a fresh --out "
                              "directory or delete it")
    else:
        atomic_write_json(path, run)


def recorded_run(out: Path) -> dict[str, Any] | None:
    """The run recorded in ``out/run.json``, if any."""
    path = out / "run.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(out: Path, run: dict[str, Any], n_shards: int, dim: int, seconds: float) -> dict[str, Any]:
    """Write ``manifest.json`` from the committed shards: the corpus is complete."""
    shards = []
    for s in range(n_shards):
        rec = json.loads((out / f"{shard_name(s)}.json").read_text())
        shards.append({k: rec[k] for k in ("shard", "embeddings", "ids", "paths", "first_id", "files", "count")}
                      | {"skipped": len(rec["skipped"])})
    skipped = sum(s["skipped"] for s in shards)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **{k: v for k, v in run.items() if k != "started"},
                "dim": dim, "count": sum(s["count"] for s in shards), "skipped": skipped, "shards": shards,
                "seconds": round(seconds, 2), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def shard_dims(out: Path, n_shards: int) -> set[int]:
    """The embedding widths of the committed shards that hold any vector."""
    return {json.loads((out / f"{shard_name(s)}.json").read_text())["dim"] for s in range(n_shards)} - {0}


# ------------------------------------------------------------------------------------------------ reading


class CorpusError(ValueError):
    """A folder that is not a complete, consistent corpus; the message names the file and what is wrong."""


@dataclass
class Corpus:
    """A complete corpus (``manifest.json`` written), its shards memory-mapped on demand."""

    root: Path
    manifest: dict[str, Any]
    shards: list[dict[str, Any]]
    n: int
    dim: int

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids, float32 vectors)`` per shard, memory-mapped from the ``.npy`` files."""
        for s in self.shards:
            vecs = np.load(self.root / s["embeddings"], mmap_mode="r")
            ids = np.load(self.root / s["ids"])
            yield ids, vecs

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Vectors at sorted global positions (shard order), gathered without loading everything."""
        out, start = [], 0
        for _, vecs in self.chunks():
            sel = positions[(positions >= start) & (positions < start + len(vecs))] - start
            if sel.size:
                out.append(np.asarray(vecs[sel], dtype=np.float32))
            start += len(vecs)
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)

    def paths(self) -> Iterator[dict[str, Any]]:
        """Each image's ``{"id", "path", "label"?}`` as recorded (paths relative to ``manifest["base"]``)."""
        for s in self.shards:
            for line in (self.root / s["paths"]).read_text().splitlines():
                yield json.loads(line)


def load_corpus(root: Path) -> Corpus:
    """The corpus in ``root``, every shard's shape, values and ids checked before anything is built from it."""
    path = root / "manifest.json"
    if not path.is_file():
        raise CorpusError(f"{root}: no manifest.json (run msn-embed to completion first)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise CorpusError(f"{path}: not an msn-embed manifest")
    dim, shards, seen = int(manifest["dim"]), [s for s in manifest["shards"] if s["count"] > 0], []
    for s in shards:
        vecs = np.load(root / s["embeddings"], mmap_mode="r")
        ids = np.load(root / s["ids"])
        if vecs.ndim != 2 or vecs.shape != (s["count"], dim) or ids.shape != (s["count"],):
            raise CorpusError(f"{root / s['embeddings']}: shape {vecs.shape} / ids {ids.shape}, manifest says "
                              f"({s['count']}, {dim})")
        if not np.isfinite(vecs).all():
            raise CorpusError(f"{root / s['embeddings']}: contains NaN or infinity")
        seen.append(ids)
    all_ids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    if all_ids.size == 0:
        raise CorpusError(f"{root}: no embeddings to index")
    if all_ids.min() < 0 or np.unique(all_ids).size != all_ids.size:
        raise CorpusError(f"{root}: ids must be unique and non-negative")
    return Corpus(root, manifest, shards, int(all_ids.size), dim)
