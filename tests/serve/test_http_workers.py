"""HTTP worker processes (``--http-workers``): real servers, the same answers as one process, and their failures.

Every server here is a real ``python -m msn_serve`` with its HTTP processes; the single-process server of the same
bundle (``server``, from conftest) is the reference the answers are compared with, bit for bit. The whole serving
suite also runs with workers on: ``MSN_TEST_HTTP_WORKERS=2 pytest tests/serve`` (docs/serving.md).
"""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_helpers import PREPROCESSING, Server, encode, random_image

from msn_serve.config import Settings
from msn_serve.runtime import Runtime
from msn_serve.workers.launch import choose_http_workers

IMAGES = [encode(random_image(1)), encode(random_image(2, 60, 30), "JPEG", quality=90),
          encode(np.asarray(random_image(3, 50, 50))[:, :, 0]), encode(random_image(4, 400, 300), "JPEG")]
RAW = {"accept": "application/octet-stream"}


@pytest.fixture(scope="module")
def workers(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(bundle_dir, tmp_path_factory.mktemp("workers") / "data", "--http-workers", "2").start()
    yield srv
    srv.stop()


def _front_end(srv: Server) -> dict:
    return httpx.get(f"{srv.url}/readyz", timeout=10).json()["front_end"]


def _pids(srv: Server) -> list[int]:
    return [p["pid"] for p in _front_end(srv)["processes"]]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie child of a dead parent is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_embeddings_are_bit_identical_to_the_single_process(workers: Server, server: Server):
    """Crops cross as uint8 and are normalised in the engine process: the same bits as the single process's
    float32 path, masked or not, one image or several, multipart or JSON."""
    cases = [
        ({"files": [("image", ("a.png", IMAGES[0]))]}),
        ({"files": [("images", (f"{i}.img", d)) for i, d in enumerate(IMAGES)]}),
        ({"files": [("images", (f"{i}.img", d)) for i, d in enumerate(IMAGES)],
          "data": {"mask": '{"ratio": 0.5, "seed": 3}'}}),
        ({"files": [("images", (f"{i}.img", d)) for i, d in enumerate(IMAGES[:2])],
          "data": {"mask": '[{"ratio": 0.25, "seed": 1}, {"keep_idx": [0, 5, 9]}]', "normalize": "true"}}),
        ({"json": {"images": [base64.b64encode(d).decode() for d in IMAGES], "mask": {"ratio": 0.7, "seed": 2}}}),
    ]
    with workers.client() as w, server.client() as s:
        for kwargs in cases:
            a, b = w.post("/embed", headers=RAW, **kwargs), s.post("/embed", headers=RAW, **kwargs)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.content == b.content and a.headers["x-kept-tokens"] == b.headers["x-kept-tokens"]
            ja, jb = w.post("/embed", **kwargs).json(), s.post("/embed", **kwargs).json()
            assert ja == jb


def _worker_calls(srv: Server) -> int:
    """Embed calls the HTTP processes sent to the engine process: requests that took the worker path."""
    return sum(p["embed_calls"] for p in _front_end(srv)["processes"])


def _oip(pixels: np.ndarray, keep: np.ndarray | None = None, *, binary: bool = False,
         parameters: dict | None = None) -> dict:
    """An OIP infer request's httpx arguments: JSON tensors, or Triton's binary extension (binary output too)."""
    inputs = [("pixel_values", "FP32", pixels)] + ([("keep_idx", "INT64", keep)] if keep is not None else [])
    head: dict = {"inputs": [], "parameters": dict(parameters or {})}
    blobs = []
    for name, dtype, arr in inputs:
        spec = {"name": name, "shape": list(arr.shape), "datatype": dtype}
        if binary:
            blobs.append(arr.astype("<f4" if dtype == "FP32" else "<i8").tobytes())
            spec["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            spec["data"] = arr.reshape(-1).tolist()
        head["inputs"].append(spec)
    if not binary:
        return {"json": head}
    head["parameters"]["binary_data_output"] = True
    text = json.dumps(head).encode()
    return {"content": text + b"".join(blobs), "headers": {"Inference-Header-Content-Length": str(len(text)),
                                                           "content-type": "application/octet-stream"}}


def test_v1_and_oip_take_the_worker_path_with_the_single_process_bits(workers: Server, server: Server):
    """/v1/embeddings and OIP infer are prepared in the HTTP processes like /embed (decoded, cropped, normalised;
    OIP's pixel_values checked) and answer the single process's bytes: masked or not, one input or several, JSON or
    binary tensors, floats or base64."""
    urls = [f"data:image/png;base64,{base64.b64encode(d).decode()}" for d in IMAGES]
    rng = np.random.default_rng(5)
    pixels = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    keep = np.array([[0, 5, 9, -1], [1, 2, 3, 4], [7, -1, -1, -1]])
    cases = [
        ("/v1/embeddings", {"json": {"model": "msn", "input": urls[0]}}),
        ("/v1/embeddings", {"json": {"model": "default", "input": urls, "encoding_format": "base64"}}),
        ("/v1/embeddings", {"json": {"model": "msn", "input": urls[:2], "mask": [{"ratio": 0.5, "seed": 1},
                                                                                {"keep_idx": [0, 3]}]}}),
        ("/v2/models/msn/infer", _oip(pixels[:1])),
        ("/v2/models/msn/infer", _oip(pixels, keep)),
        ("/v2/models/msn/versions/1/infer", _oip(pixels, keep, binary=True)),
        ("/v2/models/default/infer", _oip(pixels[:2], parameters={"mask": '{"ratio": 0.7, "seed": 2}'})),
    ]
    before = _worker_calls(workers)
    with workers.client() as w, server.client() as s:
        for path, kwargs in cases:
            a, b = w.post(path, **kwargs), s.post(path, **kwargs)
            assert a.status_code == b.status_code == 200, (path, a.text, b.text)
            assert a.content == b.content and a.headers["content-type"] == b.headers["content-type"], path
    assert _worker_calls(workers) - before == len(cases)  # none was forwarded to the engine process's app


def test_every_other_route_answers_as_the_single_process(workers: Server, server: Server):
    """Indexes, classifiers, /v1, OIP, /info and /metrics are served by the engine process's own app."""
    img64 = base64.b64encode(IMAGES[0]).decode()
    with workers.client() as w, server.client() as s:
        for c in (w, s):
            assert c.post("/index/shop", json={"type": "flat"}).status_code == 201
            r = c.post("/index/shop/add", json={"ids": [1, 2], "images": [img64, base64.b64encode(IMAGES[1]).decode()],
                                                "metadata": [{"n": 1}, {"n": 2}]})
            assert r.status_code == 200, r.text
            r = c.post("/fewshot/fit", json={"name": "clf", "labels": ["a", "b"], "images": [img64, img64]})
            assert r.status_code == 201, r.text
        for method, path, kwargs in [
            ("POST", "/index/shop/search", {"json": {"images": [img64], "k": 2}}),
            ("POST", "/fewshot/clf/predict", {"json": {"images": [img64]}}),
            ("POST", "/v1/embeddings", {"json": {"model": "msn", "input": [f"data:image/png;base64,{img64}"]}}),
            ("POST", "/v2/models/msn/infer", {"json": {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                                                   "data": [img64]}]}}),
            ("GET", "/v1/models", {}), ("GET", "/index", {}), ("GET", "/fewshot/clf", {}),
            ("GET", "/nowhere", {}), ("POST", "/index/nothere/search", {"json": {"images": [img64]}}),
        ]:
            a, b = w.request(method, path, **kwargs), s.request(method, path, **kwargs)
            assert (a.status_code, a.headers["content-type"]) == (b.status_code, b.headers["content-type"]), path
            assert _stable(a.json()) == _stable(b.json()), path
        info = w.get("/info").json()
        assert info["model_id"] == s.get("/info").json()["model_id"]
        w.post("/embed", files={"image": IMAGES[0]})
        metrics = _metrics_counting(w, at_least=1)  # HTTP processes' requests counted in the engine process's view
    assert _embed_count(metrics) >= 1
    assert "msn_http_workers 2.0" in metrics


