"""One config tree for pretraining: dataclasses, filled from YAML, overridden with ``--set key=value``.

Every key has a typed default here, so a YAML file only states what differs from the paper's ViT-S/16 recipe.
Unknown keys and values of the wrong type are errors that name the key: a typo never silently falls back to a
default (the official code reads ~40 keys with ad-hoc defaults and ignores the rest).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from msn_core.durable import atomic_write
from msn_core.features import FeatureError, parse_feature
from msn_core.sources import FILE_SOURCES, SOURCES


class FrozenConfigError(AttributeError):
    """A write into a config that was frozen (``freeze``): the run decided it before its loop, and changes it during
    the run only by replacing it (``with_keys``), through its one event mechanism (``training/run/events.py``)."""


class _Section:
    """A config section (or the whole tree) that refuses writes once ``freeze`` marked it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise FrozenConfigError(f"cannot set {type(self).__name__}.{name}: the run's config is frozen once "
                                    "decided; a change during the run replaces it (training/run/events.py)")
        object.__setattr__(self, name, value)



@dataclass
class ModelConfig(_Section):
    arch: str = "vit_small"  # vit_tiny | vit_small | vit_base | vit_large | vit_huge | deit_small_convstem | vitc_4gf
    patch_size: int = 16
    image_size: int = 224  # size of the target and (masked) anchor views
    patches_per_side: int | None = None  # when set, patch_size = image_size / this: one recipe for any image size
    embed_dim: int | None = None  # overrides of the arch table, for small custom models
    depth: int | None = None
    num_heads: int | None = None
    drop_path_rate: float = 0.0
    # Conv stem (official *_convstem / ViTC, docs/training.md "Conv-stem ViTs") instead of the p x p patch projection.
    # true alone: log2(patch_size) stride-2 3x3 convs (BN + ReLU) widening to embed_dim, then a 1x1 projection.
    # The lists (one width and one stride per conv, last width = embed_dim) imply conv_stem and set patch_size to
    # the product of the strides, e.g. channels [96, 192, 192], strides [2, 2, 1]: patch 4 on 28 px images.
    conv_stem: bool = False
    conv_stem_channels: list[int] | None = None
    conv_stem_strides: list[int] | None = None
    head_hidden_dim: int = 2048
    head_out_dim: int = 256
    head_use_bn: bool = True
    num_prototypes: int = 1024
    # the frozen feature msn-export puts in the bundle (msn_core.features;
    # benchmarks/evaluation/feature_choice.py picks it)
    feature: str = "cls_pre_norm"


@dataclass
class DataConfig(_Section):
    # auto | folder | image_folder | file_list | fashion-mnist | synthetic (msn_core/sources.py). auto: a file is a
    # file list; a folder is an image folder when every image sits in root/<class>/, else an unlabelled folder
    source: str = "auto"
    root: str | None = None  # the folder of images, or the file list
    image_root: str | None = None  # where a file list's relative paths point; None: the list's own folder
    subset_file: str | None = None  # restrict the source to these relative paths or file names (ImageNet subsets)
    # workers decode + resize to load_size; random crops are taken on the device. None: image_size
    load_size: int | None = 256
    batch_size: int = 64  # per process (the official `criterion.batch_size`)
    num_workers: int = 8
    pin_memory: bool = True
    synthetic_size: int = 512
    mean: list[float] | None = None  # None: the dataset's statistics (ImageNet for folders)
    std: list[float] | None = None
    eval_resize: int | None = None  # evaluation/export preprocessing; None: eval_crop * eval_resize_ratio
    eval_resize_ratio: float = 256 / 224  # the ImageNet convention; 1.0 for small images that are not cropped
    eval_crop: int | None = None  # None: image_size


@dataclass
class MaskConfig(_Section):
    """The geometry of MSN's views: the patch-dropped anchor and the small focal crops ("focal masks")."""

    ratio: float = 0.15  # fraction of the anchor view's patches dropped (official `patch_drop`)
    shared: bool = True  # one permutation for the whole batch (official) or one per sample
    num_focal: int = 10
    focal_size: int = 96
    rand_crop_scale: list[float] = field(default_factory=lambda: [0.3, 1.0])
    focal_crop_scale: list[float] = field(default_factory=lambda: [0.05, 0.3])
    share_target_view: bool = False  # ablation: the anchor is a masked copy of the target view itself


