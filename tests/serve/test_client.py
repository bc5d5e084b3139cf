"""The Python client (``msn_serve.client``) against real ``msn-serve`` processes: every endpoint, images in every
form it takes, masks, errors carrying the server's message, 503 retried after ``Retry-After``, the async client."""
from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_helpers import REPO, Server, encode, random_image

from msn_serve.client import (
    NO_RETRY,
    APIStatusError,
    AuthenticationError,
    BadRequest,
    Client,
    ClientError,
    Conflict,
    NotFound,
    PayloadTooLarge,
    RetryPolicy,
    ServiceUnavailable,
    TransportError,
    UnprocessableEntity,
)

KEY = "client-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with an API key and at most 3 images per request."""
    root = tmp_path_factory.mktemp("client")
    (root / "key").write_text(KEY + "\n")
    s = Server(bundle_dir, root / "data", "--api-key-file", str(root / "key"), "--max-images-per-request", "3")
    yield s.start()
    s.stop()


@pytest.fixture(scope="module")
def client(srv: Server):
    with Client(srv.url, api_key=KEY, timeout=60) as c:
        yield c


def raw_embed(srv: Server, png: bytes, mask: str | None = None) -> dict:
    """``/embed`` called by hand: one multipart file (and mask), JSON answer."""
    r = httpx.post(f"{srv.url}/embed", files={"image": png}, data={"mask": mask} if mask else None, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_images_in_every_form_give_the_raw_requests_vectors(srv: Server, client: Client, tmp_path: Path) -> None:
    arr = random_image(0)
    png = encode(arr)
    (tmp_path / "a.png").write_bytes(png)
    want = np.asarray(raw_embed(srv, png)["embeddings"], dtype=np.float32)
    model_id = client.info()["model_id"]
    for form in (str(tmp_path / "a.png"), tmp_path / "a.png", png, Image.fromarray(arr), arr):
        got = client.embed(form)
        assert got.vectors.dtype == np.float32 and got.vectors.shape == want.shape, type(form)
        np.testing.assert_allclose(got.vectors, want, atol=1e-5, err_msg=type(form).__name__)
        assert got.model_id == model_id and got.normalized is False and got.keep_idx is None
    batch = client.embed(np.stack([arr, random_image(1)]))  # a 4-D array is a batch
    assert batch.vectors.shape == (2, want.shape[1])
    np.testing.assert_allclose(batch.vectors[0], want[0], atol=1e-5)
    unit = client.embed([png, random_image(1)], normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit.vectors, axis=1), 1.0, atol=1e-5)
    assert unit.normalized is True
    with pytest.raises(ValueError, match="uint8"):
        client.embed(arr.astype(np.float32))


def test_masked_embed_and_openai_embeddings(srv: Server, client: Client) -> None:
    png = encode(random_image(2))
    want = raw_embed(srv, png, '{"ratio": 0.5, "seed": 3}')
    got = client.embed(png, mask={"ratio": 0.5, "seed": 3})
    np.testing.assert_allclose(got.vectors, np.asarray(want["embeddings"], np.float32), atol=1e-5)
    assert [k.tolist() for k in got.keep_idx] == want["keep_idx"] and got.kept_tokens == want["kept_tokens"]
    grid = client.info()["grid"]
    bitmap = np.zeros((grid, grid), dtype=bool)
    bitmap[:2] = True  # the top two rows of patches
    as_array = client.embed(png, mask=bitmap)
    assert as_array.keep_idx[0].tolist() == list(range(2 * grid))
    np.testing.assert_allclose(as_array.vectors, client.embed(png, mask={"keep_idx": list(range(2 * grid))}).vectors,
                               atol=1e-6)
    for mask in (None, {"ratio": 0.5, "seed": 3}):
        oa = client.embeddings([png, random_image(3)], mask=mask)
        native = client.embed([png, random_image(3)], mask=mask)
        np.testing.assert_allclose(oa.vectors, native.vectors, atol=1e-5)
        assert oa.prompt_tokens == sum(native.kept_tokens) and oa.model == native.model_id


