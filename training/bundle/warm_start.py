"""Warm start: a new pretraining run that begins from trained weights (``--init-from PATH``, ``run.init_from``).

What PATH may be (the kind is read from the path, never guessed from its name):

* ``official``: a facebookresearch/msn ``.pth.tar``, as released (``target_encoder``: trunk with fused ``attn.qkv``
  and the projection head ``fc.*``, with or without DDP's ``module.``; plus ``prototypes``) or a full training save
  (its online ``encoder`` too);
* ``training``: this project's ``checkpoint.pt``, or the run directory holding it;
* ``bundle``: an ``msn-export`` bundle (``msn.json`` + ``encoder.safetensors``): the trunk only;
* ``hf``: a transformers ``ViTMSNModel`` folder (``config.json`` + weights): the trunk only.

Both networks start from it: the target from the source's target encoder, the online network from the source's
online encoder where it has one (our checkpoints, official training saves), else from the target encoder too, as
the paper's networks start equal. The projection head and the prototypes come along where the source has them and
they fit this run's shapes; otherwise they start fresh, and the log says so. The optimiser state and the schedules
are not taken from the source: the run starts at step 0, with its own warm-up (``--resume`` continues a run
instead; an existing checkpoint wins over ``--init-from``).

A trunk that differs in width, depth, heads, MLP ratio or patch size is refused in one line naming the ``--set``
keys that build the source's trunk. A different image size is adapted: the position embeddings are resized
bicubically to the run's patch grid, as the forward pass resizes them for views of other sizes.

Files are read by msn-export's readers (:mod:`training.bundle.sources`, :mod:`training.bundle.convert`,
:func:`training.model.load.load_encoder`), so a checkpoint that exports also warm-starts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from msn_core.bundle import META_FILE, WEIGHTS_FILE, BundleError
from training.bundle.convert import official_head, official_to_ours, strip_prefix
from training.bundle.sources import _torch_load, encoder_from_hf
from training.data import IMAGENET_MEAN, IMAGENET_STD
from training.model.load import KeyMismatchError, describe_trunk, load_encoder, load_trunk, preview_keys
from training.model.msn import MSNOnline, ProjectedEncoder
from training.model.vit import ARCHS, VisionTransformer, encoder_kwargs
from training.run.state import target_encoder_weights

if TYPE_CHECKING:
    from training.run.build import Run

__all__ = ["WarmStartError", "WarmStartSource", "init_run", "model_settings", "read_source", "warm_start"]

log = logging.getLogger("msn.train")

StateDict = dict[str, Tensor]
# Trunk settings that must match for the weights to mean the same thing; the image size need not.
_ARCH_KEYS = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "in_chans", "conv_stem_channels",
              "conv_stem_strides")
_HEADS_BY_WIDTH = {dims[0]: dims[2] for dims in ARCHS.values()}  # the official deit_* factories


class WarmStartError(ValueError):
    """A warm-start source that cannot be read, or whose trunk this run's model cannot hold (one line)."""


@dataclass
class WarmStartSource:
    """Trained weights read from PATH, in our key names, with what they say about their architecture."""

    kind: str  # official | training | bundle | hf
    path: Path
    target_trunk: StateDict
    online_trunk: StateDict
    target_head: StateDict | None  # ProjectionHead state (fc1, bn1, ...), None when the source has no head
    online_head: StateDict | None
    prototypes: Tensor | None
    architecture: dict  # VisionTransformer kwargs the source states or implies (a subset of _ARCH_KEYS)
    normalisation: tuple[list[float], list[float]] | None = None  # (mean, std) of its inputs, where recorded


# --- reading ----------------------------------------------------------------------------------------------


