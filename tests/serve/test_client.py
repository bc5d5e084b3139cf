"""The Python client (``msn_serve.client``) against real ``msn-serve`` processes: every call, images in every form
it takes, masks, errors carrying the server's status and message, the environment's URL and key, and the README's
example run with nothing but the client's dependencies importable. Retries: test_client_retry.py."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_helpers import REPO, Server, encode, free_port, random_image

from msn_serve.client import (
    APIConnectionError,
    APIError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InsufficientStorageError,
    InternalServerError,
    ModelCard,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ServiceUnavailableError,
    UnprocessableEntityError,
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
        got = client.embeddings.create(form)
        assert got.vectors.dtype == np.float32 and got.vectors.shape == want.shape, type(form)
        np.testing.assert_allclose(got.vectors, want, atol=1e-5, err_msg=type(form).__name__)
        assert got.model_id == model_id and got.normalized is False and got.keep_idx is None
    batch = client.embeddings.create(np.stack([arr, random_image(1)]))  # a 4-D array is a batch
    assert batch.vectors.shape == (2, want.shape[1])
    np.testing.assert_allclose(batch.vectors[0], want[0], atol=1e-5)
    unit = client.embeddings.create([png, random_image(1)], normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit.vectors, axis=1), 1.0, atol=1e-5)
    assert unit.normalized is True
    with pytest.raises(ValueError, match="uint8"):
        client.embeddings.create(arr.astype(np.float32))


def test_masked_embed_and_openai_embeddings(srv: Server, client: Client) -> None:
    png = encode(random_image(2))
    want = raw_embed(srv, png, '{"ratio": 0.5, "seed": 3}')
    got = client.embeddings.create(png, mask={"ratio": 0.5, "seed": 3})
    np.testing.assert_allclose(got.vectors, np.asarray(want["embeddings"], np.float32), atol=1e-5)
    assert [k.tolist() for k in got.keep_idx] == want["keep_idx"] and got.kept_tokens == want["kept_tokens"]
    grid = client.info()["grid"]
    bitmap = np.zeros((grid, grid), dtype=bool)
    bitmap[:2] = True  # the top two rows of patches
    as_array = client.embeddings.create(png, mask=bitmap)
    assert as_array.keep_idx[0].tolist() == list(range(2 * grid))
    as_list = client.embeddings.create(png, mask={"keep_idx": list(range(2 * grid))})
    np.testing.assert_allclose(as_array.vectors, as_list.vectors, atol=1e-6)
    for mask in (None, {"ratio": 0.5, "seed": 3}):
        oa = client.embeddings.create_v1([png, random_image(3)], mask=mask)
        native = client.embeddings.create([png, random_image(3)], mask=mask)
        np.testing.assert_allclose(oa.vectors, native.vectors, atol=1e-5)
        assert oa.prompt_tokens == sum(native.kept_tokens) and oa.model == native.model_id


def test_errors_carry_the_servers_status_and_message(srv: Server, client: Client) -> None:
    png = encode(random_image(4))
    with pytest.raises(PayloadTooLargeError) as e:
        client.embeddings.create([png] * 4)
    assert e.value.status_code == 413 and "at most 3 images" in e.value.message
    bad = httpx.post(f"{srv.url}/embed", files={"image": png}, data={"mask": '{"ratio": 2}'}, headers=AUTH)
    with pytest.raises(UnprocessableEntityError) as e:
        client.embeddings.create(png, mask={"ratio": 2})
    assert e.value.status_code == 422 and e.value.message == bad.json()["error"] and "ratio" in e.value.message
    with pytest.raises(NotFoundError) as e:
        client.indexes.search("no-such-index", vectors=np.zeros(64))
    assert e.value.status_code == 404 and "no-such-index" in e.value.message
    with pytest.raises(BadRequestError) as e:  # /v1 answers OpenAI's error object: its message is read too
        client.embeddings.create_v1(png, mask={"ratio": 2})
    assert e.value.status_code == 400 and "ratio" in e.value.message
    assert e.value.detail["type"] == "invalid_request_error"
    with Client(srv.url) as anonymous:
        with pytest.raises(AuthenticationError) as e:
            anonymous.embeddings.create(png)
        assert e.value.status_code == 401 and "API key" in e.value.message and isinstance(e.value, APIError)
        assert anonymous.health() == {"status": "ok"}  # health stays open
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as nowhere, \
            pytest.raises(APIConnectionError) as e:
        nowhere.health()  # a probe: not retried
    assert e.value.attempts == 1


def test_errors_are_arranged_as_openais() -> None:
    """``except InternalServerError`` catches 503 and 507 too; ``APIError`` catches everything."""
    from msn_serve.client import APITimeoutError, RateLimitError

    assert issubclass(APITimeoutError, APIConnectionError) and issubclass(APIConnectionError, APIError)
    assert issubclass(ServiceUnavailableError, InternalServerError)
    assert issubclass(InsufficientStorageError, InternalServerError)
    for cls in (BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError, ConflictError,
                PayloadTooLargeError, UnprocessableEntityError, RateLimitError, InternalServerError):
        assert issubclass(cls, APIStatusError) and issubclass(cls, APIError) and cls.__name__.endswith("Error")


def test_health_ready_metrics_models(client: Client) -> None:
    assert client.health() == {"status": "ok"}
    ready = client.ready()
    assert ready.ready is True and "precision" in ready.raw
    assert "msn_http_requests_total" in client.metrics()
    info = client.info()
    cards = client.models.list()
    assert cards == [client.models.retrieve("default")] and isinstance(cards[0], ModelCard)
    assert (cards[0].id, cards[0].model_id) == ("default", info["model_id"])  # id: what model= takes


def test_index_round_trip(client: Client) -> None:
    imgs = [random_image(10 + i) for i in range(3)]
    assert client.indexes.create("round-trip", metric="ip", type="flat")["ntotal"] == 0
    with pytest.raises(ConflictError, match="already exists"):
        client.indexes.create("round-trip")
    added = client.indexes.add("round-trip", [1, 2, 3], images=imgs, metadata=[{"f": "a"}, None, {"f": "c"}])
    assert added["added"] == 3 and added["ntotal"] == 3
    vecs = client.embeddings.create(imgs).vectors
    client.indexes.add("round-trip", np.array([7]), vectors=vecs[0] * -1)  # one 1-D vector is one row
    hits = client.indexes.search("round-trip", images=imgs[2], k=2)
    assert hits.metric == "ip" and hits.hits[0][0].id == 3 and hits.hits[0][0].metadata == {"f": "c"}
    by_vector = client.indexes.search("round-trip", vectors=vecs, k=4)
    assert by_vector.ids.shape == (3, 4) and by_vector.ids[:, 0].tolist() == [1, 2, 3]
    assert np.all(np.diff(by_vector.scores, axis=1) <= 1e-6)
    assert client.indexes.retrieve("round-trip")["ntotal"] == 4
    assert "round-trip" in [ix["name"] for ix in client.indexes.list()]
    removed = client.indexes.delete_ids("round-trip", [7, 99])
    assert removed == {"name": "round-trip", "removed": 1, "not_found": [99], "ntotal": 3}
    assert client.indexes.delete("round-trip") == {"deleted": "round-trip"}
    assert "round-trip" not in [ix["name"] for ix in client.indexes.list()]


def test_fewshot_and_label_loop_round_trip(client: Client) -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(2, 64)) * 4
    vecs = np.concatenate([c + rng.normal(size=(10, 64)) * 0.3 for c in centres]).astype(np.float32)
    ids = np.arange(100, 120)
    client.indexes.create("loop")
    client.indexes.add("loop", ids, vectors=vecs)
    first = client.indexes.select("loop", n=4, seed=1)
    assert len(first.ids) == 4 and set(first.ids.tolist()) <= set(ids.tolist()) and first.available == 20
    fitted = client.classifiers.fit("byid", ["a", "a", "b", "b"], index="loop", ids=[100, 101, 110, 111])
    assert fitted["classes"] == ["a", "b"] and fitted["n"] == 4
    nxt = client.classifiers.suggest("byid", "loop", n=3)
    assert len(nxt.ids) == 3 and not {100, 101, 110, 111} & set(nxt.ids.tolist()) and nxt.uncertainty.shape == (3,)
    page = client.classifiers.predict_index("byid", "loop", limit=15, k=2)
    assert page.total == 20 and len(page.items) == 15 and page.next_offset == 15
    assert page.class_counts == {"a": 10, "b": 10} and page.items[0].top[0].label == page.items[0].label
    last = client.classifiers.predict_index("byid", "loop", offset=page.next_offset, limit=15)
    assert len(last.items) == 5 and last.next_offset is None
    pred = client.classifiers.predict("byid", embeddings=vecs[[0, 15]], k=2)
    assert pred.labels == ["a", "b"] and pred.probabilities.min() > 0.5 and len(pred.top[0]) == 2
    imgs = [random_image(20 + i) for i in range(2)]
    by_image = client.classifiers.fit("img", ["x", "y"], images=imgs, lambd=1e-3)  # multipart: name is a text field
    assert by_image["classes"] == ["x", "y"]
    assert client.classifiers.predict("img", images=imgs, k=1).labels == ["x", "y"]
    again = client.classifiers.fit("img", ["y", "x"], embeddings=client.embeddings.create(imgs).vectors,
                                   overwrite=True)
    assert again["n"] == 2
    assert client.classifiers.retrieve("img")["classes"] == ["x", "y"]
    assert {"byid", "img"} <= {c["name"] for c in client.classifiers.list()}
    assert client.classifiers.delete("img") == {"deleted": "img"}
    with pytest.raises(NotFoundError):
        client.classifiers.retrieve("img")


def test_publish_and_reader_reload(srv: Server, client: Client, bundle_dir: Path) -> None:
    client.indexes.create("shared")
    client.indexes.add("shared", [1], vectors=np.ones(64))
    assert "shared" in client.snapshots.publish()["indexes"]
    reader = Server(bundle_dir, srv.data_dir, "--read-only", "--api-key-file", str(srv.data_dir.parent / "key"))
    reader.log_path = srv.data_dir.parent / "reader.log"
    reader.start()
    try:
        with Client(reader.url, api_key=KEY) as r:
            assert r.indexes.retrieve("shared")["ntotal"] == 1
            client.indexes.add("shared", [2], vectors=np.ones(64))
            version = client.snapshots.publish()["version"]
            assert r.snapshots.reload()["version"] == version and r.indexes.retrieve("shared")["ntotal"] == 2
            assert r.snapshots.retrieve()["serving"] == version
            with pytest.raises(PermissionDeniedError) as e:
                r.indexes.add("shared", [3], vectors=np.ones(64))
            assert e.value.status_code == 403 and "read-only" in e.value.message
        with pytest.raises(ConflictError, match="read-only replicas"):
            client.snapshots.reload()
    finally:
        reader.stop()


def test_model_admin_calls(client: Client, bundle_dir: Path) -> None:
    client.models.load("second", str(bundle_dir))  # the same bundle under a second name
    assert client.ready("second").ready and client.info("second")["model"] == "second"
    cards = client.models.list()
    assert [c.id for c in cards] == ["default", "second"] and cards[0].model_id == cards[1].model_id
    png = encode(random_image(5))
    np.testing.assert_allclose(client.embeddings.create(png, model="second").vectors,
                               client.embeddings.create(png).vectors, atol=1e-5)
    second = client.with_options(model="second")  # the default model of the calls that take one
    assert second.embeddings.create_v1(png).model == cards[1].model_id and client.options.model is None
    client.models.delete("second")
    with pytest.raises(APIStatusError) as e:
        client.embeddings.create(png, model="second")
    assert e.value.status_code in (404, 422) and "second" in e.value.message


def test_the_environment_gives_url_and_key(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MSN_BASE_URL`` / ``MSN_API_KEY`` are read when not passed; what is passed wins."""
    monkeypatch.setenv("MSN_BASE_URL", srv.url)
    monkeypatch.setenv("MSN_API_KEY", "not-the-key")
    with Client() as from_env:
        assert from_env.base_url == srv.url
        with pytest.raises(AuthenticationError):
            from_env.info()
    with Client(api_key=KEY) as passed:
        assert passed.info()["model_id"]
    monkeypatch.setenv("MSN_BASE_URL", f"http://127.0.0.1:{free_port()}")
    with Client(srv.url, api_key=KEY) as passed:
        assert passed.health() == {"status": "ok"}


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


