"""``msn-visualize``: train an RCDM decoder on a bundle, sample from a masked image, or start the Gradio app.

    msn-visualize train  --bundle B --data fashion-mnist --config configs/rcdm_fmnist_32.yaml --output-dir runs/rcdm
    msn-visualize train  --bundle B --data photos/ --output-dir runs/rcdm   # your own images: a flat folder will do
    msn-visualize sample --bundle B --decoder runs/rcdm --image shoe.png --mask-ratio 0.7 --num-samples 8 --out grid.png
    msn-visualize sample ... --mask '{"ratio": 0.7, "seed": 1}'   # any /embed mask specification
    msn-visualize app    --bundle B --decoder runs/rcdm --port 7860
    msn-visualize app    --bundle B --decoder runs/rcdm/cls --decoder runs/rcdm/tokenmap   # or --decoder runs/rcdm
    msn-visualize app    --bundle B --serve-url http://127.0.0.1:8000    # no decoder: masks and nearest neighbours
    msn-visualize app    ... --host 0.0.0.0 --api-key-file key.txt     # outside localhost: require a login
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from msn_core.optional import missing

__all__ = ["main"]


class _Decoders(argparse.Action):
    """``--decoder`` repeated: the first one is ``decoder`` (one path, as before), the next ones ``more_decoders``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is None:
            setattr(namespace, self.dest, values)
        else:
            namespace.more_decoders = [*getattr(namespace, "more_decoders", []), values]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msn-visualize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a decoder conditioned on a bundle's frozen features")
    train.add_argument("--bundle", type=Path, required=True)
    train.add_argument("--config", type=Path, help="YAML config (configs/rcdm_*.yaml)")
    train.add_argument("--data", metavar="DIR|LIST|NAME",
                       help="your images: a folder (flat, nested or root/<class>/...; labels optional), a file list "
                            "or a pattern (data.source=auto, data.root); or a source name: fashion-mnist | synthetic "
                            "| folder | image_folder | file_list | glob (with --data-root)")
    train.add_argument("--data-root", help="the folder, list or pattern of a source named by --data (data.root)")
    train.add_argument("--output-dir", type=Path, required=True)
    train.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                       help="override config keys, e.g. --set optim.max_steps=500 data.batch_size=32 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt if present")

    sample = sub.add_parser("sample", help="sample images conditioned on one (masked) image")
    sample.add_argument("--bundle", type=Path, required=True)
    sample.add_argument("--decoder", type=Path, required=True, help="run directory or checkpoint.pt")
    sample.add_argument("--image", type=Path, required=True)
    mask = sample.add_mutually_exclusive_group()
    mask.add_argument("--mask-ratio", type=float, default=0.0, help="fraction of patches dropped at random")
    mask.add_argument("--focal", type=float, metavar="FRACTION",
                      help="keep only a centred block covering FRACTION of the grid side")
    mask.add_argument("--mask", metavar="JSON",
                      help='a mask specification as /embed takes, e.g. \'{"keep_idx": [0, 5]}\'')
    sample.add_argument("--mask-seed", type=int, default=0, help='with --mask-ratio: the mask {"ratio": R, "seed": S}')
    sample.add_argument("--num-samples", type=int, default=8)
    sample.add_argument("--steps", type=int, help="sampling steps (default: the decoder config's)")
    sample.add_argument("--sampler", choices=("ddim", "ddpm", "dpmpp"))
    sample.add_argument("--guidance-scale", type=float,
                        help="classifier-free guidance; other than 1 only for a decoder trained with condition dropout")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--backend", choices=("torch", "onnx"), help="encoder backend (default: as trained)")
    sample.add_argument("--device", default="cpu")
    sample.add_argument("--out", type=Path, required=True, help="PNG grid: original | masked | samples")

    app = sub.add_parser("app", help="start the Gradio app")
    app.add_argument("--bundle", type=Path, required=True)
    app.add_argument("--decoder", type=Path, action=_Decoders,
                     help="a decoder run (msn-visualize train), or a directory of runs; again for another decoder on "
                          "the bundle, shown beside the first (the CLS decoder leads). Without one the app offers "
                          "masks and nearest neighbours, no sampling")
    app.add_argument("--compare-bundle", type=Path, help="a second bundle for the side-by-side mode")
    app.add_argument("--compare-decoder", type=Path, help="the decoder trained on --compare-bundle")
    app.add_argument("--host", default="127.0.0.1")
    app.add_argument("--port", type=int, default=7860)
    app.add_argument("--device", default="cpu")
    app.add_argument("--concurrency", type=int, default=2, help="sampling requests run at once")
    app.add_argument("--auth-file", type=Path, default=os.environ.get("MSN_VISUALIZE_AUTH_FILE"),
                     help="require a login: a file of user:password lines (env MSN_VISUALIZE_AUTH_FILE)")
    app.add_argument("--api-key-file", type=Path, default=os.environ.get("MSN_VISUALIZE_API_KEY_FILE"),
                     help="require a login whose password is this key (msn-serve's key file works; any user "
                          "name; env MSN_VISUALIZE_API_KEY_FILE)")
    app.add_argument("--serve-url", default=os.environ.get("MSN_VISUALIZE_SERVE_URL", "http://127.0.0.1:8000"),
                     help="the msn-serve the labelling tab talks to by default (env MSN_VISUALIZE_SERVE_URL)")
    app.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    return parser


