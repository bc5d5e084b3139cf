"""Train an RCDM decoder on a frozen MSN bundle.

    msn-visualize train --bundle B --data fashion-mnist --config configs/rcdm_fmnist_32.yaml --output-dir runs/rcdm
    msn-visualize train --bundle B --data photos/ --output-dir runs/rcdm    # your own images, flat or not, no labels
    torchrun --nproc_per_node=N -m visualizer.cli train ...      # DDP, one process per GPU (gloo on CPU)

Per step: decode a batch, flip it (the same flip for both views), embed it with the frozen encoder (masked at a
random ratio for ``cond.mask_prob`` of the images), and train the UNet to denoise the decoder-resolution image given
that embedding. Rank 0 keeps an EMA of the weights, logs ``metrics.jsonl``, writes ``samples/step_XXXXXX.png``
(original | masked | samples) and an atomic ``checkpoint.pt`` that resumes bit-exactly (weights, EMA, optimiser,
position in the epoch and every rank's RNG streams).

The checkpoint also says what the decoder can be asked for: ``cond_drop_prob``, the smallest condition-dropout
probability any of its steps trained with (0 for checkpoints written before it was recorded: without an unconditional
branch, classifier-free guidance has nothing to guide with, so the app fixes guidance at 1), and ``quality``, the
figures measured on held-out images at the end of the last invocation (:mod:`visualizer.quality`, also in
``metrics.jsonl``; class consistency is ``None`` with its reason where the images have no labels). Which images are
held out: :mod:`visualizer.data`. What the decoder is conditioned on: ``cond_feature`` (``cond.feature`` resolved; a
checkpoint without it conditioned on the bundle's served feature), beside ``served_feature``; ``classifier`` is
the quality figure's low-shot classifier in that feature's space (``coef``, ``classes``, ``names``), which the app's
figure uses to say which class the samples keep.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from msn_core.masks import PAD
from training.api import (
    DistInfo,
    Progress,
    autocast_factory,
    barrier,
    batches_from,
    build_loader,
    ema_update,
    eval_transform,
    init_distributed,
    resolve_precision,
    restore_progress,
    save_progress,
)
from visualizer.config import RCDMConfig, dump_config
from visualizer.data import DecoderData, decoder_data
from visualizer.decoder import build_decoder
from visualizer.diffusion import Diffusion, build_objective
from visualizer.features import FrozenEncoder, random_keep_rows, to_uint8
from visualizer.pipeline import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, load_run
from visualizer.quality import quality_and_classifier
from visualizer.render import bitmap_from_keep_idx, masked_view, save_grid, to_hwc

__all__ = ["decoder_targets", "learning_rate", "train"]

log = logging.getLogger("msn.visualize")


def decoder_targets(images_uint8: torch.Tensor, size: int, channels: int = 3) -> torch.Tensor:
    """uint8 images -> decoder-resolution targets in [-1, 1] (shorter side resized, centre crop); ``channels=1``
    keeps the luminance mean of the RGB channels."""
    targets = eval_transform(images_uint8, resize=size, crop=size, mean=[0.5] * 3, std=[0.5] * 3)
    return targets.mean(dim=1, keepdim=True) if channels == 1 else targets


def _grid_batch(cfg: RCDMConfig, data: DecoderData) -> torch.Tensor:
    """Fixed conditioning images for the sample grids: spread over the held-out images when there are enough of
    them (else over the training images)."""
    held = data.held_out
    images = held if held is not None and len(held) >= cfg.run.grid_images else data.train
    picks = torch.linspace(0, len(images) - 1, cfg.run.grid_images).round().long().tolist()
    return torch.stack([images[i][0] for i in picks])


def write_sample_grid(path: Path, decoder: nn.Module, diffusion: Diffusion, encoder: FrozenEncoder,
                      images: torch.Tensor, cfg: RCDMConfig) -> None:
    """One row per image: original (decoder size), masked encoder view, ``grid_samples`` samples."""
    generator = torch.Generator().manual_seed(cfg.run.seed)
    keep_idx = random_keep_rows(len(images), encoder.num_patches, [cfg.run.grid_mask_ratio] * len(images), generator)
    feat = encoder.embed(images, keep_idx).repeat_interleave(cfg.run.grid_samples, dim=0)
    was_training = decoder.training
    decoder.eval()
    samples = diffusion.sample(decoder, feat, image_size=cfg.model.image_size, generator=generator)
    decoder.train(was_training)
    samples = to_uint8(samples)
    originals = to_uint8(decoder_targets(images, cfg.model.image_size, cfg.model.channels).expand(-1, 3, -1, -1))
    views = encoder.model_view(images)
    rows = []
    for i in range(len(images)):
        masked = masked_view(to_hwc(views[i]), bitmap_from_keep_idx(keep_idx[i][keep_idx[i] != PAD], encoder.grid))
        row_samples = samples[i * cfg.run.grid_samples:(i + 1) * cfg.run.grid_samples]
        rows.append([to_hwc(originals[i]), masked] + [to_hwc(s) for s in row_samples])
    save_grid(rows, path, cell=max(64, cfg.model.image_size))


def learning_rate(cfg: RCDMConfig, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then constant or a cosine to 0 at ``max_steps`` or at ``max_minutes`` of this invocation,
    whichever comes first (``optim.lr_schedule``): a run cut by its time cap still ends with a small rate."""
    o = cfg.optim
    warm = min(1.0, (step + 1) / max(1, o.warmup_steps))
    if o.lr_schedule == "constant":
        return o.lr * warm
    done = step / max(1, o.max_steps)
    if o.max_minutes:
        done = max(done, elapsed_s / (60.0 * o.max_minutes))
    return o.lr * warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))


