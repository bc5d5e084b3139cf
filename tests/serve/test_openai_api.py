"""The OpenAI-compatible routes (``/v1/embeddings``, ``/v1/models``) against real servers, driven by the official
``openai`` package: the vectors are ``/embed``'s, the errors are OpenAI's, the limits and the key are the API's, and
URL inputs never reach a non-public address."""
from __future__ import annotations

import base64
import http.server
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import Server, encode, random_image

from msn_serve.errors import ApiError
from msn_serve.http.url_fetch import fetch_image, public_address

KEY = "sk-test-openai-key"


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(encode(random_image(seed))).decode()


def embed_native(srv: Server, urls: list[str], mask=None, headers=None) -> tuple[np.ndarray, list[int]]:
    """``/embed``'s embeddings of the same images (and mask), and the patches it kept of each."""
    body: dict = {"images": [u.partition(",")[2] for u in urls]}
    if mask is not None:
        body["mask"] = mask
    r = httpx.post(f"{srv.url}/embed", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32), r.json()["kept_tokens"]


def model_id(srv: Server) -> str:
    return httpx.get(f"{srv.url}/info", timeout=10).json()["model_id"]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def keyed(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with an API key, URL inputs enabled and at most 3 images per request."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    srv = Server(bundle_dir, tmp_path_factory.mktemp("openai") / "data", "--api-key-file", str(key_file),
                 "--allow-url-inputs", "--max-images-per-request", "3").start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("mask", [None, {"ratio": 0.5, "seed": 3},
                                  [{"ratio": 0.25, "seed": 1}, {"focal": {"size": [4, 4]}}, {"keep_idx": [0, 5, 9]}]])
def test_vectors_match_embed(server: Server, client: openai.OpenAI, mask) -> None:
    urls = [data_url(s) for s in range(3)]
    want, kept = embed_native(server, urls, mask)
    extra = {"mask": mask} if mask is not None else None
    name = model_id(server)
    as_float = client.embeddings.create(model=name, input=urls, encoding_format="float", extra_body=extra)
    by_default = client.embeddings.create(model=name, input=urls, extra_body=extra)  # the client asks for base64
    as_b64 = client.embeddings.create(model=name, input=urls, encoding_format="base64", extra_body=extra)
    for resp in (as_float, by_default):
        got = np.asarray([d.embedding for d in resp.data], dtype=np.float32)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5
    raw = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_b64.data])
    assert np.array_equal(raw, want)  # the bytes of the same float32 vectors
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.model == name
    if mask is None:
        assert kept == [httpx.get(f"{server.url}/info").json()["num_patches"]] * 3
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(kept)


def test_wire_format_is_openais(server: Server) -> None:
    """The raw JSON: exactly OpenAI's keys, one image as a plain string, raw base64 (no data URL) accepted."""
    raw_b64 = data_url(7).partition(",")[2]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "msn", "input": raw_b64, "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"} and body["object"] == "list"
    assert set(body["data"][0]) == {"object", "index", "embedding"} and body["data"][0]["object"] == "embedding"
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    assert np.abs(np.asarray(body["data"][0]["embedding"]) - embed_native(server, [data_url(7)])[0][0]).max() <= 1e-5


def test_models_list(server: Server, client: openai.OpenAI) -> None:
    """``id`` is the served name (what ``model`` takes; one unnamed bundle is ``default``), ``model_id`` the
    bundle's; the bundle's id is still accepted as ``model`` while one served model has it."""
    models = client.models.list()
    assert [(m.id, m.model_id) for m in models.data] == [("default", model_id(server))]
    card = models.data[0]
    assert card.object == "model" and card.owned_by and card.created > 0
    assert client.models.retrieve("default").model_id == model_id(server)
    assert client.models.retrieve(model_id(server)).id == "default"
    by_name = client.embeddings.create(model="default", input=[data_url(0)], encoding_format="float")
    by_bundle = client.embeddings.create(model=model_id(server), input=[data_url(0)], encoding_format="float")
    assert by_name.model == model_id(server) and by_name.data[0].embedding == by_bundle.data[0].embedding
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert "'default'" in e.value.body["message"]


