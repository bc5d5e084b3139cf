"""MSN pretraining.

    torchrun --nproc_per_node=N training/pretrain.py --config configs/X.yaml --output-dir runs/X [--set k=v ...]
    torchrun ... --resume        # continue exactly from runs/X/checkpoint.pt

One process per device (CPU processes use gloo, GPUs NCCL); multi-node through torchrun's rendezvous flags.
Per image and step: an unmasked target view goes through the EMA target encoder; a patch-dropped anchor view and
`num_focal` small focal views go through the online encoder; the anchors' prototype assignments are trained to
match the sharpened, Sinkhorn-balanced assignment of the target (training/losses.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the `training` package, not sibling modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training import distributed as dist
from training.checkpoint import (
    capture_rng_state,
    copy_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from training.config import Config, ConfigError, dump_config, load_config
from training.data import build_dataset, build_loader, normalization_stats
from training.losses import MSNLoss
from training.masking import random_keep_idx
from training.monitor import TrainingMonitor
from training.msn import build_networks, ema_update, parameter_groups
from training.schedules import Schedules
from training.views import MultiViewAugment
from training.vit import encoder_kwargs

log = logging.getLogger("msn.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML config (keys: see training/config.py)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set optim.epochs=10 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt if it exists")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"pretrain: {err}")
    info = dist.init_distributed(cfg.run.device)
    is_main = info.rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        train(cfg, info, args.output_dir, resume=args.resume)
    finally:
        dist.cleanup()


def train(cfg: Config, info: dist.DistInfo, output_dir: Path, *, resume: bool) -> None:
    device, is_main = info.device, info.rank == 0
    checkpoint_path = output_dir / "checkpoint.pt"
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, output_dir / "config.yaml")
    # Augmentations differ per rank; mask permutations are shared by all ranks, as in the official code.
    torch.manual_seed(cfg.run.seed + info.rank)
    mask_generator = torch.Generator().manual_seed(cfg.run.seed)

    # -- data: workers decode and resize; all random augmentation is batched on the device
    dataset = build_dataset(
        cfg.data.source, root=cfg.data.root, split="train", load_size=cfg.data.load_size,
        subset=cfg.data.subset_file, synthetic_size=cfg.data.synthetic_size, seed=cfg.run.seed,
    )
    loader, sampler = build_loader(
        dataset, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers, rank=info.rank,
        world_size=info.world_size, seed=cfg.run.seed, pin_memory=cfg.data.pin_memory and device.type == "cuda",
    )
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise SystemExit(f"pretrain: {len(dataset)} images are fewer than one global batch")
    default_mean, default_std = normalization_stats(cfg.data.source)
    mean, std = list(cfg.data.mean or default_mean), list(cfg.data.std or default_std)
    augment = MultiViewAugment(
        rand_size=cfg.model.image_size, focal_size=cfg.mask.focal_size, num_focal=cfg.mask.num_focal,
        rand_crop_scale=tuple(cfg.mask.rand_crop_scale), focal_crop_scale=tuple(cfg.mask.focal_crop_scale),
        color_jitter_strength=cfg.mask.color_jitter_strength, mean=tuple(mean), std=tuple(std),
    ).to(device)

    # -- networks, loss, optimiser, schedules
    online, target = build_networks(cfg.model)
    if info.world_size > 1 and device.type == "cuda":  # SyncBatchNorm has no CPU kernel
        online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
        target = nn.SyncBatchNorm.convert_sync_batchnorm(target)
    online.to(device)
    target.to(device)
    criterion = MSNLoss(
        temperature=cfg.loss.temperature, sharpen_temperature=cfg.loss.sharpen_start,
        me_max_weight=cfg.loss.me_max_weight, use_sinkhorn=cfg.loss.use_sinkhorn,
        sinkhorn_iterations=cfg.loss.sinkhorn_iterations, label_smoothing=cfg.loss.label_smoothing,
        entropy_weight=cfg.loss.entropy_weight,
    )
    fused = cfg.optim.fused if cfg.optim.fused is not None else device.type == "cuda"
    optimizer = torch.optim.AdamW(parameter_groups(online), lr=cfg.optim.lr, fused=fused or None)
    schedules = Schedules(
        steps_per_epoch=steps_per_epoch, epochs=cfg.optim.epochs, warmup_epochs=cfg.optim.warmup_epochs,
        start_lr=cfg.optim.start_lr, ref_lr=cfg.optim.lr, final_lr=cfg.optim.final_lr,
        ref_weight_decay=cfg.optim.weight_decay, final_weight_decay=cfg.optim.final_weight_decay,
        ema_start=cfg.optim.ema_start, ema_end=cfg.optim.ema_end, horizon_scale=cfg.optim.horizon_scale,
        sharpen_start=cfg.loss.sharpen_start, sharpen_end=cfg.loss.sharpen_end,
    )

    # -- resume: weights, optimiser, position in the epoch and every rank's RNG streams
    step, epoch, batch_in_epoch = 0, 0, 0
    if resume and checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path)
        online.net.encoder.load_state_dict(state["encoder"])
        online.net.head.load_state_dict(state["head"])
        with torch.no_grad():
            online.prototypes.copy_(state["prototypes"])
        target.encoder.load_state_dict(state["target_encoder"])
        target.head.load_state_dict(state["target_head"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        if state["world_size"] == info.world_size and state["steps_per_epoch"] == steps_per_epoch:
            restore_rng_state(state["rng"][info.rank], mask_generator)
        else:
            log.warning("resuming with a different world size or batch: continuing, but not bit-exactly")
            torch.manual_seed(cfg.run.seed + info.rank + step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", checkpoint_path, step, epoch, batch_in_epoch)
    elif resume:
        log.info("no checkpoint at %s: starting from scratch", checkpoint_path)

    model: nn.Module = online
    if info.world_size > 1:
        model = DistributedDataParallel(online, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.run.compile:
        model = torch.compile(model)
    use_bf16 = cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext

    total_steps = cfg.optim.epochs * steps_per_epoch
    if cfg.run.max_steps is not None:
        total_steps = min(total_steps, cfg.run.max_steps)
    global_batch = cfg.data.batch_size * info.world_size
    monitor = TrainingMonitor(
        output_dir, enabled=is_main, total_steps=total_steps, start_step=step,
        num_prototypes=cfg.model.num_prototypes, progress_bar=cfg.run.progress_bar, tensorboard=cfg.run.tensorboard,
    )
    if is_main:
        monitor.write(
            f"MSN: {sum(p.numel() for p in online.parameters()) / 1e6:.2f}M trainable parameters, "
            f"{len(dataset)} images, {steps_per_epoch} steps/epoch, global batch {global_batch}, "
            f"world size {info.world_size}, device {device}, {'bf16' if use_bf16 else 'fp32'}"
        )

    def save(epoch_: int, batch_: int) -> None:
        rng_states = dist.all_gather_object(capture_rng_state(mask_generator))
        if is_main:
            save_checkpoint(checkpoint_path, {
                "config": cfg.to_dict(), "arch": cfg.model.arch, "encoder_kwargs": encoder_kwargs(online.net.encoder),
                "preprocessing": preprocessing(cfg, mean, std),
                "encoder": online.net.encoder.state_dict(), "head": online.net.head.state_dict(),
                "prototypes": online.prototypes.detach().clone(),
                "target_encoder": target.encoder.state_dict(), "target_head": target.head.state_dict(),
                "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch_, "batch_in_epoch": batch_,
                "steps_per_epoch": steps_per_epoch, "world_size": info.world_size, "rng": rng_states,
            })

    skipped_files = 0
    while epoch < cfg.optim.epochs and step < total_steps:
        sampler.set_epoch(epoch)
        sampler.set_start_index(batch_in_epoch * cfg.data.batch_size)
        for images, _labels, num_skipped in loader:
            skipped_files += num_skipped
            images = images.to(device, non_blocking=True)

            # 1. views: target (unmasked), anchor (patch-dropped below), focal crops; no gradients through these
            with torch.no_grad():
                target_views, anchor_views, focal_views = augment(images)
            if cfg.mask.share_target_view:
                anchor_views = target_views
            keep_idx = None
            if cfg.mask.ratio > 0:
                num_patches = (cfg.model.image_size // cfg.model.patch_size) ** 2
                keep_idx = random_keep_idx(
                    images.shape[0], num_patches, cfg.mask.ratio, shared=cfg.mask.shared, generator=mask_generator
                ).to(device)

            # 2. schedules are pure functions of the step, so a resumed run sees the same values
            lr, wd, momentum = schedules.lr(step), schedules.weight_decay(step), schedules.ema_momentum(step)
            criterion.sharpen_temperature = schedules.sharpen_temperature(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
                if not group["wd_exclude"]:
                    group["weight_decay"] = wd

            # 3. forward: online anchors (masked + focal) vs. EMA target; loss in fp32
            with autocast():
                anchor_z, prototypes = model(anchor_views, keep_idx, focal_views)
                with torch.no_grad():
                    target_z = target(target_views)
            loss, stats = criterion(anchor_z, target_z, prototypes)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at step {step}: stopping before it spreads")

            # 4. update: clip the encoder + head (not the prototypes), AdamW step, EMA of the target
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(online.net.parameters(), cfg.optim.clip_grad)
            optimizer.step()
            ema_update(target, online.net, momentum)

            step += 1
            batch_in_epoch += 1
            monitor.step(global_batch)
            if step % cfg.run.log_every_steps == 0 or step == total_steps:
                monitor.log(step, epoch, {
                    "loss": loss.item(), **stats, "lr": lr, "weight_decay": wd, "ema_momentum": momentum,
                    "grad_norm": float(grad_norm), "embedding_spread": embedding_spread(target_z),
                    "skipped_files": skipped_files,
                    **({"max_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}),
                })
            if batch_in_epoch == steps_per_epoch:
                epoch, batch_in_epoch = epoch + 1, 0
            if step % cfg.run.checkpoint_every_steps == 0 or batch_in_epoch == 0 or step == total_steps:
                save(epoch, batch_in_epoch)
                keep_every = cfg.run.keep_epoch_checkpoints
                if is_main and batch_in_epoch == 0 and keep_every and epoch % keep_every == 0:
                    copy_checkpoint(checkpoint_path, output_dir / f"checkpoint-ep{epoch:04d}.pt")
            if step >= total_steps or batch_in_epoch == 0:
                break
    if skipped_files:
        log.warning("%d unreadable image files were skipped", skipped_files)
    monitor.write(f"done: step {step}, epoch {epoch}; checkpoint at {checkpoint_path}")
    monitor.close()


def preprocessing(cfg: Config, mean: list[float], std: list[float]) -> dict:
    """Evaluation-time preprocessing, recorded in checkpoints and exported bundles."""
    crop = cfg.data.eval_crop or cfg.model.image_size
    resize = cfg.data.eval_resize or round(crop * 256 / 224)
    return {"resize": resize, "crop": crop, "mean": list(mean), "std": list(std), "channels": 3,
            "interpolation": "bicubic"}


@torch.no_grad()
def embedding_spread(embeddings: torch.Tensor) -> float:
    """Per-dimension std of L2-normalised embeddings times sqrt(d): ~1 when spread out, 0 when collapsed."""
    z = torch.nn.functional.normalize(embeddings.float(), dim=1)
    return float(z.std(dim=0).mean() * math.sqrt(z.shape[1]))


if __name__ == "__main__":
    main()