def _raw(srv: Server, request: bytes) -> bytes:
    """One raw request's whole response: its head, then as many body bytes as its content-length says (the body
    may come in a later segment than the head)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(request)
        response = b""
        while b"\r\n\r\n" not in response and (chunk := sock.recv(65536)):
            response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
        return head + b"\r\n\r\n" + body


def _stable(body: object) -> object:
    """``body`` without what differs between two servers' equal answers: times."""
    if isinstance(body, dict):
        return {k: _stable(v) for k, v in body.items() if k not in ("created", "updated", "fit_seconds", "seconds")}
    if isinstance(body, list):
        return [_stable(v) for v in body]
    return body


def test_bad_input_gets_the_single_process_answer(workers: Server, server: Server):
    cases = [
        ({"files": {"image": ("x.png", b"not an image")}}, {}),
        ({"files": {"image": ("x.png", IMAGES[0][: len(IMAGES[0]) // 2])}}, {}),
        ({"files": {"image": IMAGES[0]}, "data": {"mask": '{"ratio": 1.5}'}}, {}),
        ({"files": {"image": IMAGES[0]}, "data": {"model": "nope"}}, {}),
        ({"files": {"image": IMAGES[0]}}, {"accept": "text/html"}),
        ({"content": b"x", "headers": {"content-type": "text/plain"}}, {}),
        ({"json": {"images": "not a list"}}, {}),
        ({"json": {}}, {}),
    ]
    png = f"data:image/png;base64,{base64.b64encode(IMAGES[0]).decode()}"
    px = np.zeros((1, 3, 32, 32), np.float32)
    other = [  # /v1 (OpenAI's error object) and OIP: the same answers from the HTTP processes' stages
        ("/v1/embeddings", {"json": {"model": "msn", "input": "data:image/png;base64,!!"}}),
        ("/v1/embeddings", {"json": {"model": "msn", "input": [png, "data:image/png;base64,aGVsbG8="]}}),
        ("/v1/embeddings", {"json": {"model": "nope", "input": png}}),
        ("/v1/embeddings", {"json": {"model": "msn", "input": png, "mask": {"ratio": 2}}}),
        ("/v1/embeddings", {"json": {"model": "msn", "input": png, "colour": 1}}),
        ("/v1/embeddings", {"content": b"x", "headers": {"content-type": "text/plain"}}),
        ("/v2/models/nope/infer", _oip(px)),
        ("/v2/models/msn/infer", _oip(np.zeros((1, 3, 16, 16), np.float32))),
        ("/v2/models/msn/infer", _oip(px, np.array([[0, 64]]))),
        ("/v2/models/msn/infer", _oip(px, np.array([[1]]), parameters={"mask": '{"ratio": 0.5}'})),
        ("/v2/models/msn/infer", _oip(np.full((1, 3, 32, 32), 3e38, np.float32))),
        ("/v2/models/msn/infer", {"content": b"{", "headers": {"content-type": "application/json"}}),
    ]
    with workers.client() as w, server.client() as s:
        for kwargs, headers in cases:
            kw = {**kwargs, "headers": {**kwargs.get("headers", {}), **headers}}
            a, b = w.post("/embed", **kw), s.post("/embed", **kw)
            assert 400 <= a.status_code < 500 and a.status_code == b.status_code, (a.text, b.text)
            assert a.json() == b.json()
        for path, kw in other:
            a, b = w.post(path, **kw), s.post(path, **kw)
            assert 400 <= a.status_code < 500 and a.status_code == b.status_code, (path, a.text, b.text)
            assert a.json() == b.json(), path
        head = _raw(workers, b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 1000000000\r\n\r\n{")
        assert head.startswith(b"HTTP/1.1 413") and b"max_body_mb" in head  # refused before the body is read
        assert w.post("/embed", files={"image": IMAGES[0]}).status_code == 200  # still serving


BIG = 576  # px: a crop over the 512 x 512 x 3 the slots were once fixed at


@pytest.fixture(scope="module")
def big_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose input, 3 x 576 x 576 float32 (3.98 MB), is larger than anything else served here; tiny
    otherwise (width 32, depth 1, 12 x 12 patches of 48 px)."""
    import torch

    from training.bundle.export import export_bundle
    from training.model.vit import VisionTransformer

    torch.manual_seed(2)
    encoder = VisionTransformer(image_size=BIG, patch_size=48, embed_dim=32, depth=1, num_heads=2)
    out = tmp_path_factory.mktemp("big") / "big"
    export_bundle(encoder, out, arch="vit_tiny", preprocessing={**PREPROCESSING, "resize": 600, "crop": BIG},
                  feature="cls_pre_norm", parity_check=False)  # the graph's parity is the export tests' business
    return out


def test_a_crop_over_512_px_fits_slots_sized_for_the_largest_model(big_bundle: Path, bundle_dir: Path,
                                                                   workers: Server, tmp_path: Path):
    """Slots are sized at start-up for the largest model served (here not the default one), so a 576-px model's
    images, masked or not, through /embed, /v1 and OIP, embed as one process embeds them (the same runtime, in
    this process); a server whose slots were sized for smaller models refuses such a model added while serving,
    naming the sizes, and keeps serving what it served."""
    import asyncio

    from msn_core.bundle import load_bundle_info
    from msn_serve.embedding.preprocess import preprocess_bytes
    from msn_serve.masks import request_keep_idx
    from msn_serve.workers.ring import image_bytes

    info = load_bundle_info(big_bundle)
    images = [encode(random_image(7, 640, 700), "JPEG", quality=90), encode(random_image(8, 600, 600))]
    full = np.arange(info.num_patches)
    masked = request_keep_idx({"ratio": 0.5, "seed": 3}, 1, info.grid)
    pixels = preprocess_bytes(images[0], info.preprocessing, max_pixels=10**8)[None]
    srv = Server(f"tiny={bundle_dir}", tmp_path / "data", "--bundle", f"big={big_bundle}", "--http-workers", "2",
                 "--max-batch-size", "4").start()
    try:
        assert all(p["slot_bytes"] >= image_bytes(info) for p in _front_end(srv)["processes"])
        with srv.client() as c:
            answers = [
                c.post("/embed", headers=RAW, files=[("images", d) for d in images], data={"model": "big"}),
                c.post("/embed", headers=RAW, files={"image": images[1]},
                       data={"model": "big", "mask": '{"ratio": 0.5, "seed": 3}'}),
                c.post("/v2/models/big/infer", **_oip(pixels, binary=True)),
                c.post("/v1/embeddings", json={"model": "big", "encoding_format": "base64",
                                               "input": base64.b64encode(images[0]).decode()}),
            ]
        assert [a.status_code for a in answers] == [200] * 4, [a.text[:300] for a in answers]
    finally:
        srv.stop()
    runtime = Runtime(Settings(bundle=[str(big_bundle)], data_dir=tmp_path / "one", precision="fp32",
                               runtime="onnxruntime", intra_op_threads=1, max_batch_size=4))

    async def one_process() -> list[np.ndarray]:
        await runtime.start()
        try:
            emb = runtime.models.default.embedding
            return [await emb.embed_images([("a", images[0]), ("b", images[1])], [full, full]),
                    await emb.embed_images([("b", images[1])], masked),
                    await emb.embed_items([(pixels[0], full)]),
                    await emb.embed_images([("a", images[0])], [full])]
        finally:
            await runtime.stop()

    expected = asyncio.run(one_process())
    got = [np.frombuffer(a.content, "<f4") for a in answers[:2]]
    got.append(np.frombuffer(answers[2].content[int(answers[2].headers["inference-header-content-length"]):], "<f4"))
    got.append(np.frombuffer(base64.b64decode(answers[3].json()["data"][0]["embedding"]), "<f4"))
    for g, e in zip(got, expected, strict=True):
        assert g.tobytes() == e.astype("<f4").tobytes()

    with workers.client() as c:  # slots sized for the 32-px model: the 576-px one is refused, nothing changes
        r = c.put("/admin/models/huge", json={"bundle": str(big_bundle)})
        assert r.status_code == 422, r.text
        assert "3 x 576 x 576" in r.json()["error"] and "3 x 32 x 32" in r.json()["error"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["default"]
        assert c.post("/embed", files={"image": IMAGES[0]}).status_code == 200


def test_connections_spread_evenly_over_the_http_processes(workers: Server):
    before = [p["connections"] for p in _front_end(workers)["processes"]]
    clients = [workers.client() for _ in range(10)]
    try:
        with ThreadPoolExecutor(10) as pool:
            assert all(r.status_code == 200 for r in pool.map(lambda c: c.post("/embed", files={"image": IMAGES[0]}),
                                                              clients))
        after = [p["connections"] for p in _front_end(workers)["processes"]]
    finally:
        for c in clients:
            c.close()
    added = [a - b for a, b in zip(after, before, strict=True)]
    assert max(added) - min(added) <= 2, added  # the readyz probes' own connections land anywhere


def test_full_slots_answer_503_and_no_slot_is_overrun(bundle_dir: Path, tmp_path: Path):
    """The link's own checks, on a ring of one page-sized slot: two images find one slot (503 + Retry-After), an
    image larger than a slot is refused (500 naming the sizes) with nothing written; and a server never has fewer
    slots than its largest request (``--http-worker-slots 1`` serves two images)."""
    import asyncio

    from msn_serve.errors import ApiError
    from msn_serve.workers.link import EngineLink
    from msn_serve.workers.ring import PAGE, CropRing

    ring = CropRing.create(1, PAGE)

    async def refused(items: list) -> ApiError:
        here, there = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=here)
        link = EngineLink(reader, writer, ring, on_lost=lambda: None)
        try:
            await link.embed(None, "", items)
        except ApiError as e:
            return e
        finally:
            writer.close()
            there.close()
        raise AssertionError("not refused")

    small = (np.ones((3, 8, 8), np.float32), np.arange(4))
    full = asyncio.run(refused([small, small]))
    assert full.status == 503 and full.headers["Retry-After"] == "1" and "slots" in full.message
    big = asyncio.run(refused([(np.ones((3, 64, 64), np.float32), np.arange(4))]))
    assert big.status == 500 and "[3, 64, 64]" in big.message and f"{PAGE} bytes" in big.message
    assert not ring._buf.any()  # nothing was written
    with pytest.raises(ValueError, match="does not fit"):
        ring.write(0, np.ones((3, 32, 32), np.float32), np.arange(1))

    srv = Server(bundle_dir, tmp_path / "data", "--http-workers", "1", "--http-worker-slots", "1",
                 "--max-images-per-request", "2").start()
    try:
        assert [p["slots"] for p in _front_end(srv)["processes"]] == [2]
        with srv.client() as c:
            assert c.post("/embed", files=[("images", IMAGES[0]), ("images", IMAGES[1])]).status_code == 200
    finally:
        srv.stop()


def test_a_killed_http_process_is_restarted_and_nothing_is_lost(workers: Server):
    with workers.client() as c:
        c.post("/embed", files={"image": IMAGES[0]})
        counted = _embed_count(c.get("/metrics").text)
        victim = _pids(workers)[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            procs = _front_end(workers)["processes"]
            if procs[0]["pid"] != victim and procs[0]["live"]:
                break
            time.sleep(0.2)
        assert procs[0]["restarts"] == 1 and procs[0]["pid"] != victim, procs
        for _ in range(6):  # fresh connections reach both processes, the new one included
            with workers.client() as fresh:
                assert fresh.post("/embed", files={"image": IMAGES[1]}).status_code == 200
        assert _embed_count(_metrics_counting(c, at_least=counted + 6)) >= counted + 6  # counters never went down
        assert "msn_http_worker_restarts_total 1.0" in c.get("/metrics").text
    assert workers.alive()


def _metrics_counting(client, at_least: float) -> str:
    """/metrics once it counts `at_least` embeds (or after 5 s): an HTTP process reports a request just after
    answering it, so the last count can reach the engine process a moment after its reply."""
    deadline = time.monotonic() + 5
    while _embed_count(metrics := client.get("/metrics").text) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics


def _embed_count(metrics: str) -> float:
    return sum(float(ln.split()[-1]) for ln in metrics.splitlines()
               if ln.startswith('msn_http_requests_total{method="POST",route="/embed"'))


def test_sigterm_drains_and_a_killed_engine_takes_the_http_processes_down(bundle_dir: Path, tmp_path: Path):
    srv = Server(bundle_dir, tmp_path / "data", "--http-workers", "2").start()
    pids = _pids(srv)
    files = [("images", (f"{i}.jpg", IMAGES[3])) for i in range(16)]

    def post(_: int) -> int:
        try:
            with srv.client() as c:
                return c.post("/embed", files=files).status_code
        except httpx.TransportError:
            return -1  # refused once the listener closed: never acknowledged

    with ThreadPoolExecutor(8) as pool:
        started = [pool.submit(post, i) for i in range(8)]
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        codes = [f.result() for f in started]
    assert srv.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled, as one process does
    assert all(c in (200, -1) for c in codes) and codes.count(200) >= 1, codes
    assert all(_gone(p) for p in pids)

    srv = Server(bundle_dir, tmp_path / "data2", "--http-workers", "2").start()
    pids = _pids(srv)
    srv.kill9()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_sighup_reloads_the_keys_of_every_http_process(bundle_dir: Path, tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("read first-key reader\n")
    srv = Server(bundle_dir, tmp_path / "data", "--http-workers", "2", "--api-keys-file", str(keys)).start()
    try:
        def status(key: str) -> set[int]:
            codes = set()
            for _ in range(4):  # new connections: both HTTP processes answer
                with srv.client(headers={"authorization": f"Bearer {key}"}) as c:
                    codes.add(c.post("/embed", files={"image": IMAGES[0]}).status_code)
            return codes

        assert status("first-key") == {200} and status("later-key") == {401}
        st = keys.stat()
        with open(keys, "r+") as f:  # same inode, size and mtime: only a forced reload (SIGHUP) can see it
            f.write("read later-key reader\n")
        os.utime(keys, ns=(st.st_atime_ns, st.st_mtime_ns))
        srv.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert status("later-key") == {200} and status("first-key") == {401}
    finally:
        srv.stop()


def test_auto_decides_from_the_engine_and_the_cores(bundle_dir: Path, tmp_path: Path):
    runtime = Runtime(Settings(bundle=[str(bundle_dir)], data_dir=tmp_path / "data", precision="fp32",
                               runtime="onnxruntime", intra_op_threads=1))
    one = choose_http_workers("auto", runtime, cores=1)
    assert one.count == 0 and "1 core" in one.reason
    two = choose_http_workers("auto", runtime, cores=2)
    assert two.engine_images_per_s and two.engine_images_per_s > 0
    assert (two.count == 2) == (two.engine_images_per_s >= 300), two  # the tiny model outruns one front end
    assert "images/s" in two.reason
    assert choose_http_workers("3", runtime).count == 3


def test_crops_prepared_for_a_replaced_model_are_sent_back_to_prepare_again(bundle_dir: Path, tmp_path: Path):
    """The engine stage answers STALE when the model under a name now prepares crops otherwise (another grid or
    crop), and embeds when the preparation still holds: the engine process's own desk, ring and runtime."""
    import asyncio

    from msn_serve.workers import wire
    from msn_serve.workers.desk import EngineDesk
    from msn_serve.workers.ring import CropRing, slot_bytes_for

    runtime = Runtime(Settings(bundle=[str(bundle_dir)], data_dir=tmp_path / "data", precision="fp32",
                               runtime="onnxruntime", intra_op_threads=1))
    info = runtime.models.default.info
    ring = CropRing.create(2, slot_bytes_for([info]))
    ring.write(0, np.zeros((3, info.image_size, info.image_size), np.float32), np.arange(info.num_patches))

    async def call(prepared_for: str) -> wire.Reply:
        await runtime.start()
        await asyncio.sleep(0.5)  # warm-up
        here, there = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=here)
        desk = EngineDesk(runtime, ring, reader, writer, on_closed=lambda n: None)
        served = asyncio.get_running_loop().create_task(desk.serve())
        w_reader, w_writer = await asyncio.open_connection(sock=there)
        ref = wire.ImageRef(0, info.image_size, info.image_size, 3, info.num_patches)  # (C, H, W) = (3, S, S)
        w_writer.write(wire.embed_message(wire.EmbedCall(7, None, [ref], prepared_for)))
        replies = []
        while not replies:
            kind, payload = await wire.read_message(w_reader)
            if kind == b"R":
                replies.append(wire.parse_reply(payload))
        w_writer.close()
        await served
        await runtime.stop()
        return replies[0]

    stale = asyncio.run(call("36/32/3/bicubic/4"))
    assert (stale.request, stale.status) == (7, wire.STALE)
    fresh = asyncio.run(call(wire.preparation(info)))
    assert fresh.status == 200 and fresh.embeddings.shape == (1, info.embed_dim) and fresh.model_id == info.model_id