# The README's client example (and docs/serving.md's) in a fresh interpreter where the server's stack cannot be
# imported: what ``pip install 'msn[client]'`` leaves out must not be needed.
BLOCKED = ("onnxruntime", "openvino", "faiss", "cyanure", "fastapi", "starlette", "uvicorn", "pydantic", "orjson",
           "prometheus_client", "torch", "msn_core", "training", "visualizer")
RUNNER = """
import importlib.abc, json, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed with msn[client]")

sys.meta_path.insert(0, Blocked())
out = {}
for path in sys.argv[1:]:
    ns = {}
    exec(compile(open(path).read(), path, "exec"), ns)
    out[path] = {"ids": ns["hits"].ids.tolist(), "scores": ns["hits"].scores.tolist()}
    if "masked" in ns:
        out[path].update(shape=ns["masked"].vectors.shape, keep=ns["masked"].keep_idx[0].tolist())
out["modules"] = sorted(m for m in sys.modules if m.startswith(("msn", "training", "visualizer")))
print(json.dumps(out))
"""


def python_block(doc: str, marker: str) -> str:
    text = (REPO / doc).read_text()
    assert marker in text, f"{doc} lost its client example"
    return re.match(r"\s*```python\n(.*?)```", text.split(marker, 1)[1], re.DOTALL).group(1)


