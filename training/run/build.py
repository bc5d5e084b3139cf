"""Everything a pretraining run is made of, built from the config: data, views, masks, networks, loss, optimiser.

``training/pretrain.py`` builds a ``Run`` here from the planned (or recipe's) config, decides the rest of its settings
and its length (``training/run/decide.py``; the run's ``cfg`` is then the frozen resolved config) and then only loops
over ``training/run/step.py``'s ``train_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from training import distributed as dist
from training.config import Config
from training.data import ResumableDistributedSampler, build_dataset, build_loader, normalization_stats
from training.model.losses import MSNLoss
from training.model.msn import MSNOnline, ProjectedEncoder, build_networks, parameter_groups
from training.model.vit import use_cpu_attention
from training.run.precision import autocast_factory, resolve_precision
from training.views import MultiViewAugment

__all__ = ["Run", "build_run", "preprocessing"]


@dataclass
class Run:
    """The built parts of one pretraining process. ``model`` is ``online`` wrapped for DDP / compilation."""

    cfg: Config
    info: dist.DistInfo
    loader: DataLoader
    sampler: ResumableDistributedSampler
    steps_per_epoch: int  # fixed at build time: len(loader) shrinks once the sampler skips to a resume position
    num_images: int
    augment: MultiViewAugment
    online: MSNOnline
    target: ProjectedEncoder
    model: nn.Module
    criterion: MSNLoss
    optimizer: torch.optim.Optimizer
    mask_generator: torch.Generator
    precision: str  # "fp32" or "bf16": the flag rule's (training.run.precision) until the decision stage's
    autocast: Callable[[], AbstractContextManager]
    mean: list[float]
    std: list[float]

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.info.world_size

    def use_precision(self, precision: str) -> None:
        """Run the following steps in ``precision``: ``auto``'s timing tries each candidate, then keeps one."""
        self.precision, self.autocast = precision, autocast_factory(precision, self.device)


def build_run(cfg: Config, info: dist.DistInfo) -> Run:
    device = info.device
    # Augmentations differ per rank; mask permutations are shared by all ranks, as in the official code.
    torch.manual_seed(cfg.run.seed + info.rank)
    mask_generator = torch.Generator().manual_seed(cfg.run.seed)

    # data: workers decode and resize; all random augmentation is batched on the device
    dataset = build_dataset(
        cfg.data.source, root=cfg.data.root, split="train", load_size=cfg.data.load_size,
        subset=cfg.data.subset_file, synthetic_size=cfg.data.synthetic_size, seed=cfg.run.seed,
        image_root=cfg.data.image_root,
    )
    loader, sampler = build_loader(
        dataset, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers, rank=info.rank,
        world_size=info.world_size, seed=cfg.run.seed, pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    if len(loader) == 0:
        raise SystemExit(f"pretrain: {len(dataset)} images are fewer than one global batch")
    default_mean, default_std = normalization_stats(cfg.data.source)
    mean, std = list(cfg.data.mean or default_mean), list(cfg.data.std or default_std)
    augment = build_augment(cfg, mean, std, device)

    online, target = build_networks(cfg.model)
    if info.world_size > 1 and device.type == "cuda":  # SyncBatchNorm has no CPU kernel
        online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
        target = nn.SyncBatchNorm.convert_sync_batchnorm(target)
    online.to(device)
    target.to(device)
    if device.type == "cpu":  # explicit speed settings (auto: training/run/precision_timing.py decides later)
        if cfg.run.cpu_attention != "auto":
            use_cpu_attention((online, target), cfg.run.cpu_attention)
        if cfg.run.cpu_threads:
            torch.set_num_threads(cfg.run.cpu_threads)
    loss = cfg.loss
    criterion = MSNLoss(
        temperature=loss.temperature, sharpen_temperature=loss.sharpen_start, me_max_weight=loss.me_max_weight,
        use_sinkhorn=loss.use_sinkhorn, sinkhorn_iterations=loss.sinkhorn_iterations,
        label_smoothing=loss.label_smoothing, entropy_weight=loss.entropy_weight,
    )
    fused = cfg.optim.fused if cfg.optim.fused is not None else True  # one kernel per step, CUDA and CPU alike
    optimizer = torch.optim.AdamW(parameter_groups(online), lr=cfg.optim.lr, fused=fused or None)

    model: nn.Module = online
    if info.world_size > 1:
        model = DistributedDataParallel(online, device_ids=[device.index] if device.type == "cuda" else None)
        dist.broadcast_module_(target)  # DDP gave every rank rank 0's online weights; the target starts from them too
    if cfg.run.compile:
        model = torch.compile(model)
    precision = resolve_precision(cfg.run.precision, device)
    return Run(cfg, info, loader, sampler, len(loader), len(dataset), augment, online, target, model, criterion,
               optimizer, mask_generator, precision, autocast_factory(precision, device), mean, std)


def build_augment(cfg: Config, mean: list[float], std: list[float], device: torch.device) -> MultiViewAugment:
    """The run's views (``cfg.mask`` crops, ``cfg.augment`` jitter), built on ``device``; ``--on-stall adapt``
    rebuilds them (``training/run/adapt.py``)."""
    aug, mask = cfg.augment, cfg.mask
    return MultiViewAugment(
        rand_size=cfg.model.image_size, focal_size=mask.focal_size, num_focal=mask.num_focal,
        rand_crop_scale=tuple(mask.rand_crop_scale), focal_crop_scale=tuple(mask.focal_crop_scale),
        color_jitter_strength=aug.color_jitter_strength, color_jitter_p=aug.color_jitter_p,
        grayscale_p=aug.grayscale_p, blur_p=aug.blur_p, blur_sigma=tuple(aug.blur_sigma), flip_p=aug.flip_p,
        solarize_p=aug.solarize_p, levels_p=aug.levels_p, affine=(aug.affine_p, aug.affine_degrees, aug.affine_shear),
        stroke_p=aug.stroke_p, mean=tuple(mean), std=tuple(std),
    ).to(device)


def preprocessing(cfg: Config, mean: list[float], std: list[float]) -> dict:
    """Evaluation-time preprocessing, recorded in checkpoints and exported bundles."""
    crop = cfg.data.eval_crop or cfg.model.image_size
    resize = cfg.data.eval_resize or round(crop * cfg.data.eval_resize_ratio)
    return {"resize": resize, "crop": crop, "mean": list(mean), "std": list(std), "channels": 3,
            "interpolation": "bicubic"}

