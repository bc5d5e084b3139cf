"""Two msn-serve processes on one Milvus *server*: what the stateless-replica deployment (deploy/k8s/milvus) relies on.

Milvus Lite opens its file in one process, so sharing an index between msn-serve processes needs a Milvus server. The
``milvus`` package (PyPI, 2.3.5) starts a local standalone Milvus 2.3.5 from its own binaries; one is started for this
module. It predates nullable fields (Milvus 2.5), so the adds here carry metadata for every id, and an add without
it is the 503 the docs describe. Skipped when the package is not installed (it is not in any extra: a 58 MB wheel
of a 2023 server, see docs/serving.md, "Milvus backend").
"""
from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_helpers import Server

pytest.importorskip("pymilvus")
milvus = pytest.importorskip("milvus", reason="needs the `milvus` package (a local Milvus server): "
                                              "pip install milvus==2.3.5")
DIM = 64
VISIBLE_WITHIN_S = 1.0
ETCD_PEER_PORT = 2380


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def milvus_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Milvus server on the first free ports from 19530. Its embedded etcd also listens on 2380, which the package
    does not let one change: a second such server on the machine cannot start."""
    if not _port_free(ETCD_PEER_PORT):
        pytest.skip(f"port {ETCD_PEER_PORT} is in use (another Milvus or etcd?): the `milvus` package's embedded "
                    "etcd needs it")
    base = tmp_path_factory.mktemp("milvus-server")
    # its 246 MB of binaries, unpacked once per version (4 s) and shared by every run; the data stays in tmp
    cache = Path.home() / ".cache" / "msn-tests" / f"milvus-{milvus.__version__}"
    milvus._initialize_data_files(str(cache))
    (base / "bin").symlink_to(cache / "bin")
    server = milvus.MilvusServer(wait_for_started=False)  # its own wait spins until its timeout if the server dies
    server.set_base_dir(str(base))
    server.start()
    try:
        health = f"http://127.0.0.1:{server.webservice_port}/healthz"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.server_proc.poll() is not None:
                tail = (base / "logs" / "milvus-stdout.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"the Milvus server exited with {server.server_proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the Milvus server did not answer its /healthz within 60 s")
        yield f"http://127.0.0.1:{server.listen_port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pair(bundle_dir: Path, milvus_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Server A creates index ``shared`` with 20 items before server B starts (B finds it at start-up)."""
    root = tmp_path_factory.mktemp("two-servers")
    args = ("--index-backend", "milvus", "--milvus-uri", milvus_url)
    a = Server(bundle_dir, root / "a", *args).start()
    servers = [a]
    try:
        with a.client() as c:
            assert c.post("/index/shared", json={"type": "hnsw"}).status_code == 201
            r = c.post("/index/shared/add", json={"ids": list(range(20)), "vectors": _vectors(20).tolist(),
                                                  "metadata": [{"n": i} for i in range(20)]})
            assert r.status_code == 200, r.text
        servers.append(Server(bundle_dir, root / "b", *args).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def _seconds_until_found(writer: httpx.Client, reader: httpx.Client, item: int, vec: np.ndarray) -> float:
    """Add ``item`` through ``writer``; seconds from its acknowledgement until ``reader``'s search returns it."""
    r = writer.post("/index/shared/add", json={"ids": [item], "vectors": [vec.tolist()],
                                               "metadata": [{"item": item}]})
    assert r.status_code == 200, r.text
    acked = time.perf_counter()
    while (waited := time.perf_counter() - acked) < 5:
        hit = reader.post("/index/shared/search", json={"vectors": [vec.tolist()], "k": 1}).json()["results"][0]
        if hit and hit[0]["id"] == item:
            assert hit[0]["metadata"] == {"item": item}
            return time.perf_counter() - acked
    pytest.fail(f"item {item} added through one server not found through the other after {waited:.1f} s")


def test_a_write_through_one_server_is_found_through_the_other_within_a_second(pair: list[Server]):
    a, b = pair
    fresh = _vectors(2, seed=1)
    with a.client() as ca, b.client() as cb:
        seen = [_seconds_until_found(ca, cb, 1000, fresh[0]), _seconds_until_found(cb, ca, 1001, fresh[1])]
        print(f"write -> visible on the other server: {', '.join(f'{s * 1000:.0f} ms' for s in seen)}")
        assert max(seen) < VISIBLE_WITHIN_S, seen
        assert cb.get("/index/shared").json()["milvus"]["lite"] is False
        # Milvus 2.3 has no nullable fields: an add without metadata is refused by the server, a 503 naming Milvus
        r = ca.post("/index/shared/add", json={"ids": [2000], "vectors": [fresh[1].tolist()]})
        assert r.status_code == 503 and "Milvus" in r.json()["error"], r.text


def test_counts_replacements_and_deletes_are_the_engines(pair: list[Server]):
    """On a server the engine, not each process' memory, says which ids are stored."""
    a, b = pair
    vec = _vectors(1, seed=3).tolist()
    with a.client() as ca, b.client() as cb:
        assert ca.post("/index/shared/add", json={"ids": [3000], "vectors": vec, "metadata": [{}]}
                       ).json()["added"] == 1
        assert cb.post("/index/shared/add", json={"ids": [3000], "vectors": vec, "metadata": [{"again": 1}]}
                       ).json()["replaced"] == 1
        assert cb.get("/index/shared").json()["ntotal"] == ca.get("/index/shared").json()["ntotal"]
        assert cb.post("/index/shared/delete", json={"ids": [3000]}).json()["removed"] == 1
        assert ca.post("/index/shared/delete", json={"ids": [3000]}).json()["not_found"] == [3000]


def test_an_index_created_through_one_server_is_served_by_the_other(pair: list[Server]):
    a, b = pair
    with a.client() as ca, b.client() as cb:
        assert ca.post("/index/later", json={}).status_code == 201
        assert cb.get("/index/later").status_code == 200
        assert "later" in {i["name"] for i in cb.get("/index").json()["indexes"]}
