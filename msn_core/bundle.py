"""The exported bundle: the ``msn.json`` schema as typed dataclasses, its reader/validator and writer, and the
ONNX graph's input contract. ``msn-export`` writes it; serving, evaluation and the visualizer read it only here.

A bundle directory holds ``model.onnx`` (+ ``model.onnx.data`` when large), ``encoder.safetensors`` and ``msn.json``.
The graph (format 2) takes ``pixel_values`` float32 ``(B, C, H, W)``, normalised as ``preprocessing`` says, and
``keep_idx`` int64 ``(B, K)``: the kept patches, row-major; a batch whose images keep different numbers of patches
pads the short rows with ``-1`` (:data:`msn_core.masks.PAD`). It returns ``embedding`` float32 ``(B, D)``; B and K are
dynamic. Format 1 graphs had a third, required input ``keep_mask`` bool ``(B, K)`` instead of the ``-1`` padding;
they are still read, and :func:`onnx_feeds` feeds either.

A bundle may also hold an int8 graph beside the fp32 one (``msn-export --quantize int8``), with the same inputs and
output: ``msn.json``'s optional ``int8`` section names its file, how it was quantized, and the accuracy guard it
passed against the fp32 graph at export (a bundle whose int8 graph failed the guard is never written). Readers that
predate the section ignore it, so the format version stays 2.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from msn_core.durable import atomic_write_json, recover_dir
from msn_core.features import FeatureError, check_feature, feature_dim
from msn_core.masks import PAD

__all__ = [
    "FORMAT_VERSION",
    "GRAPH_INPUTS",
    "INT8_METHODS",
    "INT8_ONNX_FILE",
    "META_FILE",
    "ONNX_FILE",
    "OUTPUT_NAME",
    "PRECISIONS",
    "READABLE_FORMAT_VERSIONS",
    "WEIGHTS_FILE",
    "Architecture",
    "BundleError",
    "BundleInfo",
    "Int8Graph",
    "Preprocessing",
    "check_graph_inputs",
    "load_bundle_info",
    "onnx_feeds",
    "parse_bundle_info",
    "write_bundle_info",
]

FORMAT_VERSION = 2  # 2: keep_idx carries -1 padding, no keep_mask input
READABLE_FORMAT_VERSIONS = (1, 2)
META_FILE, ONNX_FILE, WEIGHTS_FILE = "msn.json", "model.onnx", "encoder.safetensors"
GRAPH_INPUTS = ("pixel_values", "keep_idx")
LEGACY_MASK_INPUT = "keep_mask"
OUTPUT_NAME = "embedding"
INT8_ONNX_FILE = "model.int8.onnx"
# ONNX Runtime quantization: weights only (dynamic), or weights + calibrated activations as QLinear operators
# (static) or as QuantizeLinear/DequantizeLinear pairs (qdq: the format OpenVINO also runs on int8 kernels).
INT8_METHODS = ("dynamic", "static", "qdq")
PRECISIONS = ("fp32", "int8")


class BundleError(ValueError):
    """The bundle is unusable: a missing file, or ``msn.json`` missing a field or contradicting itself."""


def _positive_ints(obj: Any, names: Collection[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BundleError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Preprocessing:
    """Evaluation transform: shorter side to ``resize`` (``interpolation``), centre crop ``crop``, then
    ``(x / 255 - mean) / std`` per channel on ``channels`` (1 = grey, 3 = RGB)."""

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int = 3
    interpolation: str = "bicubic"

    def __post_init__(self) -> None:
        _positive_ints(self, ("resize", "crop", "channels"))
        if self.resize < self.crop:
            raise BundleError(f"preprocessing.resize {self.resize} is smaller than crop {self.crop}")
        if self.channels not in (1, 3):
            raise BundleError(f"preprocessing.channels must be 1 or 3, got {self.channels}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise BundleError("preprocessing.mean and .std need one entry per channel")
        if not all(math.isfinite(v) for v in self.mean + self.std) or min(self.std) <= 0:
            raise BundleError("preprocessing.mean must be finite and .std positive")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Preprocessing:
        return cls(resize=int(d["resize"]), crop=int(d["crop"]), mean=tuple(float(m) for m in d["mean"]),
                   std=tuple(float(s) for s in d["std"]), channels=int(d.get("channels", 3)),
                   interpolation=str(d.get("interpolation", "bicubic")))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}


_STEM_FIELDS = ("conv_stem_channels", "conv_stem_strides")


def _int_tuple(value: Any, name: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        raise BundleError(f"architecture.{name} must be a non-empty list of positive integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Architecture:
    """The ViT trunk: ``name`` plus the constructor arguments of ``training.model.vit.VisionTransformer``.

    ``conv_stem_channels``/``conv_stem_strides`` describe a conv stem (the official ``*_convstem`` models): one
    output width and one stride per convolution, 3x3 + BatchNorm + ReLU for all but the last, a 1x1 projection to
    ``embed_dim`` last; ``patch_size`` is then the product of the strides. Absent (``None``, and left out of
    ``msn.json``) means the plain patch projection, so bundles written before the fields existed read unchanged.
    """

    name: str
    image_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    in_chans: int = 3
    mlp_ratio: float = 4.0
    conv_stem_channels: tuple[int, ...] | None = None
    conv_stem_strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _positive_ints(self, ("image_size", "patch_size", "embed_dim", "depth", "num_heads", "in_chans"))
        self._check_stem()
        if self.image_size % self.patch_size:
            raise BundleError(f"architecture.image_size {self.image_size} is not a multiple of patch_size "
                              f"{self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise BundleError(f"architecture.embed_dim {self.embed_dim} is not divisible by num_heads "
                              f"{self.num_heads}")

    def _check_stem(self) -> None:
        channels, strides = self.conv_stem_channels, self.conv_stem_strides
        if channels is None and strides is None:
            return
        if channels is None or strides is None:
            raise BundleError("architecture.conv_stem_channels and conv_stem_strides go together")
        channels, strides = _int_tuple(channels, "conv_stem_channels"), _int_tuple(strides, "conv_stem_strides")
        object.__setattr__(self, "conv_stem_channels", channels)  # lists (from JSON or kwargs) -> tuples
        object.__setattr__(self, "conv_stem_strides", strides)
        if len(channels) != len(strides):
            raise BundleError(f"architecture.conv_stem_channels {list(channels)} and conv_stem_strides "
                              f"{list(strides)} differ in length")
        if channels[-1] != self.embed_dim:
            raise BundleError(f"architecture.conv_stem_channels ends with {channels[-1]}, not embed_dim "
                              f"{self.embed_dim}")
        if math.prod(strides) != self.patch_size:
            raise BundleError(f"architecture.conv_stem_strides {list(strides)} give patch size "
                              f"{math.prod(strides)}, not patch_size {self.patch_size}")

    @property
    def conv_stem(self) -> bool:
        """Whether the trunk embeds patches with a conv stem rather than one p×p projection."""
        return self.conv_stem_strides is not None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Architecture:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise BundleError(f"unknown architecture field(s) {unknown}")
        ints = {k: int(d[k]) for k in ("image_size", "patch_size", "embed_dim", "depth", "num_heads")}
        stem = {k: d[k] for k in _STEM_FIELDS if d.get(k) is not None}
        return cls(name=str(d.get("name", "vit_custom")), in_chans=int(d.get("in_chans", 3)),
                   mlp_ratio=float(d.get("mlp_ratio", 4.0)), **ints, **stem)

    def to_dict(self) -> dict[str, Any]:
        """``msn.json``'s ``architecture``: the stem fields (as lists) only when there is a stem."""
        d = asdict(self)
        for k in _STEM_FIELDS:
            if d[k] is None:
                del d[k]
            else:
                d[k] = list(d[k])
        return d

    def encoder_kwargs(self) -> dict[str, Any]:
        """Everything but the name: ``VisionTransformer(**kwargs)`` rebuilds the trunk."""
        return {k: v for k, v in self.to_dict().items() if k != "name"}

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