def test_errors_carry_the_servers_status_and_message(srv: Server, client: Client) -> None:
    png = encode(random_image(4))
    with pytest.raises(PayloadTooLarge) as e:
        client.embed([png] * 4)
    assert e.value.status == 413 and "at most 3 images" in e.value.message
    bad = httpx.post(f"{srv.url}/embed", files={"image": png}, data={"mask": '{"ratio": 2}'}, headers=AUTH)
    with pytest.raises(UnprocessableEntity) as e:
        client.embed(png, mask={"ratio": 2})
    assert e.value.status == 422 and e.value.message == bad.json()["error"] and "ratio" in e.value.message
    with pytest.raises(NotFound) as e:
        client.search("no-such-index", vectors=np.zeros(64))
    assert e.value.status == 404 and "no-such-index" in e.value.message
    with pytest.raises(BadRequest) as e:  # /v1 answers OpenAI's error object: its message is read too
        client.embeddings(png, mask={"ratio": 2})
    assert e.value.status == 400 and "ratio" in e.value.message and e.value.detail["type"] == "invalid_request_error"
    with Client(srv.url) as anonymous:
        with pytest.raises(AuthenticationError) as e:
            anonymous.embed(png)
        assert e.value.status == 401 and "API key" in e.value.message and isinstance(e.value, ClientError)
        assert anonymous.health() == {"status": "ok"}  # health stays open
    with Client(f"http://127.0.0.1:{_closed_port()}", timeout=5) as nowhere, pytest.raises(TransportError):
        nowhere.health()


def _closed_port() -> int:
    from serve_helpers import free_port

    return free_port()


def test_health_ready_metrics_models(client: Client) -> None:
    assert client.health() == {"status": "ok"}
    ready = client.ready()
    assert ready.ready is True and "precision" in ready.raw
    assert "msn_http_requests_total" in client.metrics()
    info = client.info()
    assert [m["id"] for m in client.models()] == [info["model_id"]]


def test_index_round_trip(client: Client) -> None:
    imgs = [random_image(10 + i) for i in range(3)]
    assert client.create_index("pets", metric="ip", type="flat")["ntotal"] == 0
    with pytest.raises(Conflict, match="already exists"):
        client.create_index("pets")
    added = client.add("pets", [1, 2, 3], images=imgs, metadata=[{"f": "a"}, None, {"f": "c"}])
    assert added["added"] == 3 and added["ntotal"] == 3
    vecs = client.embed(imgs).vectors
    client.add("pets", np.array([7]), vectors=vecs[0] * -1)  # one 1-D vector is one row
    hits = client.search("pets", images=imgs[2], k=2)
    assert hits.metric == "ip" and hits.hits[0][0].id == 3 and hits.hits[0][0].metadata == {"f": "c"}
    by_vector = client.search("pets", vectors=vecs, k=4)
    assert by_vector.ids.shape == (3, 4) and by_vector.ids[:, 0].tolist() == [1, 2, 3]
    assert np.all(np.diff(by_vector.scores, axis=1) <= 1e-6)
    assert client.index_stats("pets")["ntotal"] == 4
    assert "pets" in [ix["name"] for ix in client.list_indexes()]
    assert client.delete_ids("pets", [7, 99]) == {"name": "pets", "removed": 1, "not_found": [99], "ntotal": 3}
    assert client.delete_index("pets") == {"deleted": "pets"}
    assert "pets" not in [ix["name"] for ix in client.list_indexes()]


