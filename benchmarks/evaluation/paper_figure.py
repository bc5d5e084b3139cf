r"""The paper's Fig. 1 (after RCDM) for 8 Fashion-MNIST test images: what the MSN representation keeps, per decoder.

    python -m benchmarks.evaluation.paper_figure --bundle bundles/demo --decoder runs/demo-rcdm28/cls \
        --ratio 0.7 --samples 6 --out docs/visualizer_figure.png
    python -m benchmarks.evaluation.paper_figure --bundle bundles/demo --decoder runs/demo-rcdm28/cls \
        --decoder runs/demo-rcdm28/tokenmap --threads 2 --out /tmp/figure.png

Eight test images (``--images``), each of another class (drawn with ``--seed``), each masked at random at
``--ratio`` (mask seed ``--seed`` + the image's place in the figure) and drawn as the app's *The paper's figure* tab
draws it (:func:`visualizer.figure.paper_figure`): one row per decoder, the original as the encoder sees it | the
masked input | ``--samples`` samples from the masked image's representation, the CLS decoder's row first. The view,
the keep mask and the rows are made as the app's ``/figure`` makes them (resize + centre crop of the grey image as
RGB, the ``/embed`` specification ``{"ratio": R, "seed": S}``, :func:`visualizer.figure.figure_row` with sample seed
``--sample-seed``), so the test image uploaded to the app with the same ratio, seeds, steps and guidance gives the same
row. Each decoder samples with its own default steps and guidance (its config's; guidance 1 for a decoder trained
without condition dropout) unless ``--steps`` / ``--guidance`` say otherwise; ``--guidance`` applies to the decoders
that can guide (the first decoder refuses a scale it was not trained for, the others then sample at 1, as in the app).

``--decoder`` is repeatable and, as in the app, a directory holding several runs stands for all of them. The 8 blocks
are stacked into one PNG at ``--out`` (each under a line naming the test image and its class), written atomically;
beside it ``<stem>.json`` holds per image its test index, class, mask seed and per decoder the figure row's numbers
and its line (what varies, what stays), with the decoders' settings and the machine. The lines are printed too.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageDraw

from benchmarks.common import DOCS, machine
from msn_core.durable import atomic_write, atomic_write_json
from visualizer.runs import decoder_runs, paper_view

if TYPE_CHECKING:
    import torch

    from visualizer.figure import FigureRow
    from visualizer.pipeline import RCDMPipeline

FIGURE_IMAGES = 8
LABEL_PX = 18  # the strip above each block naming its test image
GAP_PX = 8  # white between blocks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="the MSN bundle the decoders were trained on")
    parser.add_argument("--decoder", type=Path, action="append", required=True,
                        help="a decoder run (directory or checkpoint.pt), or a directory of runs; repeatable")
    parser.add_argument("--ratio", type=float, default=0.7, help="random mask ratio (the app's figure default 0.7)")
    parser.add_argument("--samples", type=int, default=6, help="samples per decoder and image")
    parser.add_argument("--images", type=int, default=FIGURE_IMAGES, help="test images, each of another class")
    parser.add_argument("--seed", type=int, default=0, help="picks the images; image k's mask seed is SEED + k")
    parser.add_argument("--sample-seed", type=int, default=0, help="the samples' seed (the app's default 0)")
    parser.add_argument("--steps", type=int, help="sampling steps for every decoder (default: each decoder's own)")
    parser.add_argument("--guidance", type=float,
                        help="guidance scale for the decoders that can guide (default: each decoder's own)")
    parser.add_argument("--data-root", type=Path, help="the Fashion-MNIST idx files (default: Debian's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: every visible core)")
    parser.add_argument("--out", type=Path, default=DOCS / "visualizer_figure.png", help="the PNG; JSON beside it")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.images < 1:
        parser.error("--images must be at least 1")
    if args.threads < 0:
        parser.error("--threads must be 0 (every visible core) or more")
    if args.out.suffix.lower() != ".png":
        parser.error(f"--out {args.out}: expected a .png file")
    return args


# ----------------------------------------------------------------------------------------------------- decoders


def load_decoders(bundle: Path, paths: list[Path], device: str) -> list[tuple[Path, RCDMPipeline]]:
    """Every run's pipeline on ``bundle``, the CLS decoder first (a stable sort, as the app's); a run without a
    checkpoint yet is skipped with a note, as the app's figure skips one still training."""
    from visualizer.pipeline import RCDMPipeline, resolve_checkpoint

    runs = list(dict.fromkeys(run.resolve() for path in paths for run in decoder_runs(path)))
    loaded = []
    for run in runs:
        if run.is_dir() and not (run / "checkpoint.pt").is_file() and (run / "config.yaml").is_file():
            print(f"{run}: still training, no checkpoint yet; skipped", file=sys.stderr)
            continue
        try:
            resolve_checkpoint(run)
        except FileNotFoundError as exc:
            raise SystemExit(str(exc)) from None
        loaded.append((run, RCDMPipeline.from_dirs(bundle, run, device=device)))
    if not loaded:
        raise SystemExit("no decoder with a checkpoint among " + ", ".join(map(str, paths)))
    loaded.sort(key=lambda item: not paper_view(item[1]))
    return loaded


