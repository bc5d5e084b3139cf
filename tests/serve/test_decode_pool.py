"""Decoding in worker processes (``--preprocess-workers``) gives the thread path's arrays and the same 4xx; and the
front-end benchmark runs (a smoke run through a real server with its instant-engine instrument)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import PREPROCESSING, REPO, encode, random_image

from msn_core.bundle import Preprocessing
from msn_serve.embedding.decode_pool import DecodePool
from msn_serve.embedding.preprocess import PixelBudget
from msn_serve.errors import ApiError

PRE = Preprocessing(**{**PREPROCESSING, "mean": tuple(PREPROCESSING["mean"]), "std": tuple(PREPROCESSING["std"])})
GOOD = [encode(random_image(s, 50 + 7 * s, 41), "JPEG" if s % 2 else "PNG") for s in range(4)]
BAD = {"empty": b"", "junk": b"not an image", "truncated": GOOD[1][:200],
       "bomb": encode(np.zeros((300, 300, 3), np.uint8))}


async def _all(pool: DecodePool, files: list[bytes], budget: int = 10**9) -> list:
    b = PixelBudget(budget)
    out = []
    for i, data in enumerate(files):
        try:
            out.append(await pool.run(data, PRE, max_pixels=50_000, what=f"image {i}", budget=b))
        except ApiError as e:
            out.append((e.status, e.message))
    return out


@pytest.fixture(scope="module")
def pools():
    threads, procs = DecodePool(workers=0, threads=2), DecodePool(workers=1, threads=0)
    yield threads, procs
    threads.shutdown()
    procs.shutdown()


def test_worker_processes_give_the_threads_arrays_and_errors(pools):
    threads, procs = pools
    files = [*GOOD, *BAD.values()]
    a, b = asyncio.run(_all(threads, files)), asyncio.run(_all(procs, files))
    for x, y in zip(a[: len(GOOD)], b[: len(GOOD)], strict=True):
        assert x.shape == (3, 32, 32) and np.array_equal(x, y)
    assert a[len(GOOD):] == b[len(GOOD):]
    assert [s for s, _ in b[len(GOOD):]] == [422, 422, 422, 413]
    # the request's pixel budget is the server's, whoever decodes: the third image passes it
    budget = 50 * 41 + 57 * 41
    a, b = asyncio.run(_all(threads, GOOD[:3], budget)), asyncio.run(_all(procs, GOOD[:3], budget))
    assert isinstance(b[1], np.ndarray) and b[2][0] == 413 and "max_request_pixels" in b[2][1]
    assert a[2] == b[2]


def test_frontend_benchmark_smoke(tmp_path: Path):
    out = tmp_path / "fe.json"
    subprocess.run([sys.executable, "-m", "benchmarks.serving.frontend_bench", "--seconds", "0.5", "--clients", "4",
                    "--client-procs", "1", "--cores", "1", "--modes", "threads", "--out", str(out)],
                   cwd=REPO, check=True, timeout=120, capture_output=True)
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert "instant-engine" in result["engine"] and row["errors"] == 0 and row["requests"] > 0
    assert row["server_cpu_s"] > 0 and row["images_per_server_cpu_s"] > 0 and result["machine"]["cpu_count"]
