"""What the Python client sends again, and when: busy answers (503, 429) after ``Retry-After``, lost answers only
for calls that are safe to send twice, a call's own ``timeout``, ``max_retries`` and ``with_options``.

The failures are played by a small stdlib HTTP server, so each test says exactly what the client met and counts
what reached the server; the last test meets the real server's 503 of a full queue.
"""
from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import Server, encode, free_port, random_image

from msn_serve.client import (
    APIConnectionError,
    APITimeoutError,
    Client,
    InternalServerError,
    RateLimitError,
    ServiceUnavailableError,
)
from msn_serve.client import retry

OK = json.dumps({"status": "ok", "ids": [], "available": 0}).encode()


class Scripted:
    """Answers request ``i`` as ``script[i]`` says, then 200: ``(status, retry_after)`` answers that status with
    that ``Retry-After`` (``None``: no header), ``"drop"`` reads the request and hangs up without an answer,
    ``("sleep", s)`` answers 200 after ``s`` seconds. ``seen`` records ``(time, method, path)`` of each request."""

    def __init__(self, *script: object):
        outer = self
        self.script, self.seen = list(script), []
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    step = outer.script[len(outer.seen)] if len(outer.seen) < len(outer.script) else None
                    outer.seen.append((time.monotonic(), self.command, self.path))
                if step == "drop":
                    self.close_connection = True
                    return
                status, retry_after = step if isinstance(step, tuple) and step[0] != "sleep" else (200, None)
                if isinstance(step, tuple) and step[0] == "sleep":
                    time.sleep(step[1])
                body = OK if status == 200 else json.dumps({"error": f"scripted {status}"}).encode()
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = handle_one

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.seen, self.seen[1:], strict=False)]


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    made: list[Scripted] = []

    def make(*script: object) -> Scripted:
        made.append(Scripted(*script))
        return made[-1]

    yield make  # type: ignore[misc]
    for s in made:
        s.server.shutdown()
        s.server.server_close()


def test_busy_answers_wait_for_retry_after(scripted) -> None:
    """503 and 429 mean the server did nothing: any call, writes included, is sent again after ``Retry-After``."""
    s = scripted((503, "1"), (429, "0"))
    with Client(s.url) as c:
        assert c.indexes.create("x") == json.loads(OK)  # not idempotent, retried all the same
    assert len(s.seen) == 3 and 1.0 <= s.gaps()[0] < 1.5 and s.gaps()[1] < 0.3
    far = scripted((503, "100"))
    with Client(far.url) as c, pytest.raises(ServiceUnavailableError) as e:
        c.info()  # 100 s is more than the client waits (60 s): raised at once, with the server's advice
    assert e.value.attempts == 1 and e.value.retry_after == 100 and e.value.message == "scripted 503"
    always = scripted(*[(429, "0")] * 10)
    with Client(always.url, max_retries=2) as c, pytest.raises(RateLimitError) as e:
        c.info()
    assert e.value.attempts == 3 and len(always.seen) == 3


def test_backoff_without_retry_after(scripted) -> None:
    """0.5 s, then 1 s, each less up to a quarter at random."""
    s = scripted((503, None), (503, None))
    with Client(s.url) as c:
        c.info()
    first, second = s.gaps()
    assert len(s.seen) == 3 and 0.37 <= first <= 0.7 and 0.74 <= second <= 1.2


