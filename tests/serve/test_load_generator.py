"""The benchmarks' HTTP load generator (``benchmarks/serving/http_load.py``) against a real ``msn-serve``: every timed
request is answered and counted once, and the timed part starts only after every client's warm-up (the barrier
across client processes). Timings are not asserted: they belong to the benchmarks."""
from __future__ import annotations

import pytest
from serve_helpers import encode, free_port, random_image

from benchmarks.serving import http_load


def test_load_generator_counts_each_timed_request_once(server):
    before = _embed_requests(server)
    requests = [http_load.embed_request("127.0.0.1", encode(random_image(i))) for i in range(3)]
    out = http_load.run(server.port, requests, concurrency=5, total=11, procs=2)
    assert out["errors"] == 0 and out["requests"] == 11 and out["wall_s"] > 0
    assert out["client_processes"] == 2 and out["p99_ms"] >= out["p50_ms"] > 0
    assert _embed_requests(server) - before == 11 + 2 * 5  # the timed requests + two warm-ups per connection


def test_load_generator_fails_fast_when_a_client_cannot_connect():
    """A client process that fails before the start gate breaks it: the run raises at once instead of waiting."""
    requests = [http_load.embed_request("127.0.0.1", encode(random_image(0)))]
    with pytest.raises(ConnectionRefusedError):
        http_load.run(free_port(), requests, concurrency=2, total=2, procs=2)


def _embed_requests(server) -> int:
    import httpx

    text = httpx.get(f"{server.url}/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("msn_http_requests_total{") and 'route="/embed"' in line
                   and 'status="200"' in line))
