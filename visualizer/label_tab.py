"""The labelling tab: from an image folder to a classifier with few labels, through a running ``msn-serve``.

The tab never embeds or fits anything itself: it sends the folder's images to ``POST /index/{name}/add`` (the
service embeds them; the id of an image is its position in the folder's listing, its metadata the relative path),
asks ``/index/{name}/select`` what to label first, records the class a person clicks for each shown image, fits with
``POST /fewshot/fit`` from the stored ids, shows ``/fewshot/{name}/predict_index`` least certain first and asks
``/fewshot/{name}/suggest`` for the next images, all through :class:`msn_serve.client.Client` (its retries
included). So what a person does here is what a script does with the client.
:class:`LabelSession` holds that logic (testable without a browser); :func:`build_label_tab` is the UI.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from msn_core.sources import IMAGE_EXTENSIONS, SourceError, SourceListing, list_images
from msn_serve.client import Client, IndexPage, NotFoundError
from visualizer.service import service_client

BATCH = 32  # images per /index/add request (well under the service's max_images_per_request)
MAX_FOLDER = 20_000  # images one tab embeds; a larger corpus belongs to msn-embed + msn-index build
TIMEOUT_S = 300.0  # one request: a batch of 32 images embedded on a busy CPU, or a fit


def folder_images(folder: str | Path) -> SourceListing:
    """The folder's images as training and ``msn-embed`` list them (:func:`msn_core.sources.list_images`: every
    depth, hidden files skipped, the same extensions, the same order)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise gr.Error(f"Not a folder: {folder}")
    try:
        listing = list_images("folder", root)
    except SourceError:
        raise gr.Error(f"No images ({', '.join(IMAGE_EXTENSIONS)}) under {folder}") from None
    if len(listing) > MAX_FOLDER:
        raise gr.Error(f"{len(listing)} images: the tab embeds at most {MAX_FOLDER}; index larger folders with "
                       "msn-embed + msn-index build")
    return listing


def parse_classes(text: str) -> list[str]:
    classes = list(dict.fromkeys(c.strip() for c in (text or "").replace("\n", ",").split(",") if c.strip()))
    if len(classes) < 2:
        raise gr.Error("Type at least two class names, separated by commas.")
    return classes


@dataclass
class LabelSession:
    """One person's loop: the service, the folder's files, the labels given so far and the images to label now."""

    url: str = ""
    api_key: str = ""
    index: str = "labelling"
    classifier: str = "labelling"
    files: list[str] = field(default_factory=list)
    root: str = ""
    labels: dict[int, str] = field(default_factory=dict)
    queue: list[int] = field(default_factory=list)  # ids shown for labelling, in order
    position: int = 0

    def _client(self) -> AbstractContextManager[Client]:
        return service_client(self.url, self.api_key, TIMEOUT_S)

    def embed_folder(self, folder: str, progress: Callable[[float, str], None] = lambda f, d: None) -> str:
        listing = folder_images(folder)
        files, names = listing.files, listing.names
        self.root, self.files = str(Path(folder).expanduser().resolve()), list(files)
        self.labels, self.queue, self.position = {}, [], 0
        # one index (and classifier) per folder; embedded afresh, so no stale ids of an older embedding remain
        self.index = self.classifier = "label-" + hashlib.sha1(self.root.encode()).hexdigest()[:12]
        with self._client() as client:
            try:
                client.indexes.delete(self.index)
            except NotFoundError:
                pass
            for start in range(0, len(files), BATCH):
                chunk = list(range(start, min(len(files), start + BATCH)))
                progress(start / len(files), f"embedding {start}/{len(files)}")
                meta = [{"file": names[i]} for i in chunk]
                client.indexes.add(self.index, chunk, images=[files[i] for i in chunk], metadata=meta)
        progress(1.0, "done")
        return f"Embedded {len(files)} images into index `{self.index}` at {self.url}."

    def select(self, n: int, seed: int = 0) -> list[int]:
        with self._client() as client:
            picked = client.indexes.select(self.index, n=int(n), seed=int(seed), exclude_ids=sorted(self.labels))
        self.queue, self.position = picked.ids.tolist(), 0
        return self.queue

    def suggest(self, n: int) -> list[int]:
        if self.classifier_ready() is False:
            raise gr.Error("Fit a classifier first (label images of at least two classes, then Fit).")
        with self._client() as client:
            picked = client.classifiers.suggest(self.classifier, self.index, n=int(n),
                                                exclude_ids=sorted(self.labels))
        self.queue, self.position = picked.ids.tolist(), 0
        return self.queue

    def classifier_ready(self) -> bool:
        return len(set(self.labels.values())) >= 2

    def current(self) -> int | None:
        return self.queue[self.position] if self.position < len(self.queue) else None

    def label(self, choice: str) -> None:
        item = self.current()
        if item is None:
            raise gr.Error("Nothing to label: press Select (or Suggest) first.")
        self.labels[item] = choice
        self.position += 1

    def fit(self) -> dict[str, Any]:
        if not self.classifier_ready():
            raise gr.Error("Label images of at least two classes before fitting.")
        ids = sorted(self.labels)
        with self._client() as client:
            return client.classifiers.fit(self.classifier, [self.labels[i] for i in ids], index=self.index, ids=ids,
                                          overwrite=True)

    def predictions(self, limit: int) -> IndexPage:
        with self._client() as client:
            return client.classifiers.predict_index(self.classifier, self.index, limit=int(limit), k=1,
                                                    order="uncertain")

    def path(self, item: int) -> str:
        return self.files[item]