def test_fewshot_and_label_loop_round_trip(client: Client) -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(2, 64)) * 4
    vecs = np.concatenate([c + rng.normal(size=(10, 64)) * 0.3 for c in centres]).astype(np.float32)
    ids = np.arange(100, 120)
    client.create_index("loop")
    client.add("loop", ids, vectors=vecs)
    first = client.select("loop", n=4, seed=1)
    assert len(first.ids) == 4 and set(first.ids.tolist()) <= set(ids.tolist()) and first.available == 20
    fitted = client.fit("byid", ["a", "a", "b", "b"], index="loop", ids=[100, 101, 110, 111])
    assert fitted["classes"] == ["a", "b"] and fitted["n"] == 4
    nxt = client.suggest("byid", "loop", n=3)
    assert len(nxt.ids) == 3 and not {100, 101, 110, 111} & set(nxt.ids.tolist()) and nxt.uncertainty.shape == (3,)
    page = client.predict_index("byid", "loop", limit=15, k=2)
    assert page.total == 20 and len(page.items) == 15 and page.next_offset == 15
    assert page.class_counts == {"a": 10, "b": 10} and page.items[0].top[0].label == page.items[0].label
    last = client.predict_index("byid", "loop", offset=page.next_offset, limit=15)
    assert len(last.items) == 5 and last.next_offset is None
    pred = client.predict("byid", embeddings=vecs[[0, 15]], k=2)
    assert pred.labels == ["a", "b"] and pred.probabilities.min() > 0.5 and len(pred.top[0]) == 2
    imgs = [random_image(20 + i) for i in range(2)]
    by_image = client.fit("img", ["x", "y"], images=imgs, lambd=1e-3)  # multipart: name is a text field
    assert by_image["classes"] == ["x", "y"]
    assert client.predict("img", images=imgs, k=1).labels == ["x", "y"]
    assert client.fit("img", ["y", "x"], embeddings=client.embed(imgs).vectors, overwrite=True)["n"] == 2
    assert client.classifier("img")["classes"] == ["x", "y"]
    assert {"byid", "img"} <= {c["name"] for c in client.list_classifiers()}
    assert client.delete_classifier("img") == {"deleted": "img"}
    with pytest.raises(NotFound):
        client.classifier("img")


def test_publish_and_reader_reload(srv: Server, client: Client, bundle_dir: Path) -> None:
    client.create_index("shared")
    client.add("shared", [1], vectors=np.ones(64))
    assert "shared" in client.publish()["indexes"]
    reader = Server(bundle_dir, srv.data_dir, "--read-only", "--api-key-file", str(srv.data_dir.parent / "key"))
    reader.log_path = srv.data_dir.parent / "reader.log"
    reader.start()
    try:
        with Client(reader.url, api_key=KEY) as r:
            assert r.index_stats("shared")["ntotal"] == 1
            client.add("shared", [2], vectors=np.ones(64))
            version = client.publish()["version"]
            assert r.reload()["version"] == version and r.index_stats("shared")["ntotal"] == 2
            assert r.snapshot_status()["serving"] == version
            with pytest.raises(ClientError) as e:
                r.add("shared", [3], vectors=np.ones(64))
            assert e.value.status == 403 and "read-only" in e.value.message
        with pytest.raises(Conflict, match="read-only replicas"):
            client.reload()
    finally:
        reader.stop()


def test_model_admin_calls(srv: Server, client: Client, bundle_dir: Path) -> None:
    paths = httpx.get(f"{srv.url}/openapi.json", headers=AUTH).json()["paths"]
    if "/admin/models/{name}" not in paths:
        pytest.skip("this server has no /admin/models routes yet (several models per server not in this tree)")
    client.put_model("second", str(bundle_dir))  # the same bundle under a second name
    assert client.ready("second").ready and client.info("second")["model"] == "second"
    png = encode(random_image(5))
    np.testing.assert_allclose(client.embed(png, model="second").vectors, client.embed(png).vectors, atol=1e-5)
    client.delete_model("second")
    with pytest.raises(APIStatusError) as e:
        client.embed(png, model="second")
    assert e.value.status in (404, 422) and "second" in e.value.message


# ---- retries ----------------------------------------------------------------------------------------------------
def test_full_queue_503_is_retried_after_retry_after(bundle_dir: Path, tmp_path: Path) -> None:
    """A long batching window holds a 2-image request in a 2-image queue, so the next request gets 503 until the
    window closes: without retries that is the server's error, with them the request succeeds."""
    s = Server(bundle_dir, tmp_path / "data", "--queue-size", "2", "--max-wait-ms", "1500", "--max-batch-size", "32")
    s.start(expect_ready=False)
    img = encode(random_image(1))
    try:
        with Client(s.url) as c:
            first: list = []
            held = threading.Thread(target=lambda: first.append(c.embed([img, img])))
            held.start()
            deadline = time.monotonic() + 10
            while "msn_queue_depth 2.0" not in c.metrics():
                assert time.monotonic() < deadline and held.is_alive(), "the first request never reached the queue"
                time.sleep(0.01)
            with Client(s.url, retry=NO_RETRY) as once, pytest.raises(ServiceUnavailable) as e:
                once.embed(img)
            assert "queue is full" in e.value.message and e.value.retry_after >= 1 and e.value.attempts == 1
            t0 = time.monotonic()
            got = c.embed(img)  # retried until the held batch has run
            assert time.monotonic() - t0 >= 0.9 and got.vectors.shape == (1, 64)
            held.join(10)
            assert first[0].vectors.shape == (2, 64)
            assert 'msn_errors_total{kind="queue_full"}' in c.metrics()
    finally:
        s.stop()