def settings(pipes: list[RCDMPipeline], steps: int | None, guidance: float | None) -> list[tuple[int, float]]:
    """(steps, guidance scale) per decoder: each one's defaults, or the flags, applied as the app's figure applies
    its sliders (the first decoder refuses a scale it cannot take; another one without condition dropout takes 1)."""
    out = []
    for n, pipe in enumerate(pipes):
        requested = None if guidance is None else guidance if n == 0 or pipe.guidance_trained else 1.0
        try:
            scale = pipe.guidance(requested)
        except ValueError as exc:
            raise SystemExit(f"--guidance: {exc}") from None
        out.append((int(steps or pipe.config.diffusion.sample_steps), scale))
    return out


# ----------------------------------------------------------------------------------------------------- images


def pick_images(labels: np.ndarray, count: int, seed: int) -> list[int]:
    """``count`` test indices, one from each of ``count`` different classes (drawn with ``seed``), by class."""
    classes = np.unique(labels)
    if count > len(classes):
        raise SystemExit(f"--images {count}: the test set has {len(classes)} classes, one image per class")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(classes, size=count, replace=False))
    return [int(rng.choice(np.flatnonzero(labels == c))) for c in chosen]


def encoder_view(pipe: RCDMPipeline, grey: np.ndarray) -> np.ndarray:
    """What the app's ``session.view`` gives for the test image's file: the grey image as RGB (as the app's
    examples are written and ``load_image`` reads them), resized and centre-cropped as the encoder sees it."""
    import torch

    from visualizer.render import to_hwc

    rgb = np.array(Image.fromarray(grey).convert("RGB"), dtype=np.uint8)
    image = torch.from_numpy(rgb).permute(2, 0, 1).unsqueeze(0).contiguous()
    return to_hwc(pipe.encoder.model_view(image)[0])


def random_keep(ratio: float, seed: int, grid: int) -> np.ndarray:
    """The (grid, grid) keep bitmap of the app's random mask (``session.keep_bitmap("random", ...)``)."""
    from visualizer.masks import keep_bitmap

    try:
        keep = keep_bitmap("random", ratio, seed, 0.5, None, grid)
    except ValueError as exc:
        raise SystemExit(f"Bad mask: {exc}") from None
    if not keep.any():
        raise SystemExit(f"--ratio {ratio:g} masks every patch: lower it")
    return keep


