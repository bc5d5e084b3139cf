"""The index tuner shared by msn-index build and auto indexes, auto re-tuning as an index grows, GPU placement.

Real FAISS on small clustered data; speeds are compared only with each other inside one run (the figures at a
million vectors belong to benchmarks/serving/serve_bench.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from msn_core.gpu import CudaUnavailable
from msn_serve.errors import ApiError
from msn_serve.indexes import gpu as index_gpu
from msn_serve.indexes.config import IndexConfig, search_params
from msn_serve.indexes.managed import ManagedIndex
from msn_serve.indexes.store import IndexStore
from msn_serve.indexes.tuning import GB, plans, select


def clustered(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(8, n // 200), d)).astype(np.float32)
    x = centres[rng.integers(0, len(centres), n)] + 0.4 * rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def exact(x: np.ndarray, q: np.ndarray, k: int = 10) -> np.ndarray:
    return faiss.knn(q, x, k, metric=faiss.METRIC_INNER_PRODUCT)[1]


def test_plans_follow_size_deletes_and_memory():
    assert [p.type for p in plans(5_000, 384, 16 * GB, exact_below=100_000)] == ["flat"]
    assert [p.type for p in plans(1_000_000, 384, 16 * GB, exact_below=100_000)] == ["ivf"]
    both = plans(1_000_000, 384, 16 * GB, exact_below=100_000, deletes=False)
    assert [(p.type, p.k_factor > 0) for p in both] == [("ivf", False), ("ivfpq", True), ("hnsw", False)]
    assert both[1].fastscan and 384 % both[1].pq_m == 0 and both[1].bytes_estimate > both[0].bytes_estimate * 0.9
    small = plans(1_000_000, 384, 0.2 * GB, exact_below=100_000, deletes=False)
    assert [(p.type, p.k_factor) for p in small] == [("ivfpq", 0)] and small[0].bytes_estimate <= 0.2 * GB
    with pytest.raises(ValueError, match="do not fit"):
        plans(10**9, 384, 0.001 * GB, exact_below=100_000)


def test_select_keeps_the_fastest_candidate_that_reaches_the_target():
    x = clustered(20_000)
    q, base = x[:300], x[300:]
    ids = np.arange(len(base), dtype=np.int64) * 3 + 1  # external ids, not positions
    truth = ids[exact(base, q)]
    candidates = plans(len(base), 32, 1 * GB, exact_below=1_000, deletes=False)
    best, reports = select(candidates, IndexConfig(dim=32), base[:5_000], lambda ix: ix.add_with_ids(base, ids), q,
                           truth, 0.9)
    assert len(reports) == 3 and reports[0]["plan"]["type"] == best.config.type
    reached = [r for r in reports if r["recall"] >= 0.9]
    assert reached and best.recall >= 0.9 and round(best.qps, 1) == max(r["qps"] for r in reached)
    assert all(r["memory_bytes"] > 0 and r["tuning"] for r in reports)
    found = best.index.search(q, 10, params=search_params(best.config, 10))[1]
    assert np.isin(found, ids).all()  # the tuned index answers with external ids


def _wait_tuned(idx: ManagedIndex, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (idx.tuning.running or idx.cfg.tuned_at == 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not idx.tuning.running and idx.cfg.tuned_at, "the re-tune did not finish"


def test_auto_index_retunes_as_it_grows_and_survives_a_restart(tmp_path: Path):
    x = clustered(6_000, seed=1)
    store = IndexStore(tmp_path, default_dim=32, model_id="m")
    idx = store.create("auto", {"type": "auto", "exact_below": 2_000, "deletes": False, "target_recall": 0.9})
    assert idx.cfg.type == "flat" and idx.cfg.auto and idx.cfg.next_tuning() == 2_000
    idx.add(list(range(1_999)), x[:1_999], None)
    assert idx.cfg.type == "flat" and not idx.tuning.running
    idx.add(list(range(1_999, 2_500)), x[1_999:2_500], None)  # crosses exact_below: re-tunes in the background
    idx.add(list(range(2_500, 3_000)), x[2_500:3_000], None)  # applied meanwhile, replayed onto the new index
    _wait_tuned(idx)
    assert idx.cfg.type != "flat" and idx.cfg.tuned_at == 2_500 and idx.ntotal == 3_000
    assert idx.cfg.next_tuning() == 5_000 and idx.tuning.last["chosen"] == idx.cfg.type
    q = x[:200] + 0.01
    hits = idx.search(q, 10)
    found = np.array([[h["id"] for h in row] for row in hits])
    truth = exact(x[:3_000], q / np.linalg.norm(q, axis=1, keepdims=True))
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth, strict=True)]) >= 0.85
    with pytest.raises(ApiError) as e:
        idx.remove([1])
    assert e.value.status == 409 and "deletes=false" in e.value.body()["error"]
    stats = idx.stats()
    assert stats["auto_tuning"]["next_tuning"] == 5_000 and stats["type"] == idx.cfg.type
    store.close()
    again = ManagedIndex.load(tmp_path / "indexes" / "auto", tmp_path)
    assert (again.cfg.type, again.cfg.tuned_at, again.ntotal) == (idx.cfg.type, 2_500, 3_000)
    assert [h["id"] for h in again.search(q[:5], 10)[0]] == [h["id"] for h in hits[0]]
    again.close()


def test_auto_index_that_deletes_becomes_ivf_and_keeps_deleting(tmp_path: Path):
    x = clustered(3_000, seed=2)
    store = IndexStore(tmp_path, default_dim=32, model_id="m")
    idx = store.create("del", {"type": "auto", "exact_below": 2_000})
    idx.add(list(range(3_000)), x, None)
    _wait_tuned(idx)
    assert idx.cfg.type == "ivf" and idx.cfg.deletes
    assert idx.remove([0, 1, 2])["removed"] == 3 and idx.ntotal == 2_997
    assert all(h["id"] not in (0, 1, 2) for h in idx.search(x[:3], 5)[0])
    store.close()


def test_auto_index_re_adds_follow_deletes(tmp_path: Path):
    """main's upsert (re-adding an id replaces it) meets auto indexes: with deletes (IVF after the re-tune) a re-add
    replaces the vector, also when it arrives during the re-tune; with deletes=false only an unchanged retry passes."""
    x = clustered(3_000, seed=3)
    store = IndexStore(tmp_path, default_dim=32, model_id="m")
    idx = store.create("up", {"type": "auto", "exact_below": 2_000})
    idx.add(list(range(2_500)), x[:2_500], None)  # starts the re-tune
    moved = x[2_900:2_901]
    assert idx.add([7], moved, [{"v": 2}]) == {"added": 0, "replaced": 1}  # during the re-tune: replayed
    _wait_tuned(idx)
    assert idx.cfg.type == "ivf" and idx.ntotal == 2_500
    assert idx.add([8], moved, None) == {"added": 0, "replaced": 1}  # after it: IVF removes, then adds
    top = [h["id"] for h in idx.search(moved, 3, nprobe=idx.cfg.nlist)[0]]
    assert set(top[:2]) == {7, 8} and idx.ntotal == 2_500
    fixed = store.create("fixed", {"type": "auto", "deletes": False})
    fixed.add([1, 2], x[:2], [{"a": 1}, None])
    assert fixed.add([1], x[:1], [{"a": 1}]) == {"added": 0, "replaced": 0}  # an identical retry
    with pytest.raises(ApiError) as e:
        fixed.add([1], x[5:6], None)
    assert e.value.status == 409 and "deletes=false" in e.value.body()["error"] and fixed.ntotal == 2
    store.close()


@pytest.mark.parametrize("spec, needle", [({"type": "auto", "target_recall": 1.5}, "target_recall"),
                                          ({"type": "flat", "deletes": False}, "only apply to type 'auto'"),
                                          ({"type": "auto", "deletes": "no"}, "deletes"),
                                          ({"type": "ivfpq"}, "type must be")])
def test_bad_auto_options_are_422(tmp_path: Path, spec, needle):
    with pytest.raises(ApiError) as e:
        IndexStore(tmp_path, default_dim=8, model_id="m").create("x", spec)
    assert e.value.status == 422 and needle in e.value.body()["error"]


def test_device_cuda_without_a_gpu_is_refused_and_cpu_stores_still_work(tmp_path: Path):
    if index_gpu.gpu_count():
        pytest.skip("a GPU is visible: there is nothing to refuse here")
    with pytest.raises(CudaUnavailable, match="--device cuda needs") as e:
        IndexStore(tmp_path, default_dim=8, model_id="m", device="cuda")
    assert ("faiss-gpu-cuvs" in str(e.value)) != hasattr(index_gpu.faiss, "StandardGpuResources")
    store = IndexStore(tmp_path, default_dim=8, model_id="m", device="cpu")
    idx = store.create("f", {})
    idx.add([1, 2], np.eye(2, 8, dtype=np.float32), None)
    assert idx.stats()["device"] == "cpu" and idx.search(np.eye(1, 8, dtype=np.float32), 1)[0][0]["id"] == 1


@pytest.mark.skipif(index_gpu.gpu_count() == 0, reason="no GPU visible to faiss (needs faiss-gpu-cuvs and a GPU)")
@pytest.mark.parametrize("spec", [{"type": "flat"}, {"type": "ivf", "nlist": 16, "nprobe": 16}])
def test_gpu_copies_answer_like_the_cpu_index(tmp_path: Path, spec):
    x = clustered(4_000, seed=3)
    cpu = IndexStore(tmp_path / "cpu", default_dim=32, model_id="m").create("i", spec)
    gpu = IndexStore(tmp_path / "gpu", default_dim=32, model_id="m", device="cuda").create("i", spec)
    for idx in (cpu, gpu):
        idx.add(list(range(3_000)), x[:3_000], None)
    assert gpu.stats()["device"] == "cuda"
    a, b = cpu.search(x[:50], 5), gpu.search(x[:50], 5)
    assert [[h["id"] for h in r] for r in a] == [[h["id"] for h in r] for r in b] and gpu.gpu.copy is not None
    for idx in (cpu, gpu):  # adds follow the GPU copy; a removal rebuilds it from the CPU index
        idx.add(list(range(3_000, 4_000)), x[3_000:], None)
        idx.remove([0, 1])
    a, b = cpu.search(x[:50], 5), gpu.search(x[:50], 5)
    assert [[h["id"] for h in r] for r in a] == [[h["id"] for h in r] for r in b]
    gpu.snapshot()  # persistence writes the CPU index, as without a GPU
    assert ManagedIndex.load(gpu.path, tmp_path / "gpu").ntotal == 3_998


def test_the_gpu_copy_follows_adds_and_is_rebuilt_after_other_changes(tmp_path: Path, monkeypatch):
    """The GPU mirror's bookkeeping, on any machine: a clone of the CPU index stands in for the GPU copy."""
    copies: list[faiss.Index] = []
    monkeypatch.setattr(index_gpu, "to_gpu", lambda index: copies.append(faiss.clone_index(index)) or copies[-1])
    x = clustered(600, seed=4)
    cpu = ManagedIndex.create(tmp_path / "cpu", IndexConfig(dim=32))
    gpu = ManagedIndex.create(tmp_path / "gpu", IndexConfig(dim=32), device="cuda")

    def both(step) -> list:
        return [step(idx) for idx in (cpu, gpu)]

    def same_hits() -> bool:
        a, b = both(lambda idx: idx.search(x[:20], 5))
        return [[h["id"] for h in r] for r in a] == [[h["id"] for h in r] for r in b]

    both(lambda idx: idx.add(list(range(500)), x[:500]))
    assert gpu.stats()["device"] == "cuda" and cpu.stats()["device"] == "cpu" and gpu.gpu.copy is None
    assert same_hits() and len(copies) == 1 and gpu.gpu.copy is copies[0]  # made by the first search
    both(lambda idx: idx.add(list(range(500, 600)), x[500:]))  # a plain add goes to the copy too
    assert gpu.gpu.copy is copies[0] and copies[0].ntotal == 600 and same_hits()
    both(lambda idx: idx.add([0], x[1:2]))  # a replacement cannot follow: dropped, copied again at the next search
    assert gpu.gpu.copy is None and same_hits() and len(copies) == 2
    both(lambda idx: idx.remove([1, 2]))
    assert gpu.gpu.copy is None and same_hits() and len(copies) == 3 and copies[2].ntotal == 598
    both(lambda idx: idx.close())