def _status(s: LabelSession, extra: str = "") -> str:
    item = s.current()
    todo = f"label image {s.position + 1} of {len(s.queue)}" if item is not None else "no image waiting"
    counts: dict[str, int] = {}
    for v in s.labels.values():
        counts[v] = counts.get(v, 0) + 1
    given = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"
    return f"{extra}  \n{len(s.labels)} labels given ({given}); {todo}.".strip()


def _queue_view(s: LabelSession) -> tuple[str | None, list[tuple[str, str]]]:
    item = s.current()
    gallery = [(s.path(i), s.labels.get(i, "?")) for i in s.queue]
    return (s.path(item) if item is not None else None), gallery


def build_label_tab(default_url: str = "http://127.0.0.1:8000") -> None:
    """The tab's components and events (inside an open ``gr.Blocks``/``gr.Tab``); API names ``/label_*``."""
    state = gr.State(LabelSession())
    gr.Markdown("Point the tab at an image folder and a running `msn-serve`; label what it selects, fit, and "
                "label its suggestions until the predictions look right.")
    with gr.Row():
        folder = gr.Textbox(label="Image folder", elem_id="label-folder", scale=3)
        url = gr.Textbox(default_url, label="msn-serve URL", elem_id="label-url", scale=2)
        key = gr.Textbox("", label="API key (if the service has one)", type="password", scale=1)
    with gr.Row():
        classes = gr.Textbox(label="Classes (typed once, comma-separated)", elem_id="label-classes", scale=3)
        count = gr.Number(8, precision=0, label="Images per round", minimum=1, maximum=200, scale=1)
        embed_btn = gr.Button("1. Embed folder", elem_id="label-embed", scale=1)
    status = gr.Markdown(elem_id="label-status")
    with gr.Row():
        select_btn = gr.Button("2. Select images to label", elem_id="label-select")
        fit_btn = gr.Button("3. Fit and predict", variant="primary", elem_id="label-fit")
        suggest_btn = gr.Button("4. Suggest next images", elem_id="label-suggest")
    with gr.Row():
        with gr.Column(scale=1):
            current = gr.Image(label="Which class is this?", interactive=False, elem_id="label-current", height=220,
                               buttons=[])
            choice = gr.Radio([], label="Click its class", elem_id="label-choice")
        queue_gallery = gr.Gallery(label="This round (class given so far)", columns=6, elem_id="label-queue", scale=2)
    predictions = gr.Gallery(label="Predictions over the folder, least certain first", columns=8,
                             elem_id="label-predictions")

    def embed(state_, folder_, url_, key_, classes_, progress=gr.Progress()):  # noqa: B008 - how Gradio injects it
        s = LabelSession(url=url_.strip(), api_key=key_.strip())
        choices = parse_classes(classes_)
        text = s.embed_folder(folder_, lambda f, d: progress(f, desc=d))
        return s, _status(s, text), gr.Radio(choices=choices, value=None)

    def pick(state_: LabelSession, n, suggest: bool):
        if not state_.files:
            raise gr.Error("Embed a folder first.")
        ids = state_.suggest(n) if suggest else state_.select(n)
        image, gallery = _queue_view(state_)
        what = "Suggested" if suggest else "Selected"
        return state_, image, gallery, _status(state_, f"{what} {len(ids)} images."), gr.Radio(value=None)

    def give(state_: LabelSession, choice_):
        if not choice_:
            return state_, *_queue_view(state_), _status(state_), gr.Radio(value=None)
        state_.label(choice_)
        return state_, *_queue_view(state_), _status(state_, f"Labelled as {choice_}."), gr.Radio(value=None)

    def fit(state_: LabelSession):
        info = state_.fit()
        page = state_.predictions(48)
        shown = [(str(Path(state_.root) / it.metadata["file"]), f"{it.label} ({it.probability:.2f})")
                 for it in page.items if it.metadata]
        counts = ", ".join(f"{k}: {v}" for k, v in page.class_counts.items())
        return state_, shown, _status(state_, f"Fitted on {info['n']} labels; predicted over {page.total} "
                                              f"images: {counts}.")

    embed_btn.click(embed, [state, folder, url, key, classes], [state, status, choice], api_name="label_embed")
    select_btn.click(lambda s, n: pick(s, n, False), [state, count],
                     [state, current, queue_gallery, status, choice], api_name="label_select")
    suggest_btn.click(lambda s, n: pick(s, n, True), [state, count],
                      [state, current, queue_gallery, status, choice], api_name="label_suggest")
    choice.input(give, [state, choice], [state, current, queue_gallery, status, choice], api_name="label_give")
    fit_btn.click(fit, [state], [state, predictions, status], api_name="label_fit")
