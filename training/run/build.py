"""Everything a pretraining run is made of, built from the config: data, views, masks, networks, loss, optimiser.

``training/pretrain.py`` builds a ``Run`` here and then only loops; ``train_step`` is the whole MSN step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from training import distributed as dist
from training.config import Config
from training.data import ResumableDistributedSampler, build_dataset, build_loader, normalization_stats
from training.model.losses import LossTerms, MSNLoss
from training.masking import random_keep_idx
from training.model.msn import MSNOnline, ProjectedEncoder, build_networks, ema_update, parameter_groups
from training.run.schedules import Schedules
from training.views import MultiViewAugment

__all__ = ["Run", "StepOutput", "build_run", "build_schedules", "preprocessing", "train_step"]


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
    autocast: Callable[[], AbstractContextManager]
    mean: list[float]
    std: list[float]

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.info.world_size

    @property
    def precision(self) -> str:
        return "bf16" if self.autocast is not nullcontext else "fp32"


def build_run(cfg: Config, info: dist.DistInfo) -> Run:
    device = info.device
    # Augmentations differ per rank; mask permutations are shared by all ranks, as in the official code.
    torch.manual_seed(cfg.run.seed + info.rank)
    mask_generator = torch.Generator().manual_seed(cfg.run.seed)

    # data: workers decode and resize; all random augmentation is batched on the device
    dataset = build_dataset(
        cfg.data.source, root=cfg.data.root, split="train", load_size=cfg.data.load_size,
        subset=cfg.data.subset_file, synthetic_size=cfg.data.synthetic_size, seed=cfg.run.seed,
    )
    loader, sampler = build_loader(
        dataset, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers, rank=info.rank,
        world_size=info.world_size, seed=cfg.run.seed, pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    if len(loader) == 0:
        raise SystemExit(f"pretrain: {len(dataset)} images are fewer than one global batch")
    default_mean, default_std = normalization_stats(cfg.data.source)
    mean, std = list(cfg.data.mean or default_mean), list(cfg.data.std or default_std)
    aug, mask = cfg.augment, cfg.mask
    augment = MultiViewAugment(
        rand_size=cfg.model.image_size, focal_size=mask.focal_size, num_focal=mask.num_focal,
        rand_crop_scale=tuple(mask.rand_crop_scale), focal_crop_scale=tuple(mask.focal_crop_scale),
        color_jitter_strength=aug.color_jitter_strength, color_jitter_p=aug.color_jitter_p,
        grayscale_p=aug.grayscale_p, blur_p=aug.blur_p, blur_sigma=tuple(aug.blur_sigma), flip_p=aug.flip_p,
        solarize_p=aug.solarize_p, mean=tuple(mean), std=tuple(std),
    ).to(device)

    online, target = build_networks(cfg.model)
    if info.world_size > 1 and device.type == "cuda":  # SyncBatchNorm has no CPU kernel
        online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
        target = nn.SyncBatchNorm.convert_sync_batchnorm(target)
    online.to(device)
    target.to(device)
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
    if cfg.run.compile:
        model = torch.compile(model)
    use_bf16 = cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
    return Run(cfg, info, loader, sampler, len(loader), len(dataset), augment, online, target, model, criterion, optimizer,
               mask_generator, autocast, mean, std)


def build_schedules(cfg: Config, total_steps: int, steps_per_epoch: int) -> Schedules:
    """The official schedules over ``total_steps``.

    Warm-up lasts ``warmup_epochs`` epochs of ``steps_per_epoch`` (official) when the run is counted in epochs;
    for a step count or a budget it is the same fraction of the run, ``warmup_epochs / epochs``.
    """
    o = cfg.optim
    by_epochs = o.total_steps is None and o.budget_minutes is None
    if by_epochs:
        warmup_steps = int(o.warmup_epochs * steps_per_epoch)
    else:
        warmup_steps = round(o.warmup_epochs / o.epochs * total_steps)
    return Schedules(
        total_steps=total_steps, warmup_steps=warmup_steps,
        start_lr=o.start_lr, ref_lr=o.lr, final_lr=o.final_lr, ref_weight_decay=o.weight_decay,
        final_weight_decay=o.final_weight_decay, ema_start=o.ema_start, ema_end=o.ema_end,
        horizon_scale=o.horizon_scale, sharpen_start=cfg.loss.sharpen_start, sharpen_end=cfg.loss.sharpen_end,
    )


@dataclass
class StepOutput:
    """What one step leaves for logging; tensors stay on the device until a log step reads them."""

    loss: Tensor
    terms: LossTerms
    grad_norm: Tensor
    target_z: Tensor
    lr: float
    weight_decay: float
    ema_momentum: float


def train_step(run: Run, schedules: Schedules, step: int, images: Tensor) -> StepOutput:
    """One MSN step on a uint8 batch: views, masks, forward, loss, AdamW update, EMA of the target."""
    cfg = run.cfg
    images = images.to(run.device, non_blocking=True)

    # 1. views: target (unmasked), anchor (patch-dropped below), focal crops; no gradients through these
    with torch.no_grad():
        target_views, anchor_views, focal_views = run.augment(images)
    if cfg.mask.share_target_view:
        anchor_views = target_views
    keep_idx = None
    if cfg.mask.ratio > 0:
        num_patches = (cfg.model.image_size // cfg.model.patch_size) ** 2
        keep_idx = random_keep_idx(images.shape[0], num_patches, cfg.mask.ratio, shared=cfg.mask.shared,
                                   generator=run.mask_generator).to(run.device)

    # 2. schedules are pure functions of the step, so a resumed run sees the same values
    lr, wd, momentum = schedules.lr(step), schedules.weight_decay(step), schedules.ema_momentum(step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
        if not group["wd_exclude"]:
            group["weight_decay"] = wd

    # 3. forward: online anchors (masked + focal) vs. EMA target; the loss itself runs in fp32
    with run.autocast():
        anchor_z, prototypes = run.model(anchor_views, keep_idx, focal_views)
        with torch.no_grad():
            target_z = run.target(target_views)
    loss, terms = run.criterion(anchor_z, target_z, prototypes, schedules.sharpen_temperature(step))

    # 4. update: clip the encoder + head (not the prototypes), AdamW step, EMA of the target's parameters
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.online.net.parameters(), cfg.optim.clip_grad)
    run.optimizer.step()
    ema_update(run.target, run.online.net, momentum, copy_buffers=False)
    return StepOutput(loss.detach(), terms, grad_norm.detach(), target_z.detach(), lr, wd, momentum)


def preprocessing(cfg: Config, mean: list[float], std: list[float]) -> dict:
    """Evaluation-time preprocessing, recorded in checkpoints and exported bundles."""
    crop = cfg.data.eval_crop or cfg.model.image_size
    resize = cfg.data.eval_resize or round(crop * cfg.data.eval_resize_ratio)
    return {"resize": resize, "crop": crop, "mean": list(mean), "std": list(std), "channels": 3,
            "interpolation": "bicubic"}


@torch.no_grad()
def embedding_spread(embeddings: Tensor) -> float:
    """Per-dimension std of L2-normalised embeddings times sqrt(d): ~1 when spread out, 0 when collapsed."""
    z = torch.nn.functional.normalize(embeddings.float(), dim=1)
    return float(z.std(dim=0).mean() * math.sqrt(z.shape[1]))
