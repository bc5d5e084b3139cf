"""The surface of ``training`` that other packages may use; everything else in ``training`` is internal.

``visualizer/`` imports training only from here, so the modules behind these names can move without breaking it.
What is here, by what it is for:

- configs: ``read_raw_config`` and ``build_dataclass`` parse YAML + ``--set key=value`` overrides into typed
  dataclasses with pretraining's rules; ``ConfigError`` is what they raise for a bad key or value.
- data: ``build_dataset`` / ``build_loader`` (resumable distributed sampler), ``FashionMNIST`` (the real offline
  dataset), ``ImageListDataset`` (the images of a ``msn_core.sources`` listing, decoded with Pillow),
  ``eval_transform`` (a bundle's evaluation preprocessing on uint8 tensors).
- encoders: ``load_encoder`` reads an exported bundle's torch encoder; ``as_keep_tensor`` / ``encoder_keep_args``
  turn kept-patch indices (``-1`` = padding) into what the encoder takes; ``ema_update`` keeps an EMA copy.
- processes: ``init_distributed`` / ``barrier`` / ``cleanup`` and ``DistInfo`` (one process per device, torchrun).
- resumable runs: ``Progress``, ``batches_from``, ``save_progress`` / ``restore_progress`` resume bit-exactly
  mid-epoch; ``load_checkpoint`` reads a checkpoint written by ``save_progress``.
"""

from __future__ import annotations

from training.checkpoint import load_checkpoint
from training.config import ConfigError, build_dataclass, read_raw_config
from training.data import FashionMNIST, ImageListDataset, build_dataset, build_loader
from training.distributed import DistInfo, barrier, cleanup, init_distributed
from training.masking import as_keep_tensor, encoder_keep_args
from training.model.load import load_encoder
from training.model.msn import ema_update
from training.model.readout import feature_spec, read_feature, read_features
from training.run.precision import autocast_factory, resolve_precision
from training.run.state import Progress, batches_from, restore_progress, save_progress
from training.views import eval_transform

__all__ = [
    "ConfigError",
    "DistInfo",
    "FashionMNIST",
    "ImageListDataset",
    "Progress",
    "as_keep_tensor",
    "autocast_factory",
    "barrier",
    "batches_from",
    "build_dataclass",
    "build_dataset",
    "build_loader",
    "cleanup",
    "ema_update",
    "encoder_keep_args",
    "eval_transform",
    "feature_spec",
    "init_distributed",
    "load_checkpoint",
    "load_encoder",
    "read_feature",
    "read_features",
    "read_raw_config",
    "resolve_precision",
    "restore_progress",
    "save_progress",
]