@dataclass
class AugmentConfig(_Section):
    """Photometric augmentation and flips, applied to every view; defaults are the official (SimCLR) recipe."""

    color_jitter_strength: float = 0.5  # s: brightness, contrast, saturation 0.8 s, hue 0.2 s
    color_jitter_p: float = 0.8
    grayscale_p: float = 0.2
    blur_p: float = 0.5
    blur_sigma: list[float] = field(default_factory=lambda: [0.1, 2.0])  # pixels of the view
    flip_p: float = 0.5
    solarize_p: float = 0.0  # not in the official MSN; BYOL applies it to one view
    levels_p: float = 0.0  # not in the official MSN: each view's darkest and lightest grey redrawn (see views.py)
    # not in the official MSN: shape jitter per view, for folders whose classes vary in pose and stroke (glyphs)
    affine_p: float = 0.0
    affine_degrees: float = 15.0  # rotation in [-d, d]
    affine_shear: float = 15.0  # horizontal shear in [-s, s] degrees
    stroke_p: float = 0.0  # strokes thickened or thinned (a partial 3 x 3 grey dilation or erosion), half each


@dataclass
class LossConfig(_Section):
    temperature: float = 0.1
    sharpen_start: float = 0.25
    sharpen_end: float = 0.25
    me_max_weight: float = 1.0
    entropy_weight: float = 0.0
    use_sinkhorn: bool = True
    sinkhorn_iterations: int = 3
    label_smoothing: float = 0.0


@dataclass
class OptimConfig(_Section):
    epochs: int = 800
    warmup_epochs: float = 15  # with total_steps or budget_minutes: the same fraction (warmup / epochs) of the run
    total_steps: int | None = None  # schedule length in optimiser steps, instead of epochs
    budget_minutes: float | None = None  # schedule length from a wall-clock budget: see training/run/budget.py
    start_lr: float = 2e-4
    lr: float = 1e-3
    final_lr: float = 1e-6
    weight_decay: float = 0.04
    final_weight_decay: float = 0.4
    ema_start: float = 0.996
    ema_end: float = 1.0
    # a warm start (run.init_from) scales the start and peak lr by warm_lr_scale and starts the EMA at no less than
    # warm_ema_start (gentler steps on a converged model; docs/training.md, "Warm start", has what 0.5 / 0.996 gave)
    warm_lr_scale: float = 1.0
    warm_ema_start: float = 0.0
    horizon_scale: float = 1.25  # schedules span 1.25x the run, as the official code
    clip_grad: float = 3.0  # on the encoder and head; prototypes are not clipped (official)
    fused: bool | None = None  # fused AdamW (numerically the same update); None: on


@dataclass
class RunConfig(_Section):
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # auto | fp32 | bf16. auto: bf16 on GPUs that support it, fp32 on CPUs without bf16 units; on CPUs with them
    # (AMX, AVX512-BF16) the faster of the two, timed on the run's first steps (training/run/precision_timing.py)
    precision: str = "auto"
    # auto | explicit | sdpa: attention in bf16 on a CPU (training/model/vit.py). auto: timed against each other
    # with the precision on the run's first steps (training/run/speed_timing.py), else explicit (fp32 logits)
    cpu_attention: str = "auto"
    # torch's intra-op threads on a CPU (0: auto, torch's default for the process, timed against one fewer when data
    # loader workers share the cores)
    cpu_threads: int = 0
    compile: bool = False  # torch.compile the online network; the user's choice, never timed (speed_timing.py)
    max_steps: int | None = None  # stop after this many optimiser steps (smoke tests, benchmarks)
    checkpoint_every_steps: int = 500
    keep_epoch_checkpoints: int = 0  # also keep checkpoint-epNNN.pt every N epochs (0: only the latest)
    log_every_steps: int = 10
    tensorboard: bool = False
    progress_bar: bool = True
    # watching (training/run/probe.py, collapse.py): a kNN-20 probe of the target encoder's served feature every
    # N steps and at the end, when labels exist (0: off); eval_data: labelled images for it (a labelled folder or
    # file list, or fashion-mnist; default: the training images if labelled). A confirmed collapse is always
    # reported; stop_on_collapse ends the run there (checkpoint kept, exit status 1).
    probe_every_steps: int = 500
    probe_images: int = 3000
    eval_data: str | None = None
    stop_on_collapse: bool = False
    # the view probe (training/run/view_probe.py): a label-free signal of learning on this many training images,
    # about every 1 % of the run; the stall detector reads it (0: off, the loss alone decides)
    view_probe_images: int = 128
    # a confirmed stall (training/run/stall.py) is always reported; adapt: the run switches itself once to the advice
    # it names, from that step (training/run/adapt.py; --on-stall adapt)
    on_stall: str = "warn"
    # warm start: trained weights to begin from (official .pth.tar, checkpoint.pt, bundle, HF ViTMSN folder;
    # training/bundle/warm_start.py); fresh optimiser and schedules. --resume of an existing checkpoint wins.
    init_from: str | None = None


