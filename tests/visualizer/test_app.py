"""The Gradio app end to end: a real server, driven by gradio_client and by headless Chromium (playwright)."""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from msn_core.masks import resolve_mask

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tiny_bundle: Path, tiny_run: Path) -> Iterator[str]:
    from visualizer.app import launch

    port = _free_port()
    demo = launch(tiny_bundle, tiny_run, compare=(tiny_bundle, tiny_run), port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def client(app_url: str):
    from gradio_client import Client

    return Client(app_url, verbose=False)


@pytest.fixture(scope="module")
def guided_app_url(tiny_bundle: Path, tiny_guided_run: Path) -> Iterator[str]:
    """The app on a decoder trained with condition dropout."""
    from visualizer.app import launch

    port = _free_port()
    demo = launch(tiny_bundle, tiny_guided_run, port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def _config(url: str) -> dict:
    """The components and endpoints as the served page receives them (Gradio's /config)."""
    import httpx

    return httpx.get(url + "config", timeout=30).json()


def _component(url: str, elem_id: str) -> dict:
    """A component's properties as the served page receives them."""
    [props] = [c["props"] for c in _config(url)["components"] if c.get("props", {}).get("elem_id") == elem_id]
    return props


def test_guidance_is_fixed_for_a_decoder_trained_without_condition_dropout(app_url: str, client,
                                                                           sample_png: Path) -> None:
    from gradio_client import handle_file

    assert _component(app_url, "guidance")["visible"] is False
    about = _component(app_url, "decoder-info")["value"]
    assert "step 3 of 3" in about and "class consistency" in about and "Guidance is fixed at 1" in about
    for scale in (0.0, 2.0):  # an API user cannot ask for it either
        with pytest.raises(Exception, match="Bad guidance: guidance scale .* needs a decoder trained with condition"):
            client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, 2, 2, scale, 0, api_name="/sample")


def test_guidance_is_offered_for_a_decoder_trained_with_condition_dropout(guided_app_url: str,
                                                                          sample_png: Path) -> None:
    from gradio_client import Client, handle_file

    slider = _component(guided_app_url, "guidance")
    assert slider["visible"] is True and slider["minimum"] == 0.0 and slider["value"] == 1.0
    assert "condition dropout 0.5" in _component(guided_app_url, "decoder-info")["value"]
    client = Client(guided_app_url, verbose=False)
    for scale in (0.0, 2.5):
        _, gallery, status = client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, 2, 2, scale, 0,
                                            api_name="/sample")
        assert len(gallery) == 2 and status == "2 samples from 32/64 kept patches (decoder step 3)"


def test_the_app_opens_before_the_decoder_has_a_checkpoint_and_follows_it(tiny_bundle: Path, tiny_guided_run: Path,
                                                                          sample_png: Path, tmp_path: Path) -> None:
    """make demo opens the app while the decoder trains: before the first checkpoint, sampling says the decoder is
    still training (masks work); once one lands, the next request samples with it and the header names its step."""
    from gradio_client import Client, handle_file

    from visualizer.app import launch

    run = tmp_path / "training-run"
    run.mkdir()
    shutil.copy(tiny_guided_run / "config.yaml", run / "config.yaml")  # what `msn-visualize train` writes first
    port = _free_port()
    demo = launch(tiny_bundle, run, port=port, block=False)
    url = f"http://127.0.0.1:{port}/"
    try:
        assert "no checkpoint yet" in _component(url, "decoder-info")["value"]
        client = Client(url, verbose=False)
        _, status = client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, api_name="/mask")
        assert "32/64" in status
        with pytest.raises(Exception, match="still training"):
            client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, 2, 2, 1.0, 0, api_name="/sample")
        shutil.copy(tiny_guided_run / "checkpoint.pt", run / "checkpoint.tmp")
        (run / "checkpoint.tmp").replace(run / "checkpoint.pt")  # atomically, as training writes it
        _, gallery, status = client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, 2, 2, 1.0, 0,
                                            api_name="/sample")
        assert len(gallery) == 2 and status.endswith("(decoder step 3)")
    finally:
        demo.close()