def out_of_time(deadline: float, device: torch.device, world_size: int) -> bool:
    """Whether ``deadline`` (``time.monotonic``) has passed, agreed by every rank so that all stop at one step."""
    if deadline == math.inf:
        return False
    late = time.monotonic() >= deadline
    if world_size > 1:
        flag = torch.tensor([float(late)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        late = bool(flag.item())
    return late


def train(cfg: RCDMConfig, bundle: str | Path, output_dir: str | Path, *, resume: bool = False,
          info: DistInfo | None = None) -> dict:
    """Run (or continue) training until ``optim.max_steps``, or until ``optim.max_minutes`` of this invocation have
    passed (then the sample grid and checkpoint are written at the step reached); returns the last logged metrics."""
    info = info or init_distributed(cfg.run.device)
    device, is_main = info.device, info.rank == 0
    output_dir = Path(output_dir)
    checkpoint_path = output_dir / "checkpoint.pt"
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, output_dir / "config.yaml")
    torch.manual_seed(cfg.run.seed + info.rank)
    mask_generator = torch.Generator().manual_seed(cfg.run.seed + 7919 * (info.rank + 1))

    encoder = FrozenEncoder(bundle, backend=cfg.cond.backend, device=device, feature=cfg.cond.feature)
    load_size = cfg.data.load_size or max(cfg.model.image_size, int(encoder.transform["resize"]))
    data = decoder_data(cfg, load_size)  # training images, and held-out ones (a slice of a split-less folder)
    dataset = data.train
    loader, sampler = build_loader(dataset, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers,
                                   rank=info.rank, world_size=info.world_size, seed=cfg.run.seed,
                                   pin_memory=device.type == "cuda")
    steps_per_epoch = len(loader)

    decoder = build_decoder(cfg.model, encoder.dim, encoder.layout).to(device)
    ema = copy.deepcopy(decoder).requires_grad_(False)
    diffusion = build_objective(cfg)
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)

    progress = Progress()
    trained_drop, quality = cfg.diffusion.cond_drop_prob, None  # what the checkpoint will record (module docstring)
    classifier = None
    if resume and checkpoint_path.exists():
        state = load_run(checkpoint_path)
        if state["bundle"]["model_id"] != encoder.model_id:
            raise ValueError(f"{checkpoint_path} was trained on bundle {state['bundle']['model_id']}, "
                             f"not {encoder.model_id}: use another --output-dir")
        trained_on = state.get("cond_feature") or encoder.served  # checkpoints before cond.feature: the served one
        if (trained_on, state["config"]["model"].get("kind", "rcdm")) != (encoder.feature, cfg.model.kind):
            raise ValueError(f"{checkpoint_path} is a {state['config']['model'].get('kind', 'rcdm')} decoder on "
                             f"{trained_on}, not a {cfg.model.kind} decoder on {encoder.feature} (cond.feature="
                             f"{cfg.cond.feature}): use another --output-dir")
        classifier = state.get("classifier")
        decoder.load_state_dict(state["decoder"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        progress = restore_progress(state, steps_per_epoch=steps_per_epoch, info=info,
                                    mask_generator=mask_generator, seed=cfg.run.seed)
        log.info("resumed from %s at step %d", checkpoint_path, progress.step)
        quality = state.get("quality")
        if progress.step > 0:
            trained_drop = min(float(state.get("cond_drop_prob", 0.0)), trained_drop)
            if trained_drop < cfg.diffusion.cond_drop_prob:
                log.warning("%s trained %d steps with cond_drop_prob %g: it records %g, so guidance stays off "
                            "(train in a new --output-dir for a decoder that can guide)", checkpoint_path,
                            progress.step, trained_drop, trained_drop)

    model: nn.Module = decoder
    if info.world_size > 1:
        model = DistributedDataParallel(decoder, device_ids=[device.index] if device.type == "cuda" else None)
    precision = resolve_precision(cfg.run.precision, device)  # auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU)
    autocast = autocast_factory(precision, device)
    grid_images = _grid_batch(cfg, data) if is_main else None
    total = cfg.optim.max_steps
    bar = tqdm(total=total, initial=progress.step, unit="step", dynamic_ncols=True,
               disable=not (is_main and cfg.run.progress_bar))
    if is_main:
        params = sum(p.numel() for p in decoder.parameters()) / 1e6
        bar.write(f"RCDM decoder: {params:.2f}M parameters, {len(dataset)} images, {steps_per_epoch} steps/epoch, "
                  f"world size {info.world_size}, device {device}, {precision}, conditioning on {encoder.model_id}'s "
                  f"{encoder.feature} ({encoder.dim}-d; the bundle serves {encoder.served})")

    def save() -> None:
        payload = {"config": cfg.to_dict(), "cond_dim": encoder.dim, "cond_drop_prob": trained_drop,
                   "cond_feature": encoder.feature, "served_feature": encoder.served, "classifier": classifier,
                   "quality": quality, "bundle": {"model_id": encoder.model_id, "path": str(bundle)},
                   "decoder": decoder.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict()}
        save_progress(checkpoint_path, payload, progress, steps_per_epoch=steps_per_epoch, info=info,
                      mask_generator=mask_generator, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION)

    record: dict = {"step": progress.step}  # returned as is when a resumed run has nothing left to do
    batches = batches_from(loader, sampler, progress, cfg.data.batch_size)
    started = time.monotonic()
    deadline = started + 60 * cfg.optim.max_minutes if cfg.optim.max_minutes else math.inf
    window_seconds, window_images = 0.0, 0  # step time only (no grids, no checkpoints): images/s in metrics.jsonl
    while progress.step < total:
        tick = time.perf_counter()
        images, _labels, _skipped = next(batches)
        if cfg.data.hflip:
            flip = torch.rand(images.shape[0]) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        feat = encoder.embed_masked_batch(images, mask_prob=cfg.cond.mask_prob, ratio_min=cfg.cond.mask_ratio_min,
                                          ratio_max=cfg.cond.mask_ratio_max, generator=mask_generator)
        x0 = decoder_targets(images, cfg.model.image_size, cfg.model.channels).to(device, non_blocking=True)
        drop = None
        if cfg.diffusion.cond_drop_prob > 0:
            drop = (torch.rand(images.shape[0]) < cfg.diffusion.cond_drop_prob).to(device)
        step = progress.step
        lr = learning_rate(cfg, step, time.monotonic() - started)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            loss, stats = diffusion.loss(model, x0, feat, drop)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(decoder.parameters(), cfg.optim.clip_grad)
        optimizer.step()
        ema_update(ema, decoder, min(cfg.optim.ema_decay, (1 + step) / (10 + step)), copy_buffers=True)
        progress.advance(steps_per_epoch)
        step = progress.step
        window_seconds += time.perf_counter() - tick
        window_images += images.shape[0] * info.world_size
        bar.update(1)
        if step < total and out_of_time(deadline, device, info.world_size):
            total = step  # the end of this invocation: log, sample and save as at max_steps
            if is_main:
                bar.write(f"optim.max_minutes={cfg.optim.max_minutes:g} reached at step {step} of "
                          f"{cfg.optim.max_steps}; --resume continues")
        if is_main and (step % cfg.run.log_every_steps == 0 or step == total):
            record = {"step": step, "epoch": progress.epoch, "loss": loss.item(), **stats, "lr": lr,
                      "grad_norm": float(grad_norm)}
            speed = {"images_per_s": round(window_images / max(window_seconds, 1e-9), 1), "precision": precision}
            window_seconds, window_images = 0.0, 0  # not in the returned record: timings differ between runs
            with open(output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({**record, **speed}) + "\n")
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        sample_every = cfg.run.sample_every_steps
        if is_main and ((sample_every and step % sample_every == 0) or step == total):
            grid = output_dir / "samples" / f"step_{step:06d}.png"
            write_sample_grid(grid, ema, diffusion, encoder, grid_images, cfg)
        if is_main and step == total:
            measured, fitted = quality_and_classifier(ema, diffusion, encoder, cfg, data, step=step)
            if measured is not None:
                quality, classifier = measured, fitted or classifier
                with open(output_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "quality": quality}) + "\n")
        if step % cfg.run.checkpoint_every_steps == 0 or step == total:
            save()
    bar.close()
    barrier()
    return record
