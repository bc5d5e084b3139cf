"""The labelling tab end to end: a real msn-serve, the Gradio app, gradio_client and headless Chromium.

The folder holds 3 colour classes x 8 images (file names say the class, so the test can answer as a person would);
the tab embeds them through the service, and every label the test gives goes through the UI or the app's API.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.visualizer.test_app import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_helpers import Server

COLOURS = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (30, 40, 200)}
PER_CLASS = 8


def class_of(path: str) -> str:
    return Path(path).name.split("_")[0]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("label-folder")
    rng = np.random.default_rng(0)
    for name, rgb in COLOURS.items():
        sub = root / ("nested" if name == "blue" else ".")  # images in sub-folders count too
        sub.mkdir(exist_ok=True)
        for i in range(PER_CLASS):
            pixels = np.clip(np.array(rgb) + rng.normal(0, 25, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(sub / f"{name}_{i}.png")
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def serve(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("label-serve") / "data").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def label_app(tiny_bundle: Path, tiny_run: Path, serve: Server) -> Iterator[str]:
    from visualizer.app import launch

    port = _free_port()
    demo = launch(tiny_bundle, tiny_run, port=port, block=False, serve_url=serve.url)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def test_client_label_loop(label_app: str, serve: Server, image_folder: Path) -> None:
    from gradio_client import Client

    client = Client(label_app, verbose=False)
    with pytest.raises(Exception, match="at least two class names"):
        client.predict(str(image_folder), serve.url, "", "red", api_name="/label_embed")
    with pytest.raises(Exception, match="Not a folder"):
        client.predict(str(image_folder / "nope"), serve.url, "", "red, green, blue", api_name="/label_embed")
    status, _ = client.predict(str(image_folder), serve.url, "", "red, green, blue", api_name="/label_embed")
    assert f"Embedded {3 * PER_CLASS} images" in status
    current, gallery, status, _ = client.predict(6, api_name="/label_select")
    assert len(gallery) == 6 and "Selected 6 images" in status
    given = []
    for _ in range(6):
        given.append(Path(current).name)
        current, gallery, status, _ = client.predict(class_of(current), api_name="/label_give")
    assert current is None and f"{len(given)} labels given" in status
    predictions, status = client.predict(api_name="/label_fit")
    assert "Fitted on 6 labels" in status and f"predicted over {3 * PER_CLASS} images" in status
    assert len(predictions) == 3 * PER_CLASS
    current, gallery, status, _ = client.predict(6, api_name="/label_suggest")
    suggested = [Path(item["image"]).name for item in gallery]
    assert "Suggested 6 images" in status and len(suggested) == 6 and not set(suggested) & set(given)


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make setup)")
def test_browser_label_loop(label_app: str, serve: Server, image_folder: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1300})
            page.goto(label_app, wait_until="domcontentloaded")
            page.get_by_role("tab", name="Labelling").click()
            page.locator("#label-folder textarea, #label-folder input").first.fill(str(image_folder))
            expect(page.locator("#label-url textarea, #label-url input").first).to_have_value(serve.url)
            page.locator("#label-classes textarea, #label-classes input").first.fill("red, green, blue")
            page.locator("#label-embed").click()
            status = page.locator("#label-status")
            expect(status).to_contain_text(f"Embedded {3 * PER_CLASS} images", timeout=60_000)
            page.locator("#label-select").click()
            expect(status).to_contain_text("Selected 8 images", timeout=30_000)
            for n in range(8):
                expect(status).to_contain_text(f"label image {n + 1} of 8", timeout=20_000)
                src = page.locator("#label-current img").get_attribute("src")
                name = class_of(re.sub(r"\?.*$", "", src).rsplit("/", 1)[-1])
                page.locator("#label-choice").get_by_text(name, exact=True).click()
                expect(status).to_contain_text(f"{n + 1} labels given", timeout=20_000)
            page.locator("#label-fit").click()
            expect(status).to_contain_text("Fitted on 8 labels", timeout=60_000)
            expect(page.locator("#label-predictions img").first).to_be_visible(timeout=20_000)
            page.locator("#label-suggest").click()
            expect(status).to_contain_text("Suggested 8 images", timeout=30_000)
            expect(status).to_contain_text("label image 1 of 8")
            page.screenshot(path=str(ARTIFACTS / "labelling_tab.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "labelling_tab.png").stat().st_size > 10_000