def test_examples_include_fashion_mnist_and_photos(tmp_path: Path) -> None:
    from visualizer.app import example_images

    names = [p.name for p in example_images(tmp_path, fashion_mnist=2)]
    assert {"astronaut.png", "coffee.png", "chelsea.png"} <= set(names)
    if Path("/usr/share/datasets/fashion-mnist").is_dir():
        assert names[0].startswith("fmnist_0_")


def test_client_upload_mask_and_sample(client, sample_png: Path) -> None:
    from gradio_client import handle_file

    grid, status = client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, api_name="/load")
    assert status == '32/64 patches kept (/embed mask {"ratio": 0.5, "seed": 0})'
    assert Image.open(grid).size == (320, 320)
    _, status = client.predict(handle_file(str(sample_png)), "focal", 0.5, 0, 0.5, api_name="/mask")
    assert status == '16/64 patches kept (/embed mask {"focal": {"size": 4}})'
    masked, gallery, status = client.predict(handle_file(str(sample_png)), "random", 0.7, 3, 0.5, 3, 2, 1.0, 0,
                                             api_name="/sample")
    assert len(gallery) == 3 and status == "3 samples from 19/64 kept patches"
    assert Image.open(masked).size == (160, 160) and Image.open(gallery[0]["image"]).size == (160, 160)


def test_client_side_by_side(client, sample_png: Path) -> None:
    from gradio_client import handle_file

    image = handle_file(str(sample_png))
    for kind in ("two ratios", "two bundles"):
        _, gallery_a, _, gallery_b, status = client.predict(image, kind, 0.0, 0.9, "random", 0.5, 0, 0.5, 2, 2, 1.0,
                                                            0, api_name="/compare")
        assert len(gallery_a) == len(gallery_b) == 2 and status.startswith("A: ")


def test_client_queue_serves_concurrent_users(app_url: str, sample_png: Path) -> None:
    from gradio_client import Client, handle_file

    jobs = [Client(app_url, verbose=False).submit(handle_file(str(sample_png)), "random", 0.5, seed, 0.5, 2, 2, 1.0,
                                                  seed, api_name="/sample") for seed in range(3)]
    wait(jobs, timeout=120)
    assert [len(job.result()[1]) for job in jobs] == [2, 2, 2]


def test_client_bad_upload_is_a_clear_error(client, tmp_path: Path) -> None:
    from gradio_client import handle_file

    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    with pytest.raises(Exception, match="Bad image: cannot read broken.png"):
        client.predict(handle_file(str(bad)), "random", 0.5, 0, 0.5, api_name="/load")
    tiny = tmp_path / "tiny.png"
    Image.fromarray(np.zeros((2, 2, 3), dtype=np.uint8)).save(tiny)
    with pytest.raises(Exception, match="at least 4 px"):
        client.predict(handle_file(str(tiny)), "random", 0.5, 0, 0.5, api_name="/load")