def test_errors_are_openais(server: Server, client: openai.OpenAI) -> None:
    name = model_id(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input=[data_url(0)])
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "model"
    assert "text-embedding-3-small" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=name, input=[data_url(0), "data:image/png;base64,@@not base64@@"])
    assert e.value.status_code == 400 and "input[1]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # not an image: the decoder's error, in OpenAI's shape
        client.embeddings.create(model=name, input=[data_url(0), base64.b64encode(b"plain text").decode()])
    assert "input[1]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=name, input=[data_url(0)], extra_body={"mask": {"ratio": 2}})
    assert e.value.body["param"] == "mask"
    with pytest.raises(openai.APIStatusError) as e:  # 257 inputs: refused on the count, before any decoding
        client.embeddings.create(model=name, input=["x"] * 257)
    assert e.value.status_code == 413 and "max_images_per_request" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=name, input=["https://example.com/cat.png"])
    assert "--allow-url-inputs" in e.value.body["message"]
    r = httpx.post(f"{server.url}/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_auth_limits_and_url_inputs(keyed: Server) -> None:
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    name = httpx.get(f"{keyed.url}/info", headers={"Authorization": f"Bearer {KEY}"}).json()["model_id"]
    resp = good.embeddings.create(model=name, input=[data_url(1)], encoding_format="float")
    want, _ = embed_native(keyed, [data_url(1)], headers={"Authorization": f"Bearer {KEY}"})
    assert np.abs(np.asarray(resp.data[0].embedding) - want[0]).max() <= 1e-5
    assert [m.id for m in good.models.list().data] == ["default"]
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.embeddings.create(model=name, input=[data_url(1)])
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.APIStatusError) as e:
        good.embeddings.create(model=name, input=[data_url(i) for i in range(4)])
    assert e.value.status_code == 413

    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(encode(random_image(1)))

        def log_message(self, *args) -> None:
            pass

    local = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=local.serve_forever, daemon=True).start()
    try:
        port = local.server_address[1]
        for url in (f"http://127.0.0.1:{port}/cat.png", f"http://localhost:{port}/cat.png", "http://10.1.2.3/x.png",
                    "http://169.254.169.254/latest/meta-data", f"http://[::ffff:127.0.0.1]:{port}/x.png"):
            with pytest.raises(openai.BadRequestError) as e:
                good.embeddings.create(model=name, input=[data_url(0), url])
            assert "input[1]" in e.value.body["message"] and "non-public" in e.value.body["message"], url
        with pytest.raises(openai.BadRequestError) as e:
            good.embeddings.create(model=name, input=["http://user:pw@example.com/x.png"])
        assert "credentials" in e.value.body["message"]
        assert hits == []  # refused before any connection
        httpx.get(f"http://127.0.0.1:{port}/probe")
        assert hits == ["/probe"]  # the recorder does record what reaches it
    finally:
        local.shutdown()


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "240.0.0.1", "::1", "fe80::1", "fc00::1",
                                     "::ffff:127.0.0.1", "ff02::1"])
def test_non_public_addresses_refused(address: str) -> None:
    with pytest.raises(ApiError) as e:
        public_address(address, 80)
    assert e.value.status == 400 and "non-public" in e.value.message


def test_public_address_accepted() -> None:
    assert public_address("8.8.8.8", 443) == "8.8.8.8"
    assert public_address("2001:4860:4860::8888", 443) == "2001:4860:4860::8888"


DRIP_S = 6.0


class _Files(http.server.BaseHTTPRequestHandler):
    """/big: a body over the limit without Content-Length; /drip: a body a byte at a time; /moved: a redirect."""

    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/ok")
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        if self.path == "/big":
            self.wfile.write(b"x" * 5000)
        elif self.path == "/drip":  # a byte every 0.1 s: each read is quick, the whole body takes DRIP_S
            for _ in range(round(DRIP_S / 0.1)):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.wfile.write(b"image bytes")

    def log_message(self, *args) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # the fetch hangs up on /drip and /big on purpose


def test_fetch_limits_against_a_local_server() -> None:
    """The fetch's own bounds (redirects, size, time), reached over loopback by passing a resolver that allows it
    (the server always passes none: public addresses only)."""
    srv = _Quiet(("127.0.0.1", 0), _Files)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"

    def loopback(host, port):
        return "127.0.0.1"

    try:
        assert fetch_image(f"{base}/ok", max_bytes=100, timeout_s=5, resolve=loopback) == b"image bytes"
        with pytest.raises(ApiError, match="redirects are not followed"):
            fetch_image(f"{base}/moved", max_bytes=100, timeout_s=5, resolve=loopback)
        with pytest.raises(ApiError, match="url_max_mb") as e:
            fetch_image(f"{base}/big", max_bytes=1000, timeout_s=5, resolve=loopback)
        assert e.value.status == 413
        start = time.monotonic()
        with pytest.raises(ApiError, match="url_timeout_s"):
            fetch_image(f"{base}/drip", max_bytes=1000, timeout_s=0.5, resolve=loopback)
        # the deadline holds for the whole fetch, not each read (a read deadline would see the whole body arrive)
        assert time.monotonic() - start < DRIP_S / 2
        with pytest.raises(ApiError, match="non-public"):  # and without the test's resolver: refused
            fetch_image(f"{base}/ok", max_bytes=100, timeout_s=5)
    finally:
        srv.shutdown()