@dataclass
class Config(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a value of the wrong type."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides (values parsed as YAML scalars/lists)."""
    return config_from_dict(read_raw_config(path, overrides))


def read_raw_config(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """The YAML file's mapping with ``key=value`` overrides merged in; typed later by ``build_dataclass``."""
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw.pop("plan", None)  # a planned run's config.yaml says why each value was chosen: a record, not a setting
    apply_overrides(raw, overrides or [])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Merge ``key=value`` items into ``raw``, in order (a later one wins); values are parsed as YAML.

    Each item is one ``key=value``: ``--set a=1 b=2`` and ``--set a=1 --set b=2`` both arrive here as two items.
    """
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.problem})") from None
        set_key(raw, key.strip(), parsed)


def set_key(raw: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set ``raw[a][b] = value`` for ``dotted_key`` ``"a.b"`` (a value already typed, not a YAML string)."""
    _set_nested(raw, dotted_key.split("."), value)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (e.g. the copy stored in a checkpoint)."""
    raw = _migrate(raw)
    cfg = build_dataclass(Config, raw)
    model = raw.get("model")
    _derive(cfg, explicit_patch_size=isinstance(model, dict) and model.get("patch_size") is not None)
    validate(cfg)
    return cfg


def freeze(cfg: Config) -> Config:
    """Mark ``cfg`` and its sections read-only and return it: the run's resolved config, which its parts hold by
    reference, cannot be changed behind their backs (a frozen config's lists are the values it was decided with)."""
    for section in (cfg, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg))):
        object.__setattr__(section, "_frozen", True)
    return cfg


def with_keys(cfg: Config, sets: dict[str, Any]) -> Config:
    """A new config: ``cfg`` with the dotted keys of ``sets`` replaced, checked the way ``--set`` is (a whole config
    is built from the result, so a bad value is refused and ``cfg`` is left as it was). Not frozen."""
    raw = cfg.to_dict()
    for key, value in sets.items():
        section, _, name = key.partition(".")
        if not isinstance(raw.get(section), dict) or name not in raw[section]:
            raise ConfigError(f"unknown config key {key!r}")
        raw[section][name] = value
    return config_from_dict(raw)


def _derive(cfg: Config, *, explicit_patch_size: bool = False) -> None:
    """Fill the keys that a config may state relative to the image size (so a recipe moves between sizes), and
    the patch size of an explicit conv stem (the product of its strides)."""
    m = cfg.model
    if m.patches_per_side is not None:
        if m.patches_per_side < 1 or m.image_size % m.patches_per_side:
            raise ConfigError(f"model.image_size={m.image_size} is not a multiple of "
                              f"model.patches_per_side={m.patches_per_side}")
        m.patch_size = m.image_size // m.patches_per_side
    if m.conv_stem_channels is not None or m.conv_stem_strides is not None:
        m.conv_stem = True
    if m.conv_stem_strides is not None:
        if not m.conv_stem_strides or min(m.conv_stem_strides) < 1:
            raise ConfigError(f"model.conv_stem_strides={m.conv_stem_strides} must be positive integers")
        product = 1
        for stride in m.conv_stem_strides:
            product *= stride
        if (m.patches_per_side is not None or explicit_patch_size) and m.patch_size != product:
            raise ConfigError(f"model.conv_stem_strides={m.conv_stem_strides} give patch size {product}, but "
                              f"model.patch_size is {m.patch_size}: drop one of them")
        m.patch_size = product
    elif m.conv_stem and (m.patch_size < 2 or m.patch_size & (m.patch_size - 1)):
        raise ConfigError(f"model.conv_stem=true with model.patch_size={m.patch_size}: the default stem needs a "
                          "power of two >= 2; give model.conv_stem_strides (and _channels) instead")
    if cfg.data.load_size is None:
        cfg.data.load_size = m.image_size


# Keys that moved; files and checkpoints written before the move still load.
_MOVED_KEYS = {("mask", "color_jitter_strength"): ("augment", "color_jitter_strength")}


def _migrate(raw: dict[str, Any]) -> dict[str, Any]:
    raw = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    for (old_section, old_key), (new_section, new_key) in _MOVED_KEYS.items():
        section = raw.get(old_section)
        if isinstance(section, dict) and old_key in section:
            value = section.pop(old_key)
            target = raw.setdefault(new_section, {})
            if isinstance(target, dict):
                target.setdefault(new_key, value)
    return raw


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    m, mask, data = cfg.model, cfg.mask, cfg.data
    if m.image_size % m.patch_size:
        raise ConfigError(f"model.image_size={m.image_size} is not a multiple of model.patch_size={m.patch_size}")
    if mask.num_focal and mask.focal_size % m.patch_size:
        raise ConfigError(f"mask.focal_size={mask.focal_size} is not a multiple of model.patch_size={m.patch_size}")
    if not 0.0 <= mask.ratio < 1.0:
        raise ConfigError(f"mask.ratio={mask.ratio} must be in [0, 1)")
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source!r}: expected {', '.join(SOURCES)}")
    if data.source in FILE_SOURCES and not data.root:
        raise ConfigError(f"data.root is required when data.source={data.source} (a folder of images or a file "
                          "list; on the command line: --data DIR)")
    try:
        parse_feature(m.feature)
    except FeatureError as err:
        raise ConfigError(f"model.feature: {err}") from None
    if cfg.run.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"run.precision={cfg.run.precision!r}: expected auto, fp32 or bf16")
    if cfg.run.view_probe_images < 0:
        raise ConfigError(f"run.view_probe_images={cfg.run.view_probe_images} must be >= 0 (0 turns it off)")
    if cfg.run.on_stall not in ("warn", "adapt"):
        raise ConfigError(f"run.on_stall={cfg.run.on_stall!r}: expected warn or adapt")
    if cfg.run.cpu_attention not in ("auto", "explicit", "sdpa"):
        raise ConfigError(f"run.cpu_attention={cfg.run.cpu_attention!r}: expected auto, explicit or sdpa")
    if cfg.run.cpu_threads < 0:
        raise ConfigError(f"run.cpu_threads={cfg.run.cpu_threads} must be >= 0 (0: auto)")
    if cfg.run.probe_every_steps < 0 or cfg.run.probe_images < 0:
        raise ConfigError(f"run.probe_every_steps={cfg.run.probe_every_steps} and run.probe_images="
                          f"{cfg.run.probe_images} must be >= 0 (0 turns the kNN probe off)")
    if cfg.run.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"run.device={cfg.run.device!r}: expected auto, cpu or cuda")
    for name in ("rand_crop_scale", "focal_crop_scale"):
        lo_hi = getattr(mask, name)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] <= 1:
            raise ConfigError(f"mask.{name}={lo_hi} must be [low, high] with 0 < low <= high <= 1")
    aug = cfg.augment
    for name in ("color_jitter_p", "grayscale_p", "blur_p", "flip_p", "solarize_p", "levels_p",
                 "affine_p", "stroke_p"):
        if not 0.0 <= getattr(aug, name) <= 1.0:
            raise ConfigError(f"augment.{name}={getattr(aug, name)} must be a probability in [0, 1]")
    if len(aug.blur_sigma) != 2 or not 0 < aug.blur_sigma[0] <= aug.blur_sigma[1]:
        raise ConfigError(f"augment.blur_sigma={aug.blur_sigma} must be [low, high] with 0 < low <= high")
    optim = cfg.optim
    if optim.total_steps is not None and optim.budget_minutes is not None:
        raise ConfigError("set optim.total_steps or optim.budget_minutes, not both")
    if optim.total_steps is not None and optim.total_steps < 1:
        raise ConfigError(f"optim.total_steps={optim.total_steps} must be at least 1")
    if optim.budget_minutes is not None and not optim.budget_minutes > 0:
        raise ConfigError(f"optim.budget_minutes={optim.budget_minutes} must be positive")
    if optim.warmup_epochs < 0 or optim.epochs < 1:
        raise ConfigError(f"optim.epochs={optim.epochs} must be >= 1 and optim.warmup_epochs >= 0")
    if not 0 < optim.warm_lr_scale <= 1 or not 0 <= optim.warm_ema_start < 1:
        raise ConfigError(f"optim.warm_lr_scale={optim.warm_lr_scale} must be in (0, 1] and optim.warm_ema_start="
                          f"{optim.warm_ema_start} in [0, 1)")
    if data.batch_size < 2:
        raise ConfigError("data.batch_size must be at least 2 (batch norm in the projection head)")


def _set_nested(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {k} is not a section")
    node[keys[-1]] = value


def build_dataclass(cls: type, raw: Any, prefix: str = "") -> Any:
    """Instantiate the (nested) dataclass ``cls`` from plain data, naming any unknown key or mistyped value."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s} (valid keys: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {hint}")
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: expected a string")
    raise ConfigError(f"{key}: unsupported type {hint}")


def dump_config(cfg: Config, path: str | Path, plan: dict[str, Any] | None = None) -> None:
    """Write the resolved config; ``plan`` (training/run/plan.py) adds a ``plan`` section that loading ignores."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if plan is not None:
        text += yaml.safe_dump({"plan": plan}, sort_keys=False, width=120)
    atomic_write(path, text.encode())  # rewritten when a run adapts: never half a file
