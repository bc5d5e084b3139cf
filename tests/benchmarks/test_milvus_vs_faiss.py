"""The Milvus Lite vs FAISS benchmark end to end at a tiny size: both engines through msn-serve's index classes."""
from __future__ import annotations

import json

import pytest

from benchmarks.serving import milvus_vs_faiss

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    assert milvus_vs_faiss.main(["--dry-run", "--out", str(tmp_path / "r.json")]) == 0
    assert "1000000 x 384" in capsys.readouterr().out and not (tmp_path / "r.json").exists()


def test_tiny_run_reaches_the_recall_on_both_engines(tmp_path):
    out = tmp_path / "r.json"
    assert milvus_vs_faiss.main(["--n", "3000", "--dim", "32", "--kinds", "hnsw", "--tune-queries", "40",
                                 "--eval-queries", "40", "--single-queries", "10", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["cpu_count"] and result["pymilvus"]
    runs = {r["engine"]: r for r in result["runs"]}
    assert set(runs) == {"faiss", "milvus"}
    for r in runs.values():
        assert r["reached_target"] and r["recall"] >= 0.9 and r["ingest_vectors_per_s"] > 0
        assert r["batched_qps"] > 0 and r["single_qps"] > 0 and r["memory_after_ingest_mib"]["rss_mib"] > 0
