"""Export an MSN target encoder as a self-describing bundle (``msn-export``).

A bundle is what serving and the visualizer read, never a training checkpoint::

    model.onnx (+ model.onnx.data)   pixel_values (B,3,H,W) f32, keep_idx (B,K) i64 (-1 = padding)
                                     -> embedding (B,D) f32; dynamic B and K
    encoder.safetensors              the same trunk for torch users (official key names)
    msn.json                         architecture, preprocessing, feature, ONNX I/O, source, parity
    model.int8.onnx (--quantize int8) the same graph quantized, with its accuracy guard in msn.json

The schema of ``msn.json`` and the graph's input contract are :mod:`msn_core.bundle`'s; this module only makes the
torch artefacts.

The bundle is built in a staging directory and swapped into place (:func:`msn_core.durable.replace_dir`) only
after ONNX Runtime reproduced the torch features (:mod:`training.bundle.onnx_graph`); checkpoints are read by
:mod:`training.bundle.sources`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import pickle
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from msn_core.bundle import (
    FORMAT_VERSION,
    ONNX_FILE,
    WEIGHTS_FILE,
    Architecture,
    BundleInfo,
    Int8Graph,
    Preprocessing,
    load_bundle_info,
    write_bundle_info,
)
from msn_core.durable import replace_dir
from msn_core.features import FEATURE_PATTERNS, check_feature
from training.bundle import onnx_graph
from training.bundle.files import ExportError, check_replaceable, save_weights
from training.bundle.quantize import QuantizationRefused, QuantizeOptions, data_source, quantize_bundle
from training.bundle.quantize import add_arguments as add_quantize_arguments
from training.bundle.quantize import options_from_args as quantize_options
from training.bundle.sources import (
    complete_preprocessing,
    encoder_from_hf,
    encoder_from_official,
    encoder_from_training_checkpoint,
    resize_encoder,
)
from training.model.vit import VisionTransformer, encoder_kwargs

__all__ = ["ExportError", "add_int8", "export_bundle", "main"]


# --- bundle writing ---------------------------------------------------------------------------------------


def export_bundle(
    encoder: VisionTransformer,
    out_dir: str | Path,
    *,
    arch: str,
    preprocessing: dict,
    feature: str = "cls_pre_norm",
    source_sha256: str | None = None,
    training_summary: dict | None = None,
    opset: int = 18,
    parity_check: bool = True,
    source_kind: str = "training",
    source_name: str | None = None,
    parity_atol: float = onnx_graph.PARITY_ATOL,
    quantize: QuantizeOptions | None = None,
) -> dict:
    """Write a bundle for ``encoder`` to ``out_dir`` atomically and return its ``msn.json`` content.

    An existing bundle at ``out_dir`` is replaced only once the new one is complete and verified; a directory
    that is not a bundle is never touched. Raises :class:`ExportError` if ORT and torch differ by more than
    ``parity_atol`` (at K = all patches, K = 30 % and a padded mixed-K batch), or, with ``quantize``, when no int8
    graph passes the accuracy guard.
    """
    check_feature(feature, depth=encoder.depth, grid=encoder.grid_size)  # FeatureError (ValueError) names the choices
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    if quantize is not None:
        try:
            data_source(quantize, training_summary)  # before the expensive part
        except QuantizationRefused as exc:
            raise ExportError(str(exc)) from exc
    encoder = copy.deepcopy(encoder).to("cpu", torch.float32).eval()
    kwargs = {k: v for k, v in encoder_kwargs(encoder).items() if k != "drop_path_rate"}
    architecture = Architecture(name=arch, **kwargs)  # validated before the expensive part
    pre = Preprocessing.from_dict(complete_preprocessing(preprocessing, encoder.image_size))
    started = time.perf_counter()
    with replace_dir(out_dir) as staging:  # kill -9 never leaves half a bundle
        weights = save_weights(encoder, staging / WEIGHTS_FILE)
        graph = onnx_graph.EmbeddingGraph(encoder, feature).eval()
        onnx_graph.export_onnx(graph, staging / ONNX_FILE, opset)
        parity = onnx_graph.parity_check(graph, staging / ONNX_FILE, parity_atol) if parity_check else None
        info = BundleInfo(
            model_id=f"msn-{arch.removeprefix('vit_')}{encoder.patch_size}-{weights['content_sha256'][:12]}",
            architecture=architecture, preprocessing=pre, feature=feature, format_version=FORMAT_VERSION,
            onnx=onnx_graph.onnx_summary(staging, opset),
            extra={
                "weights": weights,
                "source": {"kind": source_kind, "path": source_name, "sha256": source_sha256},
                "training": training_summary,
                "parity": parity,
                "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "export_seconds": round(time.perf_counter() - started, 2),
            },
        )
        write_bundle_info(staging, info)
        if quantize is not None:
            info = _add_int8(staging, info, quantize, training_summary)
    return info.to_dict()


def _add_int8(staging: Path, info: BundleInfo, options: QuantizeOptions, training: dict | None) -> BundleInfo:
    try:
        section = quantize_bundle(staging, options, training)
    except QuantizationRefused as exc:
        raise ExportError(str(exc)) from exc
    info = dataclasses.replace(info, int8=Int8Graph.from_dict(section), path=staging)
    write_bundle_info(staging, info)
    return info


def add_int8(bundle_dir: str | Path, options: QuantizeOptions) -> dict:
    """Add (or replace) the int8 graph of an existing bundle, atomically: the bundle is copied to a staging
    directory, quantized and guarded there, and swapped in only if the guard passed."""
    bundle_dir = Path(bundle_dir)
    info = load_bundle_info(bundle_dir, need=(ONNX_FILE,))
    with replace_dir(bundle_dir) as staging:
        for path in bundle_dir.iterdir():
            if path.is_file() and (info.int8 is None or path.name != info.int8.file):
                shutil.copy2(path, staging / path.name)
        info = dataclasses.replace(info, int8=None, path=staging)
        write_bundle_info(staging, info)
        info = _add_int8(staging, info, options, info.extra.get("training"))
    return info.to_dict()


# --- CLI --------------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="msn-export",
        description="Export an MSN target encoder (ours, official or HuggingFace) as an ONNX + safetensors bundle.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="training checkpoint written by training/pretrain.py")
    source.add_argument("--from-official", type=Path, metavar="PTH", help="facebookresearch/msn .pth.tar")
    source.add_argument("--from-hf", type=Path, metavar="DIR", help="ViTMSN dir: config.json + weights")
    source.add_argument("--bundle", type=Path, metavar="DIR",
                        help="an existing bundle: add its int8 graph in place (with --quantize int8)")
    parser.add_argument("--out", type=Path, help="bundle directory to create or replace")
    parser.add_argument(
        "--arch", help="official model name for --from-official, e.g. deit_small, deit_base_p4"
    )
    parser.add_argument("--image-size", type=int, help="input size of the bundle (default: the source's)")
    parser.add_argument(
        "--feature",
        help=f"embedding to export: {', '.join(FEATURE_PATTERNS)} (default: the training config's "
             "model.feature; cls_pre_norm, the paper's low-shot feature, for official and HF weights)",
    )
    parser.add_argument("--opset", type=int, default=18)
    parser.add_argument("--no-parity", action="store_true", help="skip the ONNX Runtime vs torch check")
    add_quantize_arguments(parser)
    args = parser.parse_args(argv)
    if args.bundle is not None and (args.quantize is None or args.out is not None):
        parser.error("--bundle adds an int8 graph to an existing bundle: give --quantize int8 and no --out")
    if args.bundle is None and args.out is None:
        parser.error("--out is required")
    if args.from_official is not None and not args.arch:
        parser.error("--from-official needs --arch (e.g. --arch deit_base)")
    if args.arch and args.from_official is None:
        parser.error("--arch only applies to --from-official (the other sources record their architecture)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        quantize = quantize_options(args)
        if args.bundle is not None:
            meta = add_int8(args.bundle, quantize)
            print(f"added {meta['int8']['file']} to {args.bundle} ({_int8_summary(meta)})", file=sys.stdout)
            return 0
        if args.checkpoint is not None:
            encoder, info = encoder_from_training_checkpoint(args.checkpoint)
        elif args.from_official is not None:
            encoder, info = encoder_from_official(args.from_official, args.arch, args.image_size or 224)
        else:
            encoder, info = encoder_from_hf(args.from_hf)
        if args.image_size and args.image_size != encoder.image_size:
            encoder, info["preprocessing"] = resize_encoder(encoder, info["preprocessing"], args.image_size)
        meta = export_bundle(
            encoder, args.out, arch=info["arch"], preprocessing=info["preprocessing"],
            feature=args.feature or info.get("feature") or "cls_pre_norm",
            source_sha256=info["sha256"], training_summary=info.get("training"), opset=args.opset,
            parity_check=not args.no_parity, source_kind=info["kind"], source_name=info["path"], quantize=quantize,
        )  # fmt: skip
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
        raise SystemExit(f"msn-export: error: {exc}") from None
    parity = meta["parity"]["max_abs_diff"] if meta["parity"] else "skipped"
    print(f"wrote {args.out} ({meta['model_id']}, feature {meta['feature']}, "
          f"{meta['export_seconds']} s, ORT max abs diff {parity})", file=sys.stdout)  # fmt: skip
    if meta.get("int8"):
        print(f"  + {meta['int8']['file']}: {_int8_summary(meta)}", file=sys.stdout)
    return 0


def _int8_summary(meta: dict) -> str:
    int8, guard = meta["int8"], meta["int8"]["guard"]
    speed = int8["speed"]["candidates"][int8["method"]]
    lowshot = ", ".join(f"{k} {v['int8']:.1f} vs {v['fp32']:.1f}" for k, v in (guard["lowshot"] or {}).items())
    return (f"{int8['method']} quantization, x{speed['speedup']} images/s over fp32 here, min cosine "
            f"{guard['cosine']['min']:.4f}, low-shot int8 vs fp32: {lowshot or guard['lowshot_skipped']}")


if __name__ == "__main__":
    sys.exit(main())