def read_source(path: str | Path) -> WarmStartSource:
    """Read PATH (official ``.pth.tar``, our checkpoint or run directory, bundle, HF folder) into a source."""
    path = Path(path)
    try:
        if path.is_dir():
            if (path / META_FILE).is_file():
                return _read_bundle(path)
            if (path / "config.json").is_file():
                return _read_hf(path)
            if (path / "checkpoint.pt").is_file():  # a run directory
                return _read_file(path / "checkpoint.pt")
            raise WarmStartError(f"{path}: a directory, but not a bundle ({META_FILE}), an HF ViTMSN folder "
                                 "(config.json) or a run directory (checkpoint.pt)")
        if path.name == WEIGHTS_FILE and (path.parent / META_FILE).is_file():
            return _read_bundle(path.parent)
        if not path.is_file():
            raise WarmStartError(f"{path} does not exist")
        return _read_file(path)
    except WarmStartError:
        raise
    except (BundleError, KeyError, OSError, TypeError, ValueError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise WarmStartError(f"{path}: {message}") from None


def _read_file(path: Path) -> WarmStartSource:
    checkpoint = _torch_load(path)
    if "encoder_kwargs" in checkpoint:  # ours: written by training/pretrain.py
        return _read_training(path, checkpoint)
    if "target_encoder" in checkpoint or "encoder" in checkpoint:
        return _read_official(path, checkpoint)
    raise WarmStartError(f"{path}: neither an MSN checkpoint of ours (encoder_kwargs, target_encoder) nor an "
                         f"official one (target_encoder, prototypes); it has {preview_keys(checkpoint)}")


def _clean(state: Mapping[str, Tensor]) -> StateDict:
    return strip_prefix(strip_prefix(state, "module."), "_orig_mod.")


def _read_training(path: Path, checkpoint: dict) -> WarmStartSource:
    trunk, kwargs = target_encoder_weights(checkpoint)
    target_trunk = _clean(trunk)
    target_head = _clean(checkpoint["target_head"]) if "target_head" in checkpoint else None
    return WarmStartSource(
        kind="training", path=path, target_trunk=target_trunk,
        online_trunk=_clean(checkpoint["encoder"]) if "encoder" in checkpoint else target_trunk,
        target_head=target_head, online_head=_clean(checkpoint["head"]) if "head" in checkpoint else target_head,
        prototypes=checkpoint.get("prototypes"), architecture={k: v for k, v in kwargs.items() if k in _ARCH_KEYS},
        normalisation=_mean_std(checkpoint.get("preprocessing")),
    )


def _read_official(path: Path, checkpoint: dict) -> WarmStartSource:
    key = "target_encoder" if "target_encoder" in checkpoint else "encoder"
    target_trunk = official_to_ours(checkpoint[key])
    target_head = official_head(checkpoint[key]) or None
    online_trunk, online_head = target_trunk, target_head
    if key == "target_encoder" and "encoder" in checkpoint:  # a full training save, not the released weights
        online_trunk = official_to_ours(checkpoint["encoder"])
        online_head = official_head(checkpoint["encoder"]) or None
    shape = describe_trunk(target_trunk)
    architecture = {k: v for k, v in shape.items() if k in _ARCH_KEYS}
    if shape["embed_dim"] in _HEADS_BY_WIDTH:  # the weights do not store it; the official factories fix it
        architecture["num_heads"] = _HEADS_BY_WIDTH[shape["embed_dim"]]
    prototypes = checkpoint.get("prototypes")
    return WarmStartSource("official", path, target_trunk, online_trunk, target_head, online_head,
                           prototypes.detach() if prototypes is not None else None, architecture,
                           (list(IMAGENET_MEAN), list(IMAGENET_STD)))  # the official code trains on ImageNet


def _mean_std(preprocessing: Mapping | None) -> tuple[list[float], list[float]] | None:
    if not preprocessing or "mean" not in preprocessing or "std" not in preprocessing:
        return None
    return list(preprocessing["mean"]), list(preprocessing["std"])


def _trunk_only(kind: str, path: Path, encoder: VisionTransformer, preprocessing: Mapping) -> WarmStartSource:
    trunk = {key: value.detach() for key, value in encoder.state_dict().items()}
    kwargs = encoder_kwargs(encoder)
    return WarmStartSource(kind, path, trunk, trunk, None, None, None,
                           {k: v for k, v in kwargs.items() if k in _ARCH_KEYS}, _mean_std(preprocessing))


def _read_bundle(directory: Path) -> WarmStartSource:
    encoder, info = load_encoder(directory)
    return _trunk_only("bundle", directory, encoder, info.preprocessing.to_dict())


def _read_hf(directory: Path) -> WarmStartSource:
    encoder, info = encoder_from_hf(directory)
    return _trunk_only("hf", directory, encoder, info["preprocessing"])


def model_settings(source: WarmStartSource) -> dict[str, object]:
    """The ``model.*`` config values under which this run's networks take all of ``source`` (trunk, head and
    prototypes): for a plan that must fit a warm start, and for the ``--set`` hints of the errors below."""
    arch = source.architecture
    settings: dict[str, object] = {f"model.{k}": arch[k] for k in ("embed_dim", "depth", "num_heads") if k in arch}
    if "conv_stem_strides" in arch:
        settings.update({f"model.{k}": list(arch[k]) for k in ("conv_stem_channels", "conv_stem_strides")})
    elif "patch_size" in arch:
        settings["model.patch_size"] = arch["patch_size"]
    head = source.target_head
    if head is not None and "fc1.weight" in head and "fc3.weight" in head:
        settings.update({"model.head_hidden_dim": int(head["fc1.weight"].shape[0]),
                         "model.head_out_dim": int(head["fc3.weight"].shape[0]),
                         "model.head_use_bn": "bn1.weight" in head})
        if source.prototypes is not None:
            settings["model.num_prototypes"] = int(source.prototypes.shape[0])
    return settings


# --- loading into the networks ----------------------------------------------------------------------------


Note = tuple[int, str]  # (logging level, one line for the run's log)


def _info(line: str) -> Note:
    return logging.INFO, line


def _warning(line: str) -> Note:
    return logging.WARNING, line


def warm_start(online: MSNOnline, target: ProjectedEncoder, source: WarmStartSource) -> list[Note]:
    """Load ``source`` into both networks in place; returns (log level, line) pairs saying what was loaded,
    adapted or left fresh. Raises :class:`WarmStartError` when the trunks do not match."""
    encoder = target.encoder
    _check_architecture(source, encoder)
    grid = describe_trunk(source.target_trunk)["grid"]
    notes = [_info(f"warm start from {source.kind} weights {source.path}: trunk -> online and target encoders; "
                   "fresh optimiser state and schedules (step 0)")]
    if grid != encoder.grid_size:
        notes.append(_info(f"position embeddings resized from {grid}x{grid} to {encoder.grid_size}x"
                           f"{encoder.grid_size} patches (bicubic, as for views of other sizes)"))
    try:
        load_trunk(encoder, source.target_trunk, f"{source.path} target encoder")
        load_trunk(online.net.encoder, source.online_trunk, f"{source.path} online encoder")
    except KeyMismatchError as err:
        raise WarmStartError(str(err)) from None
    return notes + _load_head_and_prototypes(online, target, source)


def _describe(arch: Mapping) -> str:
    parts = [f"{key} {arch[key]}" for key in _ARCH_KEYS if key in arch and arch[key] is not None]
    return ", ".join(parts)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return a is not None and b is not None and list(a) == list(b)
    return a == b


def _check_architecture(source: WarmStartSource, encoder: VisionTransformer) -> None:
    ours = encoder_kwargs(encoder)
    theirs = source.architecture
    differ = [key for key in _ARCH_KEYS if key in theirs and not _same(theirs[key], ours.get(key))]
    if not differ:
        return
    trunk_keys = tuple(f"model.{key}" for key in _ARCH_KEYS)
    settings = " ".join(f"--set {key}={_yaml(value)}" for key, value in model_settings(source).items()
                        if key in trunk_keys)
    named = next((name for name, dims in ARCHS.items()
                  if dims == (theirs.get("embed_dim"), theirs.get("depth"), theirs.get("num_heads"))), None)
    hint = f" (a {named})" if named and _same(theirs.get("mlp_ratio", 4.0), 4.0) else ""
    raise WarmStartError(
        f"{source.path}: its trunk{hint} has {_describe({k: theirs[k] for k in differ})}, this run's model "
        f"{_describe({k: ours.get(k) for k in differ})}; to warm-start from it: {settings}")


def _yaml(value: object) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


def _head_shape(head: Mapping[str, Tensor]) -> str:
    hidden, in_dim = head["fc1.weight"].shape if "fc1.weight" in head else ("?", "?")
    out_dim = head["fc3.weight"].shape[0] if "fc3.weight" in head else "?"
    norm = " with BatchNorm" if "bn1.weight" in head else " without BatchNorm"
    return f"{in_dim}-{hidden}-{hidden}-{out_dim}{norm}"


def _head_settings(source: WarmStartSource) -> str:
    settings = {k: v for k, v in model_settings(source).items() if k.startswith("model.head_")}
    if not settings:
        return ""
    return "; " + " ".join(f"--set {key}={str(value).lower()}" for key, value in settings.items()) + " keeps it"


def _fits(module: torch.nn.Module, state: Mapping[str, Tensor]) -> bool:
    expected = module.state_dict()
    return set(expected) == set(state) and all(expected[k].shape == state[k].shape for k in expected)


def _load_head_and_prototypes(online: MSNOnline, target: ProjectedEncoder,
                              source: WarmStartSource) -> list[Note]:
    if source.target_head is None:
        return [_warning(f"projection head and prototypes start fresh: {source.kind} weights hold the trunk only")]
    online_head = source.online_head or source.target_head
    if not (_fits(target.head, source.target_head) and _fits(online.net.head, online_head)):
        return [_warning(f"projection head and prototypes start fresh: the source's head is "
                         f"{_head_shape(source.target_head)}, this run's {_head_shape(target.head.state_dict())}"
                         f"{_head_settings(source)}")]
    with torch.no_grad():
        target.head.load_state_dict(source.target_head)
        online.net.head.load_state_dict(online_head)
    notes = [_info("projection head -> online and target")]
    prototypes = source.prototypes
    if prototypes is None:
        notes.append(_warning("prototypes start fresh: the source has none"))
    elif tuple(prototypes.shape) != tuple(online.prototypes.shape):
        notes.append(_warning(f"prototypes start fresh: the source has {prototypes.shape[0]} of dimension "
                              f"{prototypes.shape[-1]}, this run {online.prototypes.shape[0]} "
                              f"(--set model.num_prototypes={prototypes.shape[0]} keeps them)"))
    else:
        with torch.no_grad():
            online.prototypes.copy_(prototypes)
        notes.append(_info(f"{prototypes.shape[0]} prototypes -> online"))
    return notes


# --- the run's hook ---------------------------------------------------------------------------------------


def init_run(run: Run, source: str | None, *, resumed: bool) -> None:
    """``pretrain.py``'s warm start, after the networks are built: nothing without a source; when the run
    resumed its own checkpoint, that checkpoint wins (it was warm-started from the source already)."""
    if not source:
        return
    if resumed:
        log.info("--init-from %s not applied: the run resumed its own checkpoint", source)
        return
    try:
        loaded = read_source(source)
        notes = warm_start(run.online, run.target, loaded)
    except WarmStartError as err:
        raise SystemExit(f"pretrain: --init-from {err}") from None
    notes += _normalisation_note(loaded, run.mean, run.std)
    if run.info.rank == 0:
        for level, line in notes:
            log.log(level, line)


def _normalisation_note(source: WarmStartSource, mean: list[float], std: list[float]) -> list[Note]:
    """A warning when the source was trained on inputs normalised otherwise than this run normalises them."""
    if source.normalisation is None:
        return []
    stored_mean, stored_std = source.normalisation
    if len(stored_mean) == len(mean) and all(math.isclose(a, b, abs_tol=1e-4) for a, b in
                                             zip([*stored_mean, *stored_std], [*mean, *std], strict=True)):
        return []
    return [_warning(f"the source saw inputs normalised with mean {_rounded(stored_mean)}, std "
                     f"{_rounded(stored_std)}; this run uses mean {_rounded(mean)}, std {_rounded(std)} "
                     "(data.mean / data.std set them)")]


def _rounded(values: list[float]) -> list[float]:
    return [round(float(v), 4) for v in values]