def view_tensor(view: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(view).permute(2, 0, 1).unsqueeze(0).contiguous()


# ----------------------------------------------------------------------------------------------------- output


def labelled_block(picture: np.ndarray, text: str) -> Image.Image:
    """One image's block (:func:`visualizer.figure.paper_figure`'s picture) under a line of text."""
    block = Image.new("RGB", (picture.shape[1], picture.shape[0] + LABEL_PX), (255, 255, 255))
    block.paste(Image.fromarray(picture), (0, LABEL_PX))
    ImageDraw.Draw(block).text((4, 3), text, fill=(0, 0, 0))
    return block


def caption(lines: list[str], width: int) -> Image.Image:
    """The figure's head: what the columns are and which decoder each row of a block is."""
    head = Image.new("RGB", (width, LABEL_PX * len(lines) + 4), (255, 255, 255))
    draw = ImageDraw.Draw(head)
    for n, line in enumerate(lines):
        draw.text((4, 3 + n * LABEL_PX), line, fill=(0, 0, 0))
    return head


def stack(blocks: list[Image.Image]) -> Image.Image:
    """The blocks one under the other, ``GAP_PX`` of white between them."""
    width = max(b.width for b in blocks)
    canvas = Image.new("RGB", (width, sum(b.height for b in blocks) + GAP_PX * (len(blocks) - 1)), (255, 255, 255))
    y = 0
    for block in blocks:
        canvas.paste(block, (0, y))
        y += block.height + GAP_PX
    return canvas


def row_record(run: Path, row: FigureRow, steps: int, guidance: float) -> dict[str, Any]:
    return {"decoder": str(run), "kind": row.kind, "kept": row.kept, "patches": row.patches, "steps": steps,
            "guidance": guidance, "spread": row.spread, "spread_fraction": row.spread_fraction,
            "original_class": row.original_class, "condition_class": row.condition_class,
            "sample_classes": row.sample_classes, "similarity": row.similarity, "line": row.line()}


def save_png(image: Image.Image, path: Path) -> None:
    """Temporary file, fsync, rename (:func:`msn_core.durable.atomic_write`): a reader never sees half a PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    atomic_write(path, buffer.getvalue())


# ----------------------------------------------------------------------------------------------------- main


def render(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    from msn_core.masks import keep_from_bitmap
    from training.data import FashionMNIST
    from visualizer.figure import figure_row, paper_figure

    started = time.perf_counter()
    test = FashionMNIST(args.data_root, split="test")
    decoders = load_decoders(args.bundle, args.decoder, args.device)
    runs, pipes = [run for run, _ in decoders], [pipe for _, pipe in decoders]
    per_decoder = settings(pipes, args.steps, args.guidance)
    primary = pipes[0]  # the app's session view and grid are its primary decoder's encoder's
    indices = pick_images(test.labels, args.images, args.seed)
    blocks, images = [], []
    for k, index in enumerate(indices):
        name = str(test.classes[int(test.labels[index])])
        mask_seed = args.seed + k
        view = encoder_view(primary, test.images[index])
        keep = random_keep(args.ratio, mask_seed, primary.encoder.grid)
        image, keep_idx = view_tensor(view), keep_from_bitmap(keep)
        rows = [figure_row(pipe, image, keep_idx, num_samples=args.samples, steps=steps, guidance=scale,
                           seed=args.sample_seed) for pipe, (steps, scale) in zip(pipes, per_decoder)]
        picture, _ = paper_figure(rows, view, keep)
        title = (f"{k + 1}. test image {index}: {name} ({int(keep.sum())}/{keep.size} patches kept, "
                 f"mask seed {mask_seed})")
        blocks.append(labelled_block(picture, title))
        print(title)
        for n, row in enumerate(rows):
            print(f"  Row {n + 1}: {row.line()}")
        images.append({"test_index": index, "class": name, "label": int(test.labels[index]), "mask_seed": mask_seed,
                       "rows": [row_record(run, row, steps, scale)
                                for run, row, (steps, scale) in zip(runs, rows, per_decoder)]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    columns = f"Columns: the original (as the encoder sees it) | the masked input | {args.samples} samples"
    heads = [columns] + [f"Row {n + 1} of each block: {pipe.kind}" for n, pipe in enumerate(pipes)]
    save_png(stack([caption(heads, blocks[0].width), *blocks]), args.out)
    result = {
        "figure": args.out.name, "bundle": str(args.bundle), "model_id": primary.encoder.model_id,
        "ratio": args.ratio, "samples": args.samples, "seed": args.seed, "sample_seed": args.sample_seed,
        "columns": columns,
        "decoders": [{"decoder": str(run), "kind": pipe.kind, "step": pipe.step,
                      "sampler": pipe.config.diffusion.sampler, "steps": steps, "guidance": scale,
                      "guidance_trained": pipe.guidance_trained}
                     for run, pipe, (steps, scale) in zip(runs, pipes, per_decoder)],
        "images": images, "seconds": round(time.perf_counter() - started, 1), "device": args.device,
        "machine": machine(),
    }
    json_path = args.out.with_suffix(".json")
    atomic_write_json(json_path, result)
    print(f"wrote {args.out} and {json_path} ({result['seconds']} s)")
    return result


def main(argv: list[str] | None = None) -> None:
    render(parse_args(argv))


if __name__ == "__main__":
    main()