def test_lost_answers_are_retried_only_for_idempotent_calls(scripted) -> None:
    """A hang-up after the request was sent, or a proxy's 502/504: the server may have done it, so only calls that
    leave the same state when sent twice are sent again."""
    s = scripted("drop", "drop", (200, None), (502, None), (200, None), "drop", "drop")
    with Client(s.url) as c:
        with pytest.raises(APIConnectionError) as e:
            c.indexes.create("x")  # a second create would be a 409 for the index the first one made
        assert e.value.attempts == 1 and not isinstance(e.value, APITimeoutError)
        assert c.indexes.delete_ids("x", [1, 2]) == json.loads(OK)  # dropped once, then answered
        assert c.classifiers.suggest("c", "x").ids.tolist() == []  # a 502 once, then answered
        with pytest.raises(APIConnectionError):
            c.classifiers.fit("c", ["a", "b"], index="x", ids=[1, 2])  # a new fit: a second send is a 409
        c.classifiers.fit("c", ["a", "b"], index="x", ids=[1, 2], overwrite=True)  # replaces: safe twice
    methods = [(m, p) for _, m, p in s.seen]
    assert methods == [("POST", "/index/x"), *[("POST", "/index/x/delete")] * 2,
                       *[("POST", "/fewshot/c/suggest")] * 2, *[("POST", "/fewshot/fit")] * 3]
    gateway = scripted((504, None))
    with Client(gateway.url) as c, pytest.raises(InternalServerError) as e:
        c.snapshots.publish()  # each publish makes a version: not sent again
    assert e.value.status_code == 504 and len(gateway.seen) == 1


def test_timeout_per_call_and_with_options(scripted) -> None:
    """``timeout=`` on a call overrides the client's; ``with_options`` changes retries for the calls made through
    it and shares the pool (closing it leaves the client working)."""
    s = scripted(("sleep", 1.0), ("sleep", 1.0))
    with Client(s.url, timeout=30) as c:
        once = c.with_options(max_retries=0)
        with pytest.raises(APITimeoutError) as e:  # the client's 30 s would have waited out the 1 s answer
            once.indexes.retrieve("x", timeout=0.2)
        assert e.value.attempts == 1 and once.max_retries == 0
        once.close()
        assert c.max_retries == 3 and c.indexes.retrieve("x", timeout=0.2) == json.loads(OK)  # timed out, retried
    assert len(s.seen) == 3


def test_nothing_sent_is_retried_for_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection sent nothing, so even a create is tried again, after a backoff; probes (health,
    ready) are not."""
    waits: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (waits.append(s), real_sleep(s))[1])
    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1) as c:
        with pytest.raises(APIConnectionError) as e:
            c.indexes.create("x")
        assert e.value.attempts == 2 and len(waits) == 1
        assert 0.75 * retry.INITIAL_BACKOFF_S <= waits[0] <= retry.INITIAL_BACKOFF_S  # the first backoff
        with pytest.raises(APIConnectionError) as e:
            c.health()
        assert e.value.attempts == 1


def test_full_queue_503_is_retried_after_retry_after(bundle_dir: Path, tmp_path: Path) -> None:
    """A long batching window holds a 2-image request in a 2-image queue, so the next request gets 503 until the
    window closes: without retries that is the server's error, with them the request succeeds."""
    s = Server(bundle_dir, tmp_path / "data", "--queue-size", "2", "--max-wait-ms", "1500", "--max-batch-size", "32")
    s.start(expect_ready=False)
    img = encode(random_image(1))
    try:
        with Client(s.url) as c:
            first: list = []
            held = threading.Thread(target=lambda: first.append(c.embeddings.create([img, img])))
            held.start()
            deadline = time.monotonic() + 10
            while "msn_queue_depth 2.0" not in c.metrics():
                assert time.monotonic() < deadline and held.is_alive(), "the first request never reached the queue"
                time.sleep(0.01)
            with pytest.raises(ServiceUnavailableError) as e:
                c.with_options(max_retries=0).embeddings.create(img)
            assert "queue is full" in e.value.message and e.value.retry_after >= 1 and e.value.attempts == 1
            t0 = time.monotonic()
            got = c.embeddings.create(img)  # retried until the held batch has run
            assert time.monotonic() - t0 >= e.value.retry_after and got.vectors.shape == (1, 64)  # waited as told
            held.join(10)
            assert first[0].vectors.shape == (2, 64)
            assert 'msn_errors_total{kind="queue_full"}' in c.metrics()
    finally:
        s.stop()