@dataclass(frozen=True)
class Int8Graph:
    """``msn.json``'s ``int8`` section: the quantized graph's file, its method, and the guard it passed.

    ``guard`` holds the export-time comparison with the fp32 graph on held-out images (cosine of the embeddings,
    low-shot accuracy); ``details`` keeps everything else as written (quantizer settings, calibration data, the
    speed of each candidate method).
    """

    file: str
    method: str
    guard: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file.endswith(".onnx") or self.file == ONNX_FILE \
                or Path(self.file).name != self.file:
            raise BundleError(f"int8.file must be a file name ending in .onnx other than {ONNX_FILE}, "
                              f"got {self.file!r}")
        if self.method not in INT8_METHODS:
            raise BundleError(f"int8.method must be one of {INT8_METHODS}, got {self.method!r}")
        if not isinstance(self.guard, dict) or self.guard.get("passed") is not True:
            raise BundleError("int8.guard does not record a passed accuracy guard; re-export with "
                              "msn-export --quantize int8")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Int8Graph:
        return cls(file=d["file"], method=d["method"], guard=dict(d["guard"]),
                   details={k: v for k, v in d.items() if k not in ("file", "method", "guard")})

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "method": self.method, "guard": self.guard, **self.details}


@dataclass(frozen=True)
class BundleInfo:
    """A bundle's ``msn.json``. ``onnx`` records the graph's I/O as exported; ``extra`` keeps the provenance fields
    (weights hash, source checkpoint, training summary, parity figures, export time) as written."""

    model_id: str
    architecture: Architecture
    preprocessing: Preprocessing
    feature: str = "cls_pre_norm"
    format_version: int = FORMAT_VERSION
    onnx: dict[str, Any] | None = None
    int8: Int8Graph | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise BundleError(f"model_id must be a non-empty string, got {self.model_id!r}")
        if self.format_version not in READABLE_FORMAT_VERSIONS:
            raise BundleError(f"format_version {self.format_version!r} is not one this version reads "
                              f"{READABLE_FORMAT_VERSIONS}; upgrade msn")
        arch, pre = self.architecture, self.preprocessing
        try:
            check_feature(self.feature, depth=arch.depth, grid=arch.grid)
        except FeatureError as e:
            raise BundleError(str(e)) from None
        if pre.crop != arch.image_size:
            raise BundleError(f"preprocessing.crop {pre.crop} differs from architecture.image_size {arch.image_size}")
        if pre.channels != arch.in_chans:
            raise BundleError(f"preprocessing.channels {pre.channels} differs from architecture.in_chans "
                              f"{arch.in_chans}")

    @property
    def embed_dim(self) -> int:
        """Width of the embedding the graph outputs (the bundle's feature); ``model_dim`` is the encoder's width."""
        a = self.architecture
        return feature_dim(self.feature, embed_dim=a.embed_dim, depth=a.depth, grid=a.grid)

    model_dim = property(lambda self: self.architecture.embed_dim)
    patch_size = property(lambda self: self.architecture.patch_size)
    image_size = property(lambda self: self.architecture.image_size)
    in_chans = property(lambda self: self.architecture.in_chans)
    grid = property(lambda self: self.architecture.grid)
    num_patches = property(lambda self: self.architecture.num_patches)

    @property
    def onnx_path(self) -> Path:
        """``model.onnx`` of the bundle directory this was read from."""
        if self.path is None:
            raise BundleError("this BundleInfo was not read from a bundle directory")
        return self.path / ONNX_FILE

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions this bundle can be served at."""
        return PRECISIONS if self.int8 is not None else ("fp32",)

    def graph_path(self, precision: str = "fp32") -> Path:
        """The graph for ``precision`` (``fp32`` or ``int8``); :class:`BundleError` if the bundle has none."""
        if precision not in PRECISIONS:
            raise BundleError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "fp32":
            return self.onnx_path
        if self.int8 is None:
            raise BundleError(f"bundle {self.model_id} has no int8 graph; add one with "
                              f"msn-export --bundle {self.path or 'DIR'} --quantize int8")
        path = self.onnx_path.parent / self.int8.file
        if not path.is_file():
            raise BundleError(f"{path}: missing (msn.json names it as the int8 graph)")
        return path

    def to_dict(self) -> dict[str, Any]:
        """The ``msn.json`` document."""
        int8 = {} if self.int8 is None else {"int8": self.int8.to_dict()}
        return {"format_version": self.format_version, "model_id": self.model_id,
                "architecture": self.architecture.to_dict(), "preprocessing": self.preprocessing.to_dict(),
                "feature": self.feature, "onnx": self.onnx, **int8, **self.extra}


_CORE_KEYS = ("format_version", "model_id", "architecture", "preprocessing", "feature", "onnx", "int8")


def parse_bundle_info(document: Any, *, where: str = META_FILE, path: Path | None = None) -> BundleInfo:
    """Validate an ``msn.json`` document; :class:`BundleError` names ``where`` and the problem."""
    if not isinstance(document, dict):
        raise BundleError(f"{where}: expected a JSON object, got {type(document).__name__}")
    try:
        if "format_version" not in document:
            raise BundleError("no format_version (is this an msn-export bundle?)")
        version = document["format_version"]
        if not isinstance(version, int) or isinstance(version, bool):
            raise BundleError(f"format_version must be an integer, got {version!r}")
        return BundleInfo(
            model_id=document["model_id"], architecture=Architecture.from_dict(document["architecture"]),
            preprocessing=Preprocessing.from_dict(document["preprocessing"]),
            feature=document.get("feature", "cls_pre_norm"), format_version=version, onnx=document.get("onnx"),
            int8=Int8Graph.from_dict(document["int8"]) if document.get("int8") is not None else None,
            extra={k: v for k, v in document.items() if k not in _CORE_KEYS}, path=path)
    except BundleError as e:
        raise BundleError(f"{where}: {e}") from None
    except KeyError as e:
        raise BundleError(f"{where}: missing field {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise BundleError(f"{where}: malformed field ({e})") from None


def load_bundle_info(bundle_dir: str | os.PathLike, *, need: Collection[str] = ()) -> BundleInfo:
    """Read and validate ``bundle_dir/msn.json``; ``need`` names files that must exist too (``ONNX_FILE``, ...)."""
    bundle_dir = Path(bundle_dir)
    with contextlib.suppress(OSError):  # a read-only reader reads what is there (the old bundle, or none)
        recover_dir(bundle_dir)  # an export killed between its two renames: finish it first
    meta = bundle_dir / META_FILE
    if not meta.is_file():
        why = "it does not exist" if not bundle_dir.exists() else f"no {META_FILE}"
        raise BundleError(f"{bundle_dir} is not an MSN bundle ({why}); msn-export writes one")
    for name in need:
        if not (bundle_dir / name).is_file():
            raise BundleError(f"{bundle_dir}: no {name} (is this a complete msn-export bundle?)")
    try:
        document = json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{meta}: not valid JSON: {e}") from None
    return parse_bundle_info(document, where=str(meta), path=bundle_dir)


def write_bundle_info(bundle_dir: str | os.PathLike, info: BundleInfo) -> None:
    """Write ``msn.json`` durably, after checking that it reads back as the same bundle."""
    document = info.to_dict()
    parse_bundle_info(json.loads(json.dumps(document)), where="the msn.json being written")
    atomic_write_json(Path(bundle_dir) / META_FILE, document, indent=2)


def check_graph_inputs(names: Collection[str], where: str = ONNX_FILE) -> None:
    """A bundle graph takes ``pixel_values`` and ``keep_idx`` (and ``keep_mask`` in format 1), nothing else."""
    missing = [n for n in GRAPH_INPUTS if n not in names]
    unknown = sorted(set(names) - set(GRAPH_INPUTS) - {LEGACY_MASK_INPUT})
    if missing or unknown:
        raise BundleError(f"{where}: graph inputs {sorted(names)} are not a bundle's: expected "
                          f"{list(GRAPH_INPUTS)} (format 1 also {LEGACY_MASK_INPUT!r})")


def onnx_feeds(input_names: Collection[str], pixel_values: np.ndarray,
               keep_idx: np.ndarray) -> dict[str, np.ndarray]:
    """ONNX Runtime feeds for a bundle graph; ``keep_idx`` (B, K) may hold ``-1`` padding.

    A format 1 graph (one with a ``keep_mask`` input) gets the padding as ``keep_mask = keep_idx >= 0`` and index 0
    in the padded slots, which is what it was exported with.
    """
    keep = np.ascontiguousarray(keep_idx, dtype=np.int64)
    feeds = {"pixel_values": np.ascontiguousarray(pixel_values, dtype=np.float32)}
    if LEGACY_MASK_INPUT in input_names:
        feeds[LEGACY_MASK_INPUT] = keep != PAD
        keep = np.where(keep == PAD, 0, keep)
    feeds["keep_idx"] = keep
    return feeds
