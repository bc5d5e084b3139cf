"""A large request body is parsed and validated off the event loop: ``/healthz`` keeps answering meanwhile.

A 30 MB JSON few-shot fit (embeddings sent as text) used to be parsed on the event loop, holding every other request
for as long as the parse took; the parse and the validation now run in a parser thread that hands the GIL back
(``msn_serve.http.inputs``, ``msn_serve.jsontext.loads``). Measured against a real server.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_helpers import Server, assert_live

BODY_BYTES = 30_000_000
DIM = 64  # the test bundle's embedding width


def _fit_fields() -> dict[str, str]:
    """A fit request of about :data:`BODY_BYTES` bytes as JSON text per field: full-precision floats (about 20 bytes
    each), three separable classes."""
    rng = np.random.default_rng(0)
    rows = BODY_BYTES // (DIM * 20)
    labels = [f"class{i % 3}" for i in range(rows)]
    emb = rng.standard_normal((rows, DIM)) + np.repeat(np.eye(3, DIM) * 4, rows // 3 + 1, axis=0)[:rows]
    return {"labels": json.dumps(labels), "embeddings": json.dumps(emb.tolist())}


def _health_during(srv: Server, send: Callable[[httpx.Client], httpx.Response]) -> tuple[list[float], httpx.Response]:
    """``/healthz`` latencies, polled every 20 ms on a connection of its own while ``send`` runs; and its response."""
    result: dict = {}

    def run() -> None:
        with srv.client(timeout=300) as c:
            result["r"] = send(c)

    health = []
    with srv.client(timeout=10) as c:
        c.get("/healthz")  # the polling connection is open before the upload starts
        sender = threading.Thread(target=run)
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            health.append(time.perf_counter() - t0)
            time.sleep(0.02)
        sender.join()
    return health, result["r"]


@pytest.mark.slow
def test_healthz_answers_while_a_30mb_fit_body_is_parsed(bundle_dir: Path, tmp_path: Path):
    """About 30 s: building the body, sending it twice and the fits take most of it."""
    fields = _fit_fields()
    body = f'{{"name": "big", "labels": {fields["labels"]}, "embeddings": {fields["embeddings"]}}}'.encode()
    assert 0.9 * BODY_BYTES < len(body) < 32 * 2**20
    rows = fields["labels"].count(",") + 1
    srv = Server(bundle_dir, tmp_path / "data", "--max-fit-samples", str(rows + 1),
                 "--max-vectors-per-request", str(rows + 1)).start()
    try:
        def as_json(c):
            return c.post("/fewshot/fit", content=body, headers={"content-type": "application/json"})

        def as_form(c):
            # multipart: the same fields as text parts (JSON text), parsed in the parser thread like a JSON body
            return c.post("/fewshot/fit", files={"name": (None, "big2"), **{k: (None, v) for k, v in fields.items()}})

        for name, send in (("big", as_json), ("big2", as_form)):
            t0 = time.perf_counter()
            health, r = _health_during(srv, send)
            seconds = time.perf_counter() - t0
            assert r.status_code == 201, r.text[:500]
            assert r.json()["name"] == name and r.json()["classes"] == ["class0", "class1", "class2"]
            assert_live(health, seconds, f"the {name} fit request of {len(body)} bytes")
    finally:
        srv.stop()
