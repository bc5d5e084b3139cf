"""Nearest neighbours of the masked image in a running ``msn-serve`` index: what the kept patches' embedding is near.

Needs no decoder and embeds nothing here: the uploaded file goes to ``POST /index/{name}/search`` as it is, with the
kept patches as an ``/embed`` mask (``{"keep_idx": [...]}``, so clicked patches count exactly as the grid shows
them), and the service embeds it with its own copy of the bundle. Hits are shown as pictures when their metadata
names a file (``path`` as ``msn-embed``/``msn-index build --store-paths`` store it, ``file`` as the labelling tab
does; relative names are read under the folder typed in the panel), and listed as ``id`` and score in any case.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from msn_core.masks import keep_from_bitmap
from visualizer.service import service_client

__all__ = ["NeighbourSearch", "build_neighbours_panel"]

TIMEOUT_S = 120.0


@dataclass
class NeighbourSearch:
    """One query's service, key and index; :meth:`search` returns the hits as the service answers them."""

    url: str
    api_key: str = ""

    def index_name(self, name: str) -> str:
        """``name``, or the service's only index when ``name`` is blank (several: an error that lists them)."""
        if name.strip():
            return name.strip()
        with service_client(self.url, self.api_key, TIMEOUT_S) as client:
            names = sorted(idx["name"] for idx in client.indexes.list())
        if len(names) != 1:
            found = ", ".join(names) if names else "none"
            raise gr.Error(f"Name the index to search (indexes at {self.url}: {found}).")
        return names[0]

    def search(self, index: str, image: str | Path, keep: np.ndarray, k: int) -> list[dict[str, Any]]:
        """The ``k`` nearest stored items to ``image`` embedded from the kept patches of the bitmap ``keep``."""
        mask = {"keep_idx": keep_from_bitmap(keep).tolist()}
        with service_client(self.url, self.api_key, TIMEOUT_S) as client:
            result = client.indexes.search(index, images=[Path(image)], k=int(k), mask=mask)
        return [{"id": h.id, "score": h.score, "metadata": h.metadata} for h in result.hits[0]]


def _picture(hit: dict[str, Any], folder: str) -> str | None:
    """The file a hit's metadata names, if it exists here (relative names under ``folder``)."""
    meta = hit.get("metadata")
    name = (meta.get("path") or meta.get("file")) if isinstance(meta, dict) else None
    if not isinstance(name, str):
        return None
    path = Path(name) if Path(name).is_absolute() or not folder else Path(folder).expanduser() / name
    return str(path) if path.is_file() else None


def hits_view(hits: list[dict[str, Any]], folder: str) -> tuple[list[tuple[str, str]], str]:
    """``(gallery, text)``: pictures of the hits whose files are here, and one line per hit."""
    gallery, lines = [], []
    for rank, hit in enumerate(hits, 1):
        meta = hit.get("metadata")
        label = meta.get("label") if isinstance(meta, dict) else None
        caption = f"{rank}. id {hit['id']} · {hit['score']:.3f}" + (f" · {label}" if label else "")
        lines.append(caption + (f" · `{json.dumps(meta)}`" if meta is not None else ""))
        picture = _picture(hit, folder)
        if picture is not None:
            gallery.append((picture, caption))
    return gallery, "  \n".join(lines) or "No neighbours: the index is empty."


def build_neighbours_panel(serve_url: str, mask_inputs: list[gr.components.Component],
                           keep_of: Callable[..., np.ndarray]) -> None:
    """The panel's components and its ``/neighbours`` event (inside an open ``gr.Blocks``); ``mask_inputs`` are the
    image and mask controls, ``keep_of(*their values)`` the keep bitmap they describe."""
    with gr.Accordion("Nearest neighbours in an msn-serve index", open=True, elem_id="neighbours"):
        gr.Markdown("The service embeds the image from its kept patches and searches an index: the neighbours are "
                    "the stored images nearest to what the representation keeps of it.")
        with gr.Row():
            url = gr.Textbox(serve_url, label="msn-serve URL", elem_id="nn-url", scale=2)
            key = gr.Textbox("", label="API key (if the service has one)", type="password", scale=1)
            index = gr.Textbox("", label="Index (blank: the service's only one)", elem_id="nn-index", scale=1)
            folder = gr.Textbox("", label="Folder the index's relative paths are under", scale=2)
            k = gr.Slider(1, 50, value=8, step=1, label="Neighbours", scale=1)
        search_btn = gr.Button("Find neighbours", elem_id="nn-btn")
        gallery = gr.Gallery(label="Neighbours (the stored images this app can read)", columns=8,
                             elem_id="nn-gallery")
        listing = gr.Markdown(elem_id="nn-list")

    def neighbours(path, *rest):
        *mask_values, url_, key_, index_, folder_, k_ = rest
        if not path:
            raise gr.Error("Upload an image or pick an example first.")
        keep = keep_of(path, *mask_values)
        if not keep.any():
            raise gr.Error("Every patch is masked: keep at least one (click a dimmed patch).")
        service = NeighbourSearch(url_.strip(), key_.strip())
        name = service.index_name(index_)
        shown, text = hits_view(service.search(name, path, keep, int(k_)), folder_.strip())
        return shown, f"Index `{name}`, {int(keep.sum())}/{keep.size} patches kept:  \n{text}"

    search_btn.click(neighbours, [*mask_inputs, url, key, index, folder, k], [gallery, listing],
                     api_name="neighbours")
