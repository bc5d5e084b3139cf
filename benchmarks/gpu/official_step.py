"""The official facebookresearch/msn training step, timed on the same GPU, batch and views as ours.

The official code is not part of this project: ``python -m benchmarks.gpu.pack`` takes its ``src/`` from a clone
(or the fetch tool's mirror) into the GPU payload, and ``--official DIR`` points here. Built with the official
functions themselves (``init_model``, ``init_opt``, ``init_msn_loss``: ViT-S/16 ``deit_small``, 3-layer projection
head with BatchNorm, 1,024 prototypes, AdamW); the step is the body of ``train_step`` in ``src/msn_train.py``
(``main``'s closure, so it is restated here line for line): online encoder on the 1 + ``focal`` anchor views with
``patch_drop``, target encoder on the first view, the MSN loss with Sinkhorn and me-max, backward, gradient
clipping, AdamW, the EMA update.

What differs from a run of the official trainer, and why: the views are random tensors already on the GPU (the
official loader makes them in CPU workers, outside its own step timer, which is what this measures too); the
schedulers are not stepped (they change values, not cost); ``--precision bf16`` wraps the forward passes and the
loss in ``torch.autocast`` (the official code trains in fp32 only: it has no autocast). The official data pipeline
(the only user of torchvision) is replaced by an empty stand-in.

    python -m benchmarks.gpu.official_step --official /tmp/msn-gpu/payload/official_msn --precision bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path


def import_official(root: Path):
    """The official modules, importable as ``src.*`` the way its trainer imports them."""
    if not (root / "src" / "msn_train.py").is_file():
        raise FileNotFoundError(f"no official MSN sources under {root} (python -m benchmarks.gpu.pack)")
    sys.path.insert(0, str(root))
    # The official data pipeline (src/data_manager.py, torchvision) is never used by the step: an empty stand-in
    # keeps torchvision out of the process (its PyPI build fails to import beside a CPU torch).
    stub = types.ModuleType("src.data_manager")
    stub.init_data = stub.make_transforms = None
    sys.modules["src.data_manager"] = stub
    import src.msn_train as official
    return official


def build(official, model_name: str, device, hidden_dim: int, output_dim: int, num_proto: int, num_views: int):
    import copy

    import torch

    encoder = official.init_model(device=device, model_name=model_name, use_pred=False, use_bn=True,
                                  two_layer=False, bottleneck=1, hidden_dim=hidden_dim, output_dim=output_dim,
                                  drop_path_rate=0.0)
    target = copy.deepcopy(encoder)
    for p in target.parameters():
        p.requires_grad = False
    prototypes = torch.empty(num_proto, output_dim)
    torch.nn.init.uniform_(prototypes, -(1.0 / output_dim) ** 0.5, (1.0 / output_dim) ** 0.5)
    prototypes = torch.nn.Parameter(prototypes.to(device))
    proto_labels = torch.eye(num_proto, device=device)  # one_hot(range(K)) with label_smoothing 0
    encoder, optimizer, _, _ = official.init_opt(encoder=encoder, prototypes=prototypes, wd=0.04, final_wd=0.4,
                                                 start_lr=2e-4, ref_lr=1e-3, final_lr=1e-6,
                                                 iterations_per_epoch=100, warmup=15, num_epochs=800)
    msn = official.init_msn_loss(num_views=num_views, tau=0.1, me_max=True, return_preds=True)
    return encoder, target, prototypes, proto_labels, optimizer, msn


def time_steps(official, *, model_name: str, device: str, batch: int, focal: int, rand_size: int,
               focal_size: int, patch_drop: float, precision: str, steps: int, warmup: int) -> dict:
    import torch

    dev = torch.device(device)
    torch.manual_seed(0)
    encoder, target, prototypes, proto_labels, optimizer, msn = build(official, model_name, dev, 2048, 256, 1024,
                                                                          num_views=1 + focal)
    imgs = [torch.randn(batch, 3, rand_size, rand_size, device=dev) for _ in range(2)]
    imgs += [torch.randn(batch, 3, focal_size, focal_size, device=dev) for _ in range(focal)]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def train_step() -> float:
        optimizer.zero_grad()
        with autocast:
            h, z = encoder(imgs[1:], return_before_head=True, patch_drop=patch_drop)
            with torch.no_grad():
                h, _ = target(imgs[0], return_before_head=True)
            h, z = h.float(), z.float()
            ploss, me_max, ent, _logs, _ = msn(T=0.25, use_sinkhorn=True, use_entropy=True, anchor_views=z,
                                              target_views=h.detach(), proto_labels=proto_labels,
                                              prototypes=prototypes)
            loss = ploss + 1.0 * me_max + 0.0 * ent
        loss.backward()
        with torch.no_grad():
            prototypes.grad.data = official.AllReduceSum.apply(prototypes.grad.data)
        torch.nn.utils.clip_grad_norm_(encoder.parameters(), 3.0)
        optimizer.step()
        with torch.no_grad():
            m = 0.996
            for q, k in zip(encoder.parameters(), target.parameters()):
                k.data.mul_(m).add_((1.0 - m) * q.detach().data)
        return float(loss)  # the official step returns float(loss): one sync per step, as there

    durations, losses = [], []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            durations.append(time.perf_counter() - t0)
    step_s = statistics.median(durations)
    out = {"implementation": "official", "model": model_name, "precision": precision, "batch": batch,
           "views": {"target": 1, "anchor": 1, "focal": focal, "rand_size": rand_size, "focal_size": focal_size},
           "patch_drop": patch_drop, "steps_timed": steps, "step_s_median": step_s,
           "images_per_sec": batch / step_s, "loss_first": losses[0], "loss_last": losses[-1]}
    if dev.type == "cuda":
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--official", type=Path, required=True, help="folder holding the official src/")
    ap.add_argument("--model", default="deit_small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--focal", type=int, default=10)
    ap.add_argument("--rand-size", type=int, default=224)
    ap.add_argument("--focal-size", type=int, default=96)
    ap.add_argument("--patch-drop", type=float, default=0.15)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args(argv)
    official = import_official(a.official)
    row = time_steps(official, model_name=a.model, device=a.device, batch=a.batch, focal=a.focal,
                     rand_size=a.rand_size, focal_size=a.focal_size, patch_drop=a.patch_drop,
                     precision=a.precision, steps=a.steps, warmup=a.warmup)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
