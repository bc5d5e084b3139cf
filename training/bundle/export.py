"""Export an MSN target encoder as a self-describing bundle (``msn-export``).

A bundle is what serving and the visualizer read, never a training checkpoint::

    model.onnx (+ model.onnx.data)   pixel_values (B,3,H,W) f32, keep_idx (B,K) i64 (-1 = padding)
                                     -> embedding (B,D) f32; dynamic B and K
    encoder.safetensors              the same trunk for torch users (official key names)
    msn.json                         architecture, preprocessing, feature, ONNX I/O, source, parity
    model.int8.onnx (--quantize int8) the same graph quantized, with its accuracy guard in msn.json

The schema of ``msn.json`` and the graph's input contract are :mod:`msn_core.bundle`'s; this module only makes the
torch artefacts.

The bundle is built in a temporary sibling directory and renamed into place only after ONNX Runtime reproduced
the torch features, so a crash or a failed check never leaves a half-written or silently wrong bundle behind.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from msn_core.bundle import (
    FEATURES,
    FORMAT_VERSION,
    GRAPH_INPUTS,
    META_FILE,
    ONNX_FILE,
    OUTPUT_NAME,
    WEIGHTS_FILE,
    Architecture,
    BundleInfo,
    Int8Graph,
    Preprocessing,
    load_bundle_info,
    write_bundle_info,
)
from msn_core.durable import fsync_path
from training.checkpoint import file_sha256
from training.bundle.convert import (
    complete_preprocessing,
    encoder_from_hf,
    encoder_from_official,
    encoder_from_training_checkpoint,
    load_trunk,
    resize_encoder,
)
from training.masking import split_padding
from training.bundle.quantize import QuantizationRefused, QuantizeOptions, data_source, quantize_bundle
from training.bundle.quantize import add_arguments as add_quantize_arguments
from training.bundle.quantize import options_from_args as quantize_options
from training.model.vit import VisionTransformer, encoder_kwargs

__all__ = [
    "FEATURES",
    "ExportError",
    "add_int8",
    "encoder_from_training_checkpoint",
    "export_bundle",
    "load_encoder",
    "main",
]

PARITY_ATOL = 1e-4


class ExportError(RuntimeError):
    """The bundle could not be written or failed verification; nothing was written to the target."""


class EmbeddingGraph(nn.Module):
    """What the ONNX graph computes: the chosen CLS feature of the kept patches; ``-1`` in ``keep_idx`` is padding.

    Padding travels inside ``keep_idx`` rather than as a third ``keep_mask`` input so that a client with one mask
    per batch (the common case) feeds two inputs and a mixed-K batch needs no extra tensor (msn_core.bundle).
    """

    def __init__(self, encoder: VisionTransformer, feature: str) -> None:
        super().__init__()
        self.encoder, self.feature_index = encoder, FEATURES.index(feature)

    def forward(self, pixel_values: Tensor, keep_idx: Tensor) -> Tensor:
        gather_idx, keep_mask = split_padding(keep_idx)
        return self.encoder(pixel_values, gather_idx, keep_mask)[self.feature_index]


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
    parity_atol: float = PARITY_ATOL,
    quantize: QuantizeOptions | None = None,
) -> dict:
    """Write a bundle for ``encoder`` to ``out_dir`` atomically and return its ``msn.json`` content.

    An existing bundle at ``out_dir`` is replaced only once the new one is complete and verified; a directory
    that is not a bundle is never touched. Raises :class:`ExportError` if ORT and torch differ by more than
    ``parity_atol`` (at K = all patches, K = 30 % and a padded mixed-K batch), or, with ``quantize``, when no int8
    graph passes the accuracy guard.
    """
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; expected one of {', '.join(FEATURES)}")
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
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
    with _staging_dir(out_dir) as staging:
        weights = _save_weights(encoder, staging / WEIGHTS_FILE)
        graph = EmbeddingGraph(encoder, feature).eval()
        _export_onnx(graph, staging / ONNX_FILE, opset)
        parity = _parity_check(graph, staging / ONNX_FILE, parity_atol) if parity_check else None
        info = BundleInfo(
            model_id=f"msn-{arch.removeprefix('vit_')}{encoder.patch_size}-{weights['content_sha256'][:12]}",
            architecture=architecture, preprocessing=pre, feature=feature, format_version=FORMAT_VERSION,
            onnx=_onnx_summary(staging, opset),
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
    with _staging_dir(bundle_dir) as staging:
        for path in bundle_dir.iterdir():
            if path.is_file() and (info.int8 is None or path.name != info.int8.file):
                shutil.copy2(path, staging / path.name)
        info = dataclasses.replace(info, int8=None, path=staging)
        write_bundle_info(staging, info)
        info = _add_int8(staging, info, options, info.extra.get("training"))
    return info.to_dict()


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise ExportError(f"{out_dir} exists and is not an MSN bundle (no {META_FILE}); refusing to replace it")


@contextlib.contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success fsync it and swap it into place, else delete it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield staging
        for path in staging.iterdir():  # mkdtemp makes a 0700 dir: bundles are read by other users (serving)
            path.chmod(0o644)
            fsync_path(path)
        staging.chmod(0o755)
        fsync_path(staging)
        if out_dir.exists():  # a directory cannot be os.replace'd over a non-empty one: park the old bundle
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, retired / "bundle")
            try:
                os.replace(staging, out_dir)
            except BaseException:
                os.replace(retired / "bundle", out_dir)
                raise
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
        fsync_path(out_dir.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def weights_digest(state: dict[str, Tensor]) -> str:
    """SHA-256 of the tensors themselves (sorted names, dtypes, shapes, bytes).

    The model id is built from this and not from the file's hash: safetensors writes its metadata in a hash-map
    order that changes from process to process, so re-exporting the same weights gives a different file."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}:{state[key].dtype}:{tuple(state[key].shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _save_weights(encoder: VisionTransformer, path: Path) -> dict:
    state = {key: value.detach().contiguous() for key, value in encoder.state_dict().items()}
    save_file(
        state, str(path), metadata={"format": "pt", "encoder_kwargs": json.dumps(encoder_kwargs(encoder))}
    )
    return {"file": WEIGHTS_FILE, "sha256": file_sha256(path), "content_sha256": weights_digest(state)}


