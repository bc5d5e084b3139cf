"""``msn-embed --format parquet``: the finished shards as one Parquet file for dataframe and SQL tools.

Columns ``id`` (int64), ``path`` (string, as listed), ``label`` (string or null), ``embedding``
(``fixed_size_list<float32>[dim]``); one row group per shard, in id order. It is written from the committed shards
after ``manifest.json`` (atomically: a killed write leaves no half file, and a rerun writes it again), so the
``.npy`` shards stay the resumable form and what ``msn-index build`` reads. pyarrow is optional: it is imported
only here, and asking for Parquet without it is an error before anything is embedded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import atomic_write
from msn_core.optional import MissingDependency, require

PARQUET_FILE = "embeddings.parquet"


def parquet_missing() -> str | None:
    """Why ``--format parquet`` cannot be written here, or None when it can."""
    try:
        require("pyarrow.parquet", "--format parquet")
    except MissingDependency as e:
        return f"{e}; the default --format npy needs nothing"
    return None


def write_parquet(out: Path, manifest: dict[str, Any]) -> Path:
    """Write ``out/embeddings.parquet`` from the shards ``manifest`` lists; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dim = int(manifest["dim"])
    schema = pa.schema([("id", pa.int64()), ("path", pa.string()), ("label", pa.string()),
                        ("embedding", pa.list_(pa.float32(), dim))])
    schema = schema.with_metadata({"msn": json.dumps({k: manifest.get(k) for k in (
        "format", "format_version", "model_id", "feature", "backend", "base", "dim", "count")})})

    def write(f: Any) -> None:
        with pq.ParquetWriter(f, schema) as writer:
            for shard in manifest["shards"]:
                if not shard["count"]:
                    continue
                emb = np.ascontiguousarray(np.load(out / shard["embeddings"]), dtype=np.float32)
                ids = np.load(out / shard["ids"])
                rows = [json.loads(line) for line in (out / shard["paths"]).read_text().splitlines()]
                vectors = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1), pa.float32()), dim)
                writer.write_table(pa.Table.from_arrays(
                    [pa.array(ids, pa.int64()), pa.array([r["path"] for r in rows], pa.string()),
                     pa.array([r.get("label") for r in rows], pa.string()), vectors], schema=schema))

    path = out / PARQUET_FILE
    atomic_write(path, write)
    return path