class _Flaky:
    """A stdlib HTTP server (not ours: it tests the client) answering 503 with ``retry_after`` ``fail`` times,
    then 200; it records when each request came."""

    def __init__(self, fail: int, retry_after: str | None):
        import http.server

        outer = self
        self.times: list[float] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.times.append(time.monotonic())
                ok = len(outer.times) > fail
                body = b'{"status": "ok"}' if ok else b'{"error": "busy, try later"}'
                self.send_response(200 if ok else 503)
                if not ok and retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_retry_waits_retry_after_and_is_bounded() -> None:
    flaky = _Flaky(fail=1, retry_after="1")
    try:
        with Client(flaky.url) as c:
            assert c.info() == {"status": "ok"}
        assert len(flaky.times) == 2 and 0.95 <= flaky.times[1] - flaky.times[0] < 2.5
    finally:
        flaky.close()
    always = _Flaky(fail=100, retry_after="100")
    try:
        with Client(always.url, retry=RetryPolicy(max_attempts=3, max_delay_s=0.05)) as c, \
                pytest.raises(ServiceUnavailable) as e:
            c.info()
        assert e.value.attempts == 3 and len(always.times) == 3 and e.value.message == "busy, try later"
        with Client(always.url, retry=RetryPolicy(max_attempts=10, max_total_s=5)) as c, \
                pytest.raises(ServiceUnavailable) as e:
            c.info()  # waiting 100 s would pass the total time allowed: given up at once
        assert e.value.attempts == 1 and e.value.retry_after == 100
    finally:
        always.close()
    backoff = _Flaky(fail=2, retry_after=None)
    try:
        with Client(backoff.url, retry=RetryPolicy(backoff_s=0.05)) as c:
            assert c.info() == {"status": "ok"}
        assert len(backoff.times) == 3 and backoff.times[2] - backoff.times[1] >= 0.09  # 0.05, then 0.1
    finally:
        backoff.close()


def test_the_client_imports_nothing_of_the_server() -> None:
    """It talks HTTP only, so it can ship on its own: stdlib, numpy, httpx, Pillow and itself."""
    allowed = {"numpy", "httpx", "PIL", "msn_serve"}
    for path in sorted((REPO / "msn_serve" / "client").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in allowed, f"{path.name} imports {name}"
                assert top != "msn_serve" or name.startswith("msn_serve.client"), f"{path.name} imports {name}"


def test_the_readme_example_runs_as_written(srv: Server, tmp_path: Path) -> None:
    """The README's client example on two images written for it (the key of this module's server added)."""
    import re

    text = (REPO / "README.md").read_text()
    marker = "<!-- tests/serve/test_client.py runs this block as written -->"
    assert marker in text, "the README lost its client example"
    code = re.match(r"\s*```python\n(.*?)```", text.split(marker, 1)[1], re.DOTALL).group(1)
    for i, name in enumerate(("cat.png", "dog.png")):
        Image.fromarray(random_image(40 + i)).save(tmp_path / name)
        code = code.replace(f'"{name}"', repr(str(tmp_path / name)))
    namespace: dict = {}
    call = 'Client("http://localhost:8000")'
    assert call in code
    code = code.replace(call, f"Client({srv.url!r}, api_key={KEY!r})")
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    hits = namespace["hits"]
    assert hits.ids.tolist() == [[1, 2]] and hits.scores[0, 0] > hits.scores[0, 1]
    from msn_core.masks import resolve_mask

    kept = resolve_mask({"ratio": 0.7, "seed": 1}, 8)  # the tiny bundle's 8 x 8 patch grid
    assert namespace["masked"].vectors.shape == (1, 64) and namespace["masked"].keep_idx[0].tolist() == kept.tolist()