def _example_inputs(encoder: VisionTransformer, batch: int, keep: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = encoder.image_size
    images = torch.randn(batch, encoder.in_chans, size, size, generator=generator)
    keep_idx = torch.stack(
        [torch.randperm(encoder.num_patches, generator=generator)[:keep] for _ in range(batch)]
    )
    return images, keep_idx


def _export_onnx(graph: EmbeddingGraph, path: Path, opset: int) -> None:
    """Dynamo export with dynamic batch and kept-patch count; H and W stay fixed (no resize op in the graph)."""
    num_patches = graph.encoder.num_patches
    # Example sizes must avoid 0/1 (torch.export specialises them) and must not tie K to the patch count.
    example = _example_inputs(graph.encoder, batch=2, keep=max(2, num_patches // 2))
    batch, num_keep = torch.export.Dim("batch"), torch.export.Dim("num_keep")
    dynamic_shapes = {"pixel_values": {0: batch}, "keep_idx": {0: batch, 1: num_keep}}
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # silences "torchvision is not installed" registry chatter
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                graph, example, dynamo=True, input_names=list(GRAPH_INPUTS), output_names=[OUTPUT_NAME],
                dynamic_shapes=dynamic_shapes, opset_version=opset, verbose=False,
            )  # fmt: skip
            program.save(str(path))  # weights go to model.onnx.data automatically above 2 GB
    except Exception as exc:
        raise ExportError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc
    finally:
        onnx_logger.setLevel(level)


def _onnx_summary(bundle: Path, opset: int) -> dict:
    """Inputs/outputs as written in the graph (names, dtypes, symbolic dims), so readers need not guess."""
    import onnx

    model = onnx.load(str(bundle / ONNX_FILE), load_external_data=False)

    def describe(value) -> dict:
        tensor = value.type.tensor_type
        shape = [dim.dim_param or dim.dim_value for dim in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        return {"name": value.name, "dtype": dtype, "shape": shape}

    extra = sorted(p.name for p in bundle.iterdir() if p.name.startswith(ONNX_FILE + "."))
    return {
        "file": ONNX_FILE,
        "external_data": extra[0] if extra else None,
        "opset": opset,
        "inputs": [describe(value) for value in model.graph.input],
        "outputs": [describe(value) for value in model.graph.output],
        "torch_version": torch.__version__,
    }


def _run_onnx(path: Path, inputs: Sequence[Tensor]) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {name: tensor.numpy() for name, tensor in zip(GRAPH_INPUTS, inputs, strict=True)}
    return session.run([OUTPUT_NAME], feeds)[0]


def _parity_check(graph: EmbeddingGraph, path: Path, atol: float) -> dict:
    """Compare ORT with torch on random inputs; raise ExportError above ``atol``."""
    encoder = graph.encoder
    keep_30 = max(1, round(0.3 * encoder.num_patches))
    padded = _example_inputs(encoder, batch=3, keep=encoder.num_patches, seed=2)
    padded[1][0, keep_30:] = -1  # sample 0 keeps 30 %, the rest is padding
    cases = {
        "keep_all": _example_inputs(encoder, batch=2, keep=encoder.num_patches, seed=0),
        "keep_30pct": _example_inputs(encoder, batch=2, keep=keep_30, seed=1),
        "padded_mixed": padded,
    }
    diffs = {}
    for name, inputs in cases.items():
        with torch.no_grad():
            expected = graph(*inputs).numpy()
        diffs[name] = float(np.abs(_run_onnx(path, inputs) - expected).max())
    failed = {name: diff for name, diff in diffs.items() if not diff <= atol}  # `not <=` also catches NaN
    if failed:
        raise ExportError(f"ONNX Runtime output differs from torch by more than {atol:g}: {failed}")
    return {"tolerance": atol, "max_abs_diff": diffs}


# --- bundle reading ---------------------------------------------------------------------------------------


def load_encoder(bundle_dir: str | Path) -> tuple[VisionTransformer, BundleInfo]:
    """The torch encoder of a bundle (eval mode) and its ``msn.json``."""
    info = load_bundle_info(bundle_dir, need=(WEIGHTS_FILE,))
    encoder = VisionTransformer(**info.architecture.encoder_kwargs())
    weights = str(Path(bundle_dir) / WEIGHTS_FILE)
    load_trunk(encoder, load_file(weights), weights)
    return encoder.eval(), info


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
        choices=FEATURES,
        default="cls_pre_norm",
        help="embedding to export (default: cls_pre_norm, the paper's low-shot feature)",
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
            encoder, args.out, arch=info["arch"], preprocessing=info["preprocessing"], feature=args.feature,
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
