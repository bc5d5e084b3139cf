"""A large Open Inference Protocol body is parsed off the event loop: ``/healthz`` keeps answering meanwhile.

``POST /v2/models/{name}/infer`` with a 30 MB JSON body (pixel values as JSON numbers, as ``tritonclient`` sends them
without the binary extension) is decompressed, parsed, converted to tensors and checked in the parser threads of
``msn_serve.http.inputs`` (the JSON list converted in chunks, so numpy never holds the GIL for the whole body).
Measured against a real server, like the native routes' test (``test_big_body_liveness.py``).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server, assert_live

BODY_BYTES = 30_000_000
PIXELS = 3 * 32 * 32  # one image of the test bundle


def _infer_body() -> tuple[bytes, int]:
    """An infer request of about :data:`BODY_BYTES` bytes: full-precision floats (about 20 bytes each)."""
    rows = BODY_BYTES // (PIXELS * 20)
    pixels = np.random.default_rng(0).standard_normal((rows, 3, 32, 32))
    body = {"inputs": [{"name": "pixel_values", "shape": [rows, 3, 32, 32], "datatype": "FP32",
                        "data": pixels.reshape(-1).tolist()}]}
    return json.dumps(body).encode(), rows


@pytest.mark.slow  # a 30 MB body built, sent and embedded (about 490 images) while /healthz is polled
def test_healthz_answers_while_a_30mb_oip_body_is_parsed(bundle_dir: Path, tmp_path: Path):
    body, rows = _infer_body()
    assert 0.9 * BODY_BYTES < len(body) < 32 * 2**20
    srv = Server(bundle_dir, tmp_path / "data", "--max-images-per-request", str(rows + 1),
                 "--queue-size", str(rows + 64)).start()
    try:
        result: dict = {}

        def send() -> None:
            with srv.client(timeout=300) as c:
                result["r"] = c.post("/v2/models/msn/infer", content=body,
                                     headers={"content-type": "application/json"})

        health: list[float] = []
        with srv.client(timeout=10) as c:
            c.get("/healthz")  # the polling connection is open before the upload starts
            t0 = time.perf_counter()
            sender = threading.Thread(target=send)
            sender.start()
            while sender.is_alive():
                t1 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                health.append(time.perf_counter() - t1)
                time.sleep(0.02)
            sender.join()
            seconds = time.perf_counter() - t0
        r = result["r"]
        assert r.status_code == 200, r.text[:500]
        out = r.json()["outputs"][0]
        assert out["shape"] == [rows, 64] and np.isfinite(out["data"]).all()
        assert_live(health, seconds, f"an infer request of {len(body)} bytes")
    finally:
        srv.stop()
