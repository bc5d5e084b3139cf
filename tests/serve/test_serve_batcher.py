"""The dynamic batcher with the real ONNX Runtime engine: exactness of padded mixed-K batches, isolation, limits."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from msn_core.bundle import load_bundle_info
from msn_core.masks import resolve_mask
from msn_serve.embedding.batcher import Batcher, QueueFull
from msn_serve.embedding.engine import Engine
from msn_serve.metrics import Metrics


@pytest.fixture(scope="module")
def engine(bundle_dir: Path) -> Engine:
    return Engine(load_bundle_info(bundle_dir), intra_op_threads=1)


def _inputs(n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((n, 3, 32, 32)).astype(np.float32)
    specs = [None, {"ratio": 0.5, "seed": 1}, {"ratio": 0.9, "seed": 2}, {"focal": {"size": 3}},
             {"keep_idx": [0, 63]}, {"ratio": 0.3, "seed": 3}, {"focal": {"size": [2, 5], "top": 1, "left": 0}}]
    return pixels, [resolve_mask(specs[i % len(specs)], 8) for i in range(n)]


def test_concurrent_mixed_masks_equal_one_at_a_time(engine: Engine):
    pixels, keeps = _inputs(21)
    solo = np.stack([engine.run(pixels[i:i + 1], keeps[i][None])[0] for i in range(len(keeps))])

    async def go() -> tuple[np.ndarray, Batcher]:
        b = Batcher(engine, Metrics(), max_batch_size=16, max_wait_ms=50, queue_size=64)
        b.start()
        try:
            rows = await asyncio.gather(*[b.embed([(pixels[i], keeps[i])]) for i in range(len(keeps))])
        finally:
            await b.stop()
        return np.concatenate(rows), b

    batched, b = asyncio.run(go())
    assert b.batches_run < len(keeps)  # requests really shared batches (padded to the group's max K)
    np.testing.assert_array_equal(batched, solo)  # bit-identical, not merely close


def test_shape_padding_buckets_are_exact_enough(engine: Engine):
    """CUDA-style padding to (batch, token) buckets; on CPU we check it is numerically the same embedding."""
    pixels, keeps = _inputs(3)

    async def go() -> np.ndarray:
        b = Batcher(engine, Metrics(), max_batch_size=8, max_wait_ms=20, queue_size=64, pad_shapes=True)
        b.start()
        try:
            return await b.embed(list(zip(pixels, keeps, strict=True)))
        finally:
            await b.stop()

    out = asyncio.run(go())
    solo = np.stack([engine.run(pixels[i:i + 1], keeps[i][None])[0] for i in range(3)])
    np.testing.assert_allclose(out, solo, atol=1e-5)


def test_one_failing_item_does_not_fail_its_batch(engine: Engine):
    pixels, keeps = _inputs(4)
    bad = np.array([0, 999], dtype=np.int64)  # out of range: ONNX Runtime's Gather rejects it

    async def go():
        b = Batcher(engine, Metrics(), max_batch_size=8, max_wait_ms=50, queue_size=64)
        b.start()
        try:
            good = [b.embed([(pixels[i], keeps[i])]) for i in range(3)]
            res = await asyncio.gather(*good, b.embed([(pixels[3], bad)]), return_exceptions=True)
            after = await b.embed([(pixels[0], keeps[0])])  # the worker survived
            return res, after, b
        finally:
            await b.stop()

    res, after, b = asyncio.run(go())
    assert all(isinstance(r, np.ndarray) for r in res[:3])
    assert isinstance(res[3], Exception) and "inference failed" in str(res[3])
    assert after.shape == (1, 64) and b.consecutive_failures == 0


def test_full_queue_answers_503_with_retry_after(engine: Engine):
    pixels, keeps = _inputs(3)

    async def go():
        b = Batcher(engine, Metrics(), max_batch_size=1, max_wait_ms=0, queue_size=2)  # worker not started
        b.submit([(pixels[0], keeps[0]), (pixels[1], keeps[1])])
        with pytest.raises(QueueFull) as e:
            b.submit([(pixels[2], keeps[2])])
        await b.stop()
        return e.value

    err = asyncio.run(go())
    assert err.status == 503 and int(err.headers["Retry-After"]) >= 1


def test_warmup_covers_every_bucket(engine: Engine):
    b = Batcher(engine, Metrics(), max_batch_size=8, max_wait_ms=1, queue_size=4)
    assert b.b_buckets == [1, 2, 4, 8] and b.k_buckets == [16, 32, 48, 64]
    assert b.warmup() == 16