def _data_overrides(data: str | None, root: str | None) -> list[str]:
    """``--data``/``--data-root`` as config overrides (``--set`` still wins): a path is pretraining's ``--data DIR``
    (``auto`` lists it as pretraining does), a source name stays a name."""
    from msn_core.sources import SOURCES

    out = [f"data.root={json.dumps(os.path.abspath(root))}"] if root else []  # JSON strings are YAML strings
    if data is None:
        return out
    if data in SOURCES and not os.path.exists(data):
        return [f"data.source={data}", *out]
    if not os.path.exists(data) and not glob.has_magic(data):
        raise FileNotFoundError(f"--data {data}: no such folder or file list, and not a source ({', '.join(SOURCES)})")
    return ["data.source=auto", f"data.root={json.dumps(os.path.abspath(data))}"]


def _train(args: argparse.Namespace) -> int:
    from training.api import cleanup, init_distributed
    from visualizer.config import ConfigError, load_config
    from visualizer.train import train

    overrides = list(args.overrides)
    try:
        overrides[:0] = _data_overrides(args.data, args.data_root)
    except FileNotFoundError as exc:
        raise SystemExit(f"msn-visualize train: {exc}") from None
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        raise SystemExit(f"msn-visualize train: {exc}") from None
    info = init_distributed(cfg.run.device)
    logging.basicConfig(level=logging.INFO if info.rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        record = train(cfg, args.bundle, args.output_dir, resume=args.resume, info=info)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"msn-visualize train: {exc}") from None
    finally:
        cleanup()
    if info.rank == 0:
        print(f"done: step {record.get('step')}, checkpoint {args.output_dir / 'checkpoint.pt'}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from msn_core.masks import resolve_mask
    from visualizer.masks import mask_spec
    from visualizer.pipeline import RCDMPipeline, load_image
    from visualizer.render import bitmap_from_keep_idx, masked_view, save_grid, to_hwc

    try:
        pipe = RCDMPipeline.from_dirs(args.bundle, args.decoder, device=args.device, backend=args.backend)
        image = load_image(args.image, min_size=1)
        enc = pipe.encoder
        if args.focal is not None and not 0 < args.focal <= 1:
            raise ValueError("--focal must be in (0, 1]")
        if args.mask is not None:
            spec = json.loads(args.mask)
        else:
            mode = "focal" if args.focal is not None else "random"
            spec = mask_spec(mode, args.mask_ratio, args.mask_seed, args.focal or 0.0, enc.grid)
        keep = resolve_mask(spec, enc.grid)
        samples = pipe.sample(image, keep, num_samples=args.num_samples, steps=args.steps,
                              guidance_scale=args.guidance_scale, sampler=args.sampler, seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:  # bad JSON and bad masks are ValueErrors too
        raise SystemExit(f"msn-visualize sample: {exc}") from None
    view = to_hwc(enc.model_view(image)[0])
    row = [view, masked_view(view, bitmap_from_keep_idx(keep, enc.grid))] + [to_hwc(s) for s in samples]
    save_grid([row], args.out, cell=max(96, pipe.image_size))
    print(f"wrote {args.out} ({len(samples)} samples, {len(keep)}/{enc.num_patches} patches kept)")
    return 0


def _app(args: argparse.Namespace) -> int:
    from visualizer.app import launch, password_check

    if (args.compare_bundle is None) != (args.compare_decoder is None):
        raise SystemExit("msn-visualize app: --compare-bundle and --compare-decoder go together")
    if args.compare_bundle is not None and args.decoder is None:
        raise SystemExit("msn-visualize app: comparing decoders needs --decoder too")
    try:
        auth = password_check(args.auth_file, args.api_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"msn-visualize app: {exc}") from None
    decoders = None if args.decoder is None else [args.decoder, *getattr(args, "more_decoders", [])]
    launch(args.bundle, decoders, compare=(args.compare_bundle, args.compare_decoder) if args.compare_bundle
           else None, host=args.host, port=args.port, device=args.device, concurrency=args.concurrency, auth=auth,
           serve_url=args.serve_url)
    return 0


# What each command imports first that a partial install may lack (the registry names the extra that brings it).
NEEDS = {"train": ("torch", "diffusers"), "sample": ("torch", "diffusers"), "app": ("torch", "diffusers", "gradio")}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for module in NEEDS[args.command]:
        if problem := missing(module, f"msn-visualize {args.command}"):
            raise SystemExit(f"msn-visualize: {problem}")
    return {"train": _train, "sample": _sample, "app": _app}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