@pytest.fixture(scope="module")
def serve_url(tiny_bundle: Path, sample_png: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real msn-serve on the tiny bundle, with index ``pics`` of three images: ids 0 and 2 random, id 1 a copy
    of ``sample_png``; metadata ``{"path": name}``."""
    import httpx

    from tests.serve.serve_helpers import Server

    root = tmp_path_factory.mktemp("nn-pics")
    rng = np.random.default_rng(1)
    files = [root / "a.png", root / "picture.png", root / "b.png"]
    for path in files[::2]:
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)
    shutil.copy(sample_png, files[1])
    server = Server(tiny_bundle, tmp_path_factory.mktemp("nn-serve") / "data").start()
    try:
        r = httpx.post(server.url + "/index/pics/add", timeout=60,
                       data={"ids": "[0, 1, 2]", "metadata": json.dumps([{"path": p.name} for p in files])},
                       files=[("images", (p.name, p.read_bytes())) for p in files])
        assert r.status_code == 200, r.text
        yield server.url
    finally:
        server.stop()


def test_app_without_a_decoder_masks_and_finds_neighbours(tiny_bundle: Path, serve_url: str, sample_png: Path,
                                                          tmp_path: Path) -> None:
    from gradio_client import Client, handle_file

    from visualizer.app import launch

    shutil.copy(sample_png, tmp_path / "picture.png")  # the folder the index's relative paths are under
    port = _free_port()
    demo = launch(tiny_bundle, None, port=port, block=False, serve_url=serve_url)
    try:
        url = f"http://127.0.0.1:{port}/"
        assert "No decoder" in _component(url, "decoder-info")["value"]
        ids = {c.get("props", {}).get("elem_id") for c in _config(url)["components"]}
        assert {"patch-grid", "mask-mode", "nn-btn"} <= ids
        assert not ids & {"num-samples", "guidance", "sample-btn", "compare-btn", "samples"}  # no sampling controls
        client = Client(url, verbose=False)
        endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        assert not {"/sample", "/compare"} & set(endpoints)
        image = handle_file(str(sample_png))
        _, status = client.predict(image, "focal", 0.5, 0, 0.5, api_name="/load")
        assert status == '16/64 patches kept (/embed mask {"focal": {"size": 4}})'
        gallery, listing = client.predict(image, "random", 0.0, 0, 0.5, serve_url, "", "", str(tmp_path), 2,
                                          api_name="/neighbours")
        assert "Index `pics`, 64/64 patches kept" in listing and listing.count("id ") == 2
        assert re.search(r"^1\. id 1 · ", listing, re.MULTILINE)  # the stored copy of the query image comes first
        assert len(gallery) == 1 and Path(gallery[0]["image"]).name == "picture.png"  # the one file that is here
        _, listing = client.predict(image, "random", 0.5, 0, 0.5, serve_url, "", "pics", "", 3, api_name="/neighbours")
        assert "32/64 patches kept" in listing and listing.count("id ") == 3
    finally:
        demo.close()


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make setup)")
def test_browser_click_patches_and_sample(app_url: str, sample_png: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    keep = np.zeros(64, dtype=bool)
    keep[resolve_mask({"ratio": 0.5, "seed": 0}, 8)] = True  # the app's random mode at ratio 0.5, seed 0
    clicks = [(0, 0), (3, 5), (7, 7)]  # (row, col) patches to toggle
    expected = int(keep.sum()) + sum(-1 if keep[r * 8 + c] else 1 for r, c in clicks)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(app_url, wait_until="domcontentloaded")
            expect(page.locator("#decoder-info")).to_contain_text("Guidance is fixed at 1", timeout=30_000)
            expect(page.locator("#guidance")).to_be_hidden()  # this decoder was trained without condition dropout
            page.locator("#upload input[type=file]").set_input_files(str(sample_png))
            status = page.locator("#status")
            expect(status).to_contain_text("32/64 patches kept", timeout=30_000)
            grid = page.locator("#patch-grid img")
            for n, (row, col) in enumerate(clicks):
                # the picture is letterboxed inside the <img> box (object-fit: contain)
                page.wait_for_function(  # the grid image is replaced after each click: wait until it has loaded
                    "() => { const i = document.querySelector('#patch-grid img'); return i && i.naturalWidth > 0; }",
                    timeout=30_000)
                box = grid.bounding_box()
                natural = grid.evaluate("img => [img.naturalWidth, img.naturalHeight]")
                scale = min(box["width"] / natural[0], box["height"] / natural[1])
                left = (box["width"] - natural[0] * scale) / 2
                top = (box["height"] - natural[1] * scale) / 2
                cell = natural[0] * scale / 8
                grid.click(position={"x": left + (col + 0.5) * cell, "y": top + (row + 0.5) * cell})
                count = int(keep.sum()) + sum(-1 if keep[r * 8 + c] else 1 for r, c in clicks[: n + 1])
                expect(status).to_contain_text(f"{count}/64 patches kept", timeout=20_000)
            assert count == expected
            page.locator("#sample-btn").click()
            expect(status).to_contain_text(f"4 samples from {expected}/64 kept patches", timeout=60_000)
            expect(page.locator("#samples img")).to_have_count(4, timeout=20_000)
            expect(page.locator("#masked img")).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "visualizer_app.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "visualizer_app.png").stat().st_size > 10_000