def test_the_doc_examples_run_with_only_the_clients_dependencies(srv: Server, tmp_path: Path) -> None:
    """The README's block as written (``Client()``: URL and key from the environment) and docs/serving.md's (its
    URL and key replaced), on two images written for them, against this module's server, with the server's
    libraries unimportable."""
    readme = python_block("README.md", "<!-- tests/serve/test_client.py runs this block as written -->")
    serving = python_block("docs/serving.md", "<!-- tests/serve/test_client.py runs this block with its server's "
                                              "URL and key -->")
    call = 'Client("http://localhost:8000", api_key="..."'
    assert call in serving
    (tmp_path / "readme.py").write_text(readme)
    (tmp_path / "serving.py").write_text(serving.replace(call, f"Client({srv.url!r}, api_key={KEY!r}"))
    (tmp_path / "runner.py").write_text(f"BLOCKED = {BLOCKED!r}\n{RUNNER}")
    for i, name in enumerate(("cat.png", "dog.png")):
        Image.fromarray(random_image(40 + i)).save(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSN_")}
    env.update({"MSN_BASE_URL": srv.url, "MSN_API_KEY": KEY, "PYTHONPATH": str(REPO)})
    r = subprocess.run([sys.executable, "runner.py", "readme.py", "serving.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for doc in ("readme.py", "serving.py"):
        assert out[doc]["ids"] == [[1, 2]] and out[doc]["scores"][0][0] > out[doc]["scores"][0][1], doc
    from msn_core.masks import resolve_mask

    kept = resolve_mask({"ratio": 0.7, "seed": 1}, 8)  # the tiny bundle's 8 x 8 patch grid
    assert out["readme.py"]["shape"] == [1, 64] and out["readme.py"]["keep"] == kept.tolist()
    assert all(m == "msn_serve" or m.startswith("msn_serve.client") for m in out["modules"]), out["modules"]
    assert "404" in r.stdout  # docs/serving.md's example caught the NotFoundError it shows
