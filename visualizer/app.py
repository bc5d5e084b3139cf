"""Gradio app: mask an image, sample from the RCDM decoder, see what the MSN representation keeps.

Every event has an ``api_name`` (``/load``, ``/mask``, ``/click``, ``/sample``, ``/figure``, ``/compare``,
``/neighbours``) so the app is also an API for ``gradio_client``. The per-session keep bitmap lives in ``gr.State``;
the ``/sample``, ``/figure`` and ``/compare`` endpoints rebuild random and focal masks from their parameters, so they
are self-contained for API users.
The random and focal modes are ``/embed`` mask specifications resolved by :mod:`msn_core.masks` (the status line shows
the specification), so ratio 0.7 with seed 1 keeps the same patches here as in ``/embed``, OIP and ``msn-eval``.
Sampling runs through Gradio's queue with a bounded concurrency. Outside localhost, protect it with a login
(:func:`password_check`: user:password lines, or the msn-serve API key as the password).

The app offers only what the decoder was trained for: the guidance slider appears only for a decoder whose checkpoint
records condition dropout (otherwise guidance is fixed at 1 and ``/sample`` refuses any other scale), and the header
names the decoder's training step and the quality figure its run measured (:mod:`visualizer.quality`). A decoder
run directory is followed as it trains (:mod:`visualizer.live`): the app opens before the first checkpoint, sampling
says the decoder is still training until one lands, and the header and the samples follow each new one. The
paper's figure (:mod:`visualizer.figure`: original | masked input | samples, and a line saying what varies and what
stays) draws one row per decoder when the app has several on one bundle (``--decoder`` repeated, or a directory of
runs), the CLS decoder first and each row named by what it is conditioned on. Started
without a decoder, it offers the masks, the kept patches and the nearest neighbours from a running ``msn-serve``
(``/neighbours``, :mod:`visualizer.neighbours`, there with a decoder too); the sampling controls and endpoints are
then absent, and a note says how to train a decoder.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import torch
from PIL import Image

from msn_core.masks import keep_from_bitmap
from msn_core.optional import require
from visualizer.features import FrozenEncoder
from visualizer.figure import figure_row, paper_figure
from visualizer.runs import decoder_runs, paper_view
from visualizer.label_tab import build_label_tab
from visualizer.live import DecoderNotReady, LiveDecoder
from visualizer.masks import MODES, keep_bitmap, mask_spec
from visualizer.neighbours import build_neighbours_panel
from visualizer.pipeline import RCDMPipeline, decoder_summary, load_image
from visualizer.render import masked_view, patch_grid_image, to_hwc, upscale

__all__ = ["NO_DECODER", "build_app", "decoder_runs", "decoder_summary", "example_images", "launch", "password_check"]

log = logging.getLogger("msn.visualize")
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")
GRID_PX = 320
SHOW_PX = 160
EXAMPLE_PX = 384
GUIDANCE_MAX_SLIDER = 5.0
NO_DECODER = ("No decoder: masks, kept patches and nearest neighbours only. To sample what the representation keeps, "
              "train one (`msn-visualize train --bundle B --data DIR --output-dir runs/rcdm`; a flat folder of your "
              "images will do) and start the app with `--decoder runs/rcdm`.")


def _save_png(image: Image.Image, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(tmp, format="PNG", compress_level=1)
    os.replace(tmp, path)  # concurrent launches never see half a file


def example_images(out_dir: str | os.PathLike, *, fashion_mnist: int = 6) -> list[Path]:
    """Write the built-in examples as PNGs: Fashion-MNIST test images (if installed) and scikit-image photos."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    try:
        from training.api import FashionMNIST

        test = FashionMNIST(split="test")
        for index in range(fashion_mnist):
            label = test.classes[int(test.labels[index])].replace("/", "-").replace(" ", "-")
            path = out_dir / f"fmnist_{index}_{label}.png"
            if not path.is_file():
                _save_png(Image.fromarray(test.images[index]).convert("RGB"), path)
            paths.append(path)
    except FileNotFoundError:
        log.info("Fashion-MNIST is not installed: no Fashion-MNIST examples")
    skdata = require("skimage.data", "the app's example photos")

    for name in SKIMAGE_PHOTOS:
        path = out_dir / f"{name}.png"
        if path.is_file():
            paths.append(path)
            continue
        try:
            photo = getattr(skdata, name)()
        except Exception as exc:  # noqa: BLE001 - a photo missing from this scikit-image is not an error
            log.info("scikit-image photo %s unavailable: %s", name, exc)
            continue
        picture = Image.fromarray(np.asarray(photo)).convert("RGB")
        picture.thumbnail((EXAMPLE_PX, EXAMPLE_PX), Image.Resampling.LANCZOS)  # models see <= 224 px anyway
        _save_png(picture, path)
        paths.append(path)
    return paths


