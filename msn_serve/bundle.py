"""Reading an exported bundle (``msn.json`` + ``model.onnx``) and running it with ONNX Runtime.

The service never imports torch: everything it needs about the model (patch grid, preprocessing, output size)
comes from ``msn.json``, and the ONNX graph is checked against it at load time so a mismatched bundle fails at
start-up rather than on the first request.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger("msn_serve.bundle")

SUPPORTED_FORMAT_VERSIONS = {1}


class BundleError(RuntimeError):
    """The bundle directory is unusable (missing files, inconsistent metadata)."""


@dataclass(frozen=True)
class Preprocessing:
    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int = 3
    interpolation: str = "bicubic"


@dataclass(frozen=True)
class BundleInfo:
    """What serving needs from ``msn.json``; the raw document is kept for ``/v2/models/...`` metadata."""

    path: Path
    model_id: str
    embed_dim: int
    patch_size: int
    image_size: int
    in_chans: int
    pre: Preprocessing
    feature: str
    raw: dict[str, Any] = field(repr=False)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


def load_bundle(path: Path) -> BundleInfo:
    """Parse and sanity-check ``msn.json``; raise :class:`BundleError` with a precise reason."""
    meta_path = path / "msn.json"
    if not (path / "model.onnx").is_file():
        raise BundleError(f"{path}: no model.onnx (is this an msn-export bundle?)")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise BundleError(f"{path}: no msn.json") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{meta_path}: not valid JSON: {e}") from e
    try:
        version = int(raw.get("format_version", 1))
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise BundleError(f"{meta_path}: format_version {version} not supported")
        arch, pre = raw["architecture"], raw["preprocessing"]
        info = BundleInfo(
            path=path,
            model_id=str(raw.get("model_id") or arch.get("name") or path.name),
            embed_dim=int(arch["embed_dim"]),
            patch_size=int(arch["patch_size"]),
            image_size=int(arch.get("image_size", pre["crop"])),
            in_chans=int(arch.get("in_chans", pre.get("channels", 3))),
            pre=Preprocessing(
                resize=int(pre["resize"]),
                crop=int(pre["crop"]),
                mean=tuple(float(m) for m in pre["mean"]),
                std=tuple(float(s) for s in pre["std"]),
                channels=int(pre.get("channels", 3)),
                interpolation=str(pre.get("interpolation", "bicubic")),
            ),
            feature=str(raw.get("feature", "cls_pre_norm")),
            raw=raw,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{meta_path}: missing or malformed field: {e!r}") from e
    p = info.pre
    if p.crop != info.image_size or info.image_size % info.patch_size:
        raise BundleError(f"{meta_path}: crop {p.crop} / image_size {info.image_size} / patch "
                          f"{info.patch_size} are inconsistent")
    if len(p.mean) != p.channels or len(p.std) != p.channels or min(p.std) <= 0:
        raise BundleError(f"{meta_path}: mean/std must have one positive entry per channel")
    if p.resize < p.crop:
        raise BundleError(f"{meta_path}: resize {p.resize} < crop {p.crop}")
    return info


def _physical_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class Engine:
    """One ONNX Runtime session plus the knowledge of how to feed it.

    Runs are serialised by a lock: the batcher already sends one batch at a time, and a single CUDA session has
    one stream anyway; the lock makes direct callers (warm-up, OIP) safe too.
    """

    def __init__(self, info: BundleInfo, *, device: str = "cpu", intra_op_threads: int = 0,
                 fp16: bool = True, cache_dir: Path | None = None):
        self.info = info
        self._lock = threading.Lock()
        model_path = info.path / "model.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # a ViT is a chain: parallel mode only adds overhead
        so.inter_op_num_threads = 1
        so.intra_op_num_threads = intra_op_threads or _physical_cores()
        # Spinning threads would steal the cores uvicorn and the preprocessing pool need between batches.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.enable_cpu_mem_arena = True
        self.device = "cpu"
        providers: list[Any] = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers = [("CUDAExecutionProvider", {"device_id": 0, "arena_extend_strategy": "kSameAsRequested",
                                                        "cudnn_conv_algo_search": "HEURISTIC",
                                                        "do_copy_in_default_stream": True}),
                             "CPUExecutionProvider"]
                self.device = "cuda"
                if fp16:
                    model_path = _fp16_variant(model_path, cache_dir or info.path)
            else:
                log.warning("--device cuda requested but onnxruntime has no CUDAExecutionProvider "
                            "(install onnxruntime-gpu); falling back to CPU")
        self.model_path = model_path
        self.session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
        if model_path != info.path / "model.onnx" and not self._fp16_close_enough(so):
            self.model_path = info.path / "model.onnx"
            self.session = ort.InferenceSession(str(self.model_path), sess_options=so, providers=providers)
        names = {i.name: i for i in self.session.get_inputs()}
        if "pixel_values" not in names:
            raise BundleError(f"{model_path}: graph has no 'pixel_values' input (has {sorted(names)})")
        self.has_keep_idx = "keep_idx" in names
        self.has_keep_mask = "keep_mask" in names
        outs = [o.name for o in self.session.get_outputs()]
        self.output_name = "embedding" if "embedding" in outs else outs[0]
        log.info("ONNX Runtime %s session on %s (%s); keep_idx=%s keep_mask=%s", ort.__version__, self.device,
                 self.session.get_providers()[0], self.has_keep_idx, self.has_keep_mask)

    def _fp16_close_enough(self, so: ort.SessionOptions, min_cosine: float = 0.999) -> bool:
        """Accuracy gate for the fp16 graph: cosine >= ``min_cosine`` against fp32 on CPU for random inputs."""
        i = self.info
        ref = ort.InferenceSession(str(i.path / "model.onnx"), sess_options=so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {"pixel_values": rng.standard_normal((4, i.in_chans, i.image_size, i.image_size)).astype(np.float32)}
        names = {x.name for x in ref.get_inputs()}
        if "keep_idx" in names:
            feeds["keep_idx"] = np.stack([np.sort(rng.permutation(i.num_patches)) for _ in range(4)]).astype(np.int64)
        if "keep_mask" in names:
            feeds["keep_mask"] = np.ones((4, i.num_patches), dtype=bool)
        a = np.asarray(ref.run(None, feeds)[0], dtype=np.float64)
        b = np.asarray(self.session.run(None, feeds)[0], dtype=np.float64)
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        ok = bool(np.isfinite(b).all() and cos.min() >= min_cosine)
        log.log(logging.INFO if ok else logging.WARNING, "fp16 graph: min cosine %.6f vs fp32 -> %s",
                float(cos.min()), "using fp16" if ok else "falling back to fp32")
        return ok

    def run(self, pixels: np.ndarray, keep_idx: np.ndarray, keep_mask: np.ndarray | None = None) -> np.ndarray:
        """Embed a batch: ``pixels`` (B,C,H,W) float32, ``keep_idx`` (B,K) int64, ``keep_mask`` (B,K) bool."""
        feeds: dict[str, np.ndarray] = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32)}
        if self.has_keep_idx:
            feeds["keep_idx"] = np.ascontiguousarray(keep_idx, dtype=np.int64)
        elif keep_idx.shape[1] != self.info.num_patches:
            raise ValueError("this model was exported without keep_idx: masks are not supported")
        if self.has_keep_mask:
            km = np.ones(keep_idx.shape, dtype=bool) if keep_mask is None else keep_mask
            feeds["keep_mask"] = np.ascontiguousarray(km, dtype=bool)
        elif keep_mask is not None and not keep_mask.all():
            raise ValueError("this model was exported without keep_mask: padded batches are not supported")
        with self._lock:
            if self.device == "cuda":
                return self._run_iobinding(feeds)
            out = self.session.run([self.output_name], feeds)[0]
        return np.asarray(out, dtype=np.float32)

    def _run_iobinding(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """CUDA path: bind inputs once and let the output stay on device until the single copy back."""
        io = self.session.io_binding()
        for name, arr in feeds.items():
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        io.bind_output(self.output_name, "cuda")
        self.session.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[0], dtype=np.float32)


def _fp16_variant(model_path: Path, cache_dir: Path) -> Path:
    """Convert the graph to fp16 with fp32 inputs/outputs (cached next to the data); fp32 if no converter."""
    out = cache_dir / "model.fp16.onnx"
    if out.is_file() and out.stat().st_mtime >= model_path.stat().st_mtime:
        return out
    try:
        import onnx
        try:
            from onnxconverter_common import float16 as f16  # type: ignore[import-not-found]
            convert = f16.convert_float_to_float16
        except ImportError:
            from onnxruntime.transformers.float16 import convert_float_to_float16 as convert
        model = onnx.load(str(model_path))
        half = convert(model, keep_io_types=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        onnx.save(half, str(tmp))
        os.replace(tmp, out)
        log.info("wrote fp16 model variant %s", out)
        return out
    except Exception as e:  # noqa: BLE001 - any converter failure means "serve fp32", loudly
        log.warning("fp16 conversion failed (%s); serving the fp32 model on CUDA", e)
        return model_path