def kept_status(keep: np.ndarray, spec: dict[str, Any] | None) -> str:
    text = f"{int(keep.sum())}/{keep.size} patches kept"
    return text if spec is None else f"{text} (/embed mask {json.dumps(spec)})"


class CheckedImage(gr.Image):
    """``gr.Image`` whose decoding failures reach the user as a readable error instead of a stack trace."""

    is_template = True  # rendered by the stock Image frontend

    def preprocess(self, payload):
        try:
            return super().preprocess(payload)
        except gr.Error:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure means the upload is not a usable image
            name = getattr(payload, "orig_name", None) or "the upload"
            raise gr.Error(f"Bad image: cannot read {name} as an image ({type(exc).__name__}).") from None


class Session:
    """The app's model-side functions, independent of the UI (so they can be unit-tested)."""

    def __init__(self, encoder: FrozenEncoder, primary: RCDMPipeline | None = None,
                 compare: RCDMPipeline | None = None) -> None:
        self.encoder, self.primary, self.compare_pipe = encoder, primary, compare

    @property
    def grid(self) -> int:
        return self.encoder.grid

    def view(self, path: str | None, pipe: RCDMPipeline | None = None) -> np.ndarray:
        """The encoder's view (resize + centre crop) of an uploaded file, (crop, crop, 3) uint8."""
        if not path:
            raise gr.Error("Upload an image or pick an example first.")
        encoder = pipe.encoder if pipe is not None else self.encoder
        try:
            image = load_image(path, min_size=encoder.patch_size)
        except ValueError as exc:
            raise gr.Error(f"Bad image: {exc}") from None
        return to_hwc(encoder.model_view(image)[0])

    def keep_bitmap(self, mode: str, ratio: float, seed: int, focal: float, clicked: np.ndarray | None,
                    grid: int | None = None) -> np.ndarray:
        try:
            return keep_bitmap(mode, ratio, seed, focal, clicked, grid or self.grid)
        except ValueError as exc:
            raise gr.Error(f"Bad mask: {exc}") from None

    def grid_picture(self, view: np.ndarray, keep: np.ndarray) -> np.ndarray:
        return patch_grid_image(view, keep, max(4, GRID_PX // keep.shape[0]))

    def run(self, pipe: RCDMPipeline, view: np.ndarray, keep: np.ndarray, num_samples: int, steps: int,
            guidance: float, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
        if not keep.any():
            raise gr.Error("Every patch is masked: keep at least one (click a dimmed patch).")
        image = torch.from_numpy(view).permute(2, 0, 1).unsqueeze(0).contiguous()
        try:
            scale = pipe.guidance(guidance)
        except ValueError as exc:
            raise gr.Error(f"Bad guidance: {exc}") from None
        samples = pipe.sample(image, keep_from_bitmap(keep), num_samples=int(num_samples), steps=int(steps),
                              guidance_scale=scale, seed=int(seed))
        size = max(SHOW_PX, pipe.image_size)
        return upscale(masked_view(view, keep), SHOW_PX), [upscale(to_hwc(s), size) for s in samples]


def _ready(decoder: RCDMPipeline | LiveDecoder) -> RCDMPipeline | None:
    """A decoder's pipeline as of now: None while a followed run has no checkpoint yet."""
    return decoder if isinstance(decoder, RCDMPipeline) else decoder.current()


def _summary(decoder: RCDMPipeline | LiveDecoder) -> str:
    return decoder.summary() if isinstance(decoder, LiveDecoder) else decoder_summary(decoder)


def _sampling_ui(session: Session, primary: RCDMPipeline | LiveDecoder, mask_inputs: list,
                 status: gr.Markdown, others: list[RCDMPipeline | LiveDecoder] | tuple = ()) -> None:
    """The decoder's controls, the Samples, paper's figure and Side by side tabs and their ``/sample``, ``/figure``
    and ``/compare`` events; a :class:`LiveDecoder` is asked for its newest checkpoint at every request. The figure
    shows ``others`` (decoders on the same bundle) in rows below the primary's, each named."""
    cfg = primary.config.diffusion

    def decoder() -> RCDMPipeline:
        if isinstance(primary, RCDMPipeline):
            return primary
        try:
            return primary.require()
        except DecoderNotReady as exc:
            raise gr.Error(str(exc)) from None

    with gr.Row():
        num_samples = gr.Slider(1, 16, value=4, step=1, label="Samples", elem_id="num-samples")
        steps = gr.Slider(2, 1000, value=cfg.sample_steps, step=1, label=f"{cfg.sampler.upper()} steps")
        guidance = gr.Slider(0.0, GUIDANCE_MAX_SLIDER, value=min(primary.guidance(), GUIDANCE_MAX_SLIDER),
                             step=0.5, label="Guidance scale", elem_id="guidance",
                             visible=primary.guidance_trained, interactive=primary.guidance_trained)
        sample_seed = gr.Number(0, precision=0, label="Sample seed")
    with gr.Tab("Samples"):
        sample_btn = gr.Button("Sample", variant="primary", elem_id="sample-btn")
        with gr.Row():
            masked = gr.Image(label="Masked input", interactive=False, elem_id="masked", scale=1)
            gallery = gr.Gallery(label="Samples", columns=4, elem_id="samples", scale=3)
    with gr.Tab("The paper's figure", elem_id="tab-figure"):
        gr.Markdown("As in MSN's Fig. 1 (after RCDM): the original, the masked input, and samples from the masked "
                    "image's representation. What the samples share is what the representation keeps; what differs "
                    "between them is what it discards." + (" One row per decoder, each named below." if others
                                                          else ""))
        with gr.Row():
            figure_ratio = gr.Slider(0.0, 0.95, value=0.7, step=0.05, label="Mask ratio (random, with the mask seed)",
                                     elem_id="figure-ratio")
            figure_btn = gr.Button("Make the figure", variant="primary", elem_id="figure-btn")
        figure_img = gr.Image(label="Original | masked input | samples", interactive=False, elem_id="figure")
        figure_note = gr.Markdown(elem_id="figure-note")
    with gr.Tab("Side by side"):
        kinds = ["two ratios"] + (["two bundles"] if session.compare_pipe is not None else [])
        kind = gr.Radio(kinds, value="two ratios", label="Compare")
        with gr.Row():
            ratio_a = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Ratio A")
            ratio_b = gr.Slider(0.0, 0.95, value=0.7, step=0.05, label="Ratio B (or the mask above for bundles)")
        compare_btn = gr.Button("Compare", elem_id="compare-btn")
        with gr.Row():
            masked_a = gr.Image(label="A: masked", interactive=False, scale=1)
            gallery_a = gr.Gallery(label="A: samples", columns=4, scale=3, elem_id="samples-a")
        with gr.Row():
            masked_b = gr.Image(label="B: masked", interactive=False, scale=1)
            gallery_b = gr.Gallery(label="B: samples", columns=4, scale=3, elem_id="samples-b")

    def sample(path, mode_, ratio_, seed_, focal_, clicked_, n, steps_, guidance_, sample_seed_):
        view = session.view(path)
        keep = session.keep_bitmap(mode_, ratio_, seed_, focal_, clicked_)
        pipe = decoder()
        shown, samples = session.run(pipe, view, keep, n, steps_, guidance_, sample_seed_)
        note = "" if pipe is primary else f" (decoder step {pipe.step:,})"
        return shown, samples, f"{len(samples)} samples from {int(keep.sum())}/{keep.size} kept patches{note}"

    def side_by_side(path, kind_, ra, rb, mode_, ratio_, seed_, focal_, clicked_, n, steps_, guidance_, s):
        if kind_ == "two bundles":
            if session.compare_pipe is None:
                raise gr.Error("Start the app with --compare-bundle/--compare-decoder to compare bundles.")
            outs = []
            for pipe in (decoder(), session.compare_pipe):
                view = session.view(path, pipe)
                keep = session.keep_bitmap(mode_, ratio_, seed_, focal_, clicked_, grid=pipe.encoder.grid)
                outs += session.run(pipe, view, keep, n, steps_, guidance_, s)
            return (*outs, f"A: {primary.name}, B: {session.compare_pipe.name}")
        view = session.view(path)
        outs, pipe = [], decoder()
        for r in (ra, rb):
            outs += session.run(pipe, view, session.keep_bitmap("random", r, seed_, focal_, None),
                                n, steps_, guidance_, s)
        return (*outs, f"A: ratio {ra:.2f}, B: ratio {rb:.2f}")

    def figure(path, ratio_, seed_, n, steps_, guidance_, sample_seed_):
        view = session.view(path)
        keep = session.keep_bitmap("random", ratio_, seed_, 0.5, None)
        if not keep.any():
            raise gr.Error("Every patch is masked: lower the mask ratio.")
        image = torch.from_numpy(view).permute(2, 0, 1).unsqueeze(0).contiguous()
        rows, waiting = [], []
        for n_decoder, dec in enumerate([primary, *others]):
            pipe = decoder() if n_decoder == 0 else _ready(dec)
            if pipe is None:
                waiting.append(dec.kind)
                continue
            try:  # the primary follows the slider (or refuses it); another decoder that cannot guide samples at 1
                scale = pipe.guidance(guidance_ if n_decoder == 0 or pipe.guidance_trained else 1.0)
            except ValueError as exc:
                raise gr.Error(f"Bad guidance: {exc}") from None
            rows.append(figure_row(pipe, image, keep_from_bitmap(keep), num_samples=int(n), steps=int(steps_),
                                   guidance=scale, seed=int(sample_seed_)))
        picture, note = paper_figure(rows, view, keep)
        for kind in waiting:
            note += f"  \n{kind}: still training, no checkpoint yet."
        return picture, note

    sample_inputs = mask_inputs + [num_samples, steps, guidance, sample_seed]
    sample_btn.click(sample, sample_inputs, [masked, gallery, status], api_name="sample")
    figure_btn.click(figure, [mask_inputs[0], figure_ratio, mask_inputs[3], num_samples, steps, guidance,
                              sample_seed], [figure_img, figure_note], api_name="figure")
    compare_btn.click(side_by_side, [mask_inputs[0], kind, ratio_a, ratio_b] + sample_inputs[1:],
                      [masked_a, gallery_a, masked_b, gallery_b, status], api_name="compare")


def build_app(primary: RCDMPipeline | LiveDecoder | FrozenEncoder, compare: RCDMPipeline | None = None, *,
              examples: list[Path] | None = None, serve_url: str = "http://127.0.0.1:8000",
              others: list[RCDMPipeline | LiveDecoder] | tuple = ()) -> gr.Blocks:
    """The app on a decoder (an ``RCDMPipeline``, or a :class:`LiveDecoder` still training), or on a bundle's encoder
    alone: no sampling (module docstring). ``others``: more decoders on the same bundle, named in the header and
    drawn below the primary's row in the paper's figure."""
    pipe = primary if isinstance(primary, (RCDMPipeline, LiveDecoder)) else None
    if compare is not None and not isinstance(primary, RCDMPipeline):
        raise ValueError("comparing decoders needs a trained decoder for the primary bundle too")
    encoder = pipe.encoder if pipe is not None else primary
    session = Session(encoder, primary if isinstance(primary, RCDMPipeline) else None, compare)
    if pipe is None and others:
        raise ValueError("more decoders need a primary decoder")

    def header() -> str:
        text = "  \n".join(_summary(d) for d in [pipe, *others])
        return text + (f"  \nComparison bundle {compare.name}: {decoder_summary(compare)}" if compare else "")

    if pipe is not None:
        about = header()
        intro = ("An RCDM diffusion decoder samples images from the frozen embedding of "
                 f"bundle `{encoder.model_id}`. Mask patches, then sample: what stays the same across samples "
                 "is what the representation encodes.")
    else:
        about = NO_DECODER
        intro = (f"Mask patches of an image as bundle `{encoder.model_id}` sees it, and find what the embedding of "
                 "the kept patches is nearest to in an `msn-serve` index.")
    with gr.Blocks(title="MSN + RCDM: what the representation keeps", analytics_enabled=False) as demo:
        with gr.Tab("RCDM: what the representation keeps" if pipe else "What the representation keeps",
                    elem_id="tab-rcdm"):
            gr.Markdown(f"## What does the MSN representation keep?\n{intro}")
            info = gr.Markdown(about, elem_id="decoder-info")
            if any(isinstance(d, LiveDecoder) for d in [primary, *others]):  # the header follows the checkpoints
                gr.Timer(10.0).tick(header, None, info, api_visibility="private")
            clicked = gr.State(None)
            with gr.Row():
                with gr.Column(scale=1):
                    image = CheckedImage(type="filepath", label="Image", sources=["upload"], elem_id="upload",
                                         height=240)
                    if examples:
                        gr.Examples([[str(p)] for p in examples], inputs=[image], label="Examples",
                                    examples_per_page=12)
                with gr.Column(scale=1):
                    grid_img = gr.Image(label="Patch grid: click patches to drop / keep them", interactive=False,
                                        elem_id="patch-grid", height=GRID_PX, buttons=[])
                    mode = gr.Radio(list(MODES), value="random", label="Mask", elem_id="mask-mode")
                    ratio = gr.Slider(0.0, 0.95, value=0.5, step=0.05, label="Mask ratio (random)", elem_id="ratio")
                    mask_seed = gr.Number(0, precision=0, label="Mask seed", elem_id="mask-seed")
                    focal = gr.Slider(0.1, 1.0, value=0.5, step=0.05, label="Focal block side (fraction of the grid)")
            status = gr.Markdown(elem_id="status")
            mask_inputs = [image, mode, ratio, mask_seed, focal, clicked]
            if pipe is not None:
                _sampling_ui(session, pipe, mask_inputs, status, others)
            build_neighbours_panel(serve_url, mask_inputs, lambda path, *mask: session.keep_bitmap(*mask))
        with gr.Tab("Labelling", elem_id="tab-labelling"):
            build_label_tab(serve_url)

        def show_mask(path, mode_, ratio_, seed_, focal_, clicked_):
            if not path:
                return None, clicked_, ""
            view = session.view(path)
            keep = session.keep_bitmap(mode_, ratio_, seed_, focal_, clicked_)
            spec = mask_spec(mode_, ratio_, seed_, focal_, session.grid)
            return session.grid_picture(view, keep), keep, kept_status(keep, spec)

        def click(path, mode_, ratio_, seed_, focal_, clicked_, evt: gr.SelectData):
            view = session.view(path)
            keep = session.keep_bitmap(mode_, ratio_, seed_, focal_, clicked_).copy()
            cell = max(4, GRID_PX // session.grid)
            x, y = evt.index
            row, col = min(int(y) // cell, session.grid - 1), min(int(x) // cell, session.grid - 1)
            keep[row, col] = not keep[row, col]
            return session.grid_picture(view, keep), keep, "click", kept_status(keep, None)

        image.change(show_mask, mask_inputs, [grid_img, clicked, status], api_name="load")
        mode.input(show_mask, mask_inputs, [grid_img, clicked, status], api_name="mask")
        for control in (ratio, mask_seed, focal):
            control.input(show_mask, mask_inputs, [grid_img, clicked, status], api_visibility="private")
        grid_img.select(click, mask_inputs, [grid_img, clicked, mode, status], api_name="click")
    return demo


def password_check(auth_file: str | Path | None = None,
                   api_key_file: str | Path | None = None) -> Callable[[str, str], bool] | None:
    """Gradio's ``auth`` callable: ``auth_file`` holds ``user:password`` lines; with ``api_key_file`` (the key
    msn-serve uses) any user name logs in with the key as its password. Compared in constant time; ``None`` when
    neither is given (no login)."""
    users: dict[str, str] = {}
    if auth_file is not None:
        for n, line in enumerate(Path(auth_file).read_text(encoding="utf-8").splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                user, sep, password = line.strip().partition(":")
                if not sep or not user or not password:
                    raise ValueError(f"{auth_file}:{n}: expected user:password")
                users[user] = password
    key = Path(api_key_file).read_text(encoding="utf-8").strip() if api_key_file is not None else None
    if api_key_file is not None and not key:
        raise ValueError(f"API key file {api_key_file} is empty")
    if not users and key is None:
        return None

    def check(user: str, password: str) -> bool:
        ok = key is not None and hmac.compare_digest(password.encode(), key.encode())
        expected = users.get(user)
        return ok or (expected is not None and hmac.compare_digest(password.encode(), expected.encode()))

    return check


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def launch(bundle: str | Path, decoder: str | Path | Sequence[str | Path] | None = None, *,
           compare: tuple[Path, Path] | None = None,
           host: str = "127.0.0.1", port: int = 7860, device: str = "cpu", concurrency: int = 2,
           block: bool = True, auth: Callable[[str, str], bool] | None = None,
           serve_url: str = "http://127.0.0.1:8000") -> gr.Blocks:
    """Load the pipelines (the bundle's encoder alone without ``decoder``), write the examples, start the server
    (``block=False`` returns once it listens). ``decoder``: one path or several (:func:`decoder_runs` each); the
    first decoder that shows the paper's view (:func:`paper_view`, the CLS decoder) is the primary, the others are
    drawn beside it in the figure. ``auth`` (see :func:`password_check`) puts a login page in front of the app and
    its API."""
    if auth is None and not _is_loopback(host):
        log.warning("msn-visualize app is listening on %s without a login: anyone who can reach it can use it "
                    "(--auth-file or --api-key-file adds one)", host)
    if decoder is None:
        log.info("no --decoder: the app offers masks and nearest neighbours, no sampling")
    paths = [] if decoder is None else [decoder] if isinstance(decoder, (str, os.PathLike)) else list(decoder)
    runs = list(dict.fromkeys(run.resolve() for path in paths for run in decoder_runs(path, wait_s=60.0)))
    primary: RCDMPipeline | LiveDecoder | FrozenEncoder
    decoders: list[RCDMPipeline | LiveDecoder] = []
    for run in runs:  # a run directory is followed as it trains (waits for its config.yaml, not for a checkpoint)
        fixed = compare is not None or run.is_file()
        decoders.append(RCDMPipeline.from_dirs(bundle, run, device=device) if fixed
                        else LiveDecoder(bundle, run, device=device))
    decoders.sort(key=lambda d: not paper_view(d))  # stable: the CLS decoder first, the rest in the given order
    primary = decoders[0] if decoders else FrozenEncoder(bundle, device=device)
    second = RCDMPipeline.from_dirs(*compare, device=device) if compare else None
    examples_dir = Path(tempfile.gettempdir()) / f"msn-visualize-examples-{os.getuid()}"  # reused across launches
    demo = build_app(primary, second, examples=example_images(examples_dir), serve_url=serve_url,
                     others=decoders[1:])
    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    demo.launch(server_name=host, server_port=port, allowed_paths=[str(examples_dir)], auth=auth,
                auth_message="msn-visualize: log in (user:password from --auth-file, or any user with the API key)",
                prevent_thread_lock=not block, show_error=True, max_file_size="20mb", ssr_mode=False)
    return demo
