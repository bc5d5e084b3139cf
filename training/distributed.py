"""Process-group setup and the few collectives MSN needs.

Everything here degrades to a no-op in a single process, so the loss and the training loop have one code path.
Launch with ``torchrun``; the official code's SLURM/``mp.spawn`` setup is not reproduced.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from msn_core.gpu import CudaUnavailable, cuda_driver_problem

__all__ = [
    "DistInfo",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_min_int",
    "all_reduce_sum_",
    "barrier",
    "broadcast_module_",
    "cleanup",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_main_process",
    "restart_count",
    "synchronize",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. ``backend`` is None when no process group was created."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None


def pinned_torch() -> str:
    """The torch requirement the project pins (``torch==X.Y.Z``), read from pyproject.toml's ``train`` extra (a
    checkout) or the installed ``msn`` distribution's metadata built from it, so the pin is written in one place."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        requires = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["train"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        try:
            requires = importlib.metadata.requires("msn") or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
    pins = [r.split(";")[0].strip() for r in requires if re.match(r"torch\s*==", r)]
    return pins[0] if pins else "the torch version pyproject.toml pins"


def torch_problem(version: str, cuda_build: str | None, devices: int, driver: str | None) -> str | None:
    """Why torch ``version`` (built for CUDA ``cuda_build``, None: the CPU build) cannot train on a GPU when it
    sees ``devices`` GPUs and the driver check said ``driver``; None when it can."""
    if cuda_build is None:
        return (f"torch's CUDA build (this torch {version} is the CPU build): pip install {pinned_torch()} from "
                "PyPI into a fresh environment (its Linux wheel of that version is the CUDA build)")
    if devices < 1:
        return f"a GPU torch {version} (CUDA {cuda_build}) can use: " + (driver or "torch.cuda finds none")
    return None


def torch_cuda_problem() -> str | None:
    """:func:`torch_problem` for this process's torch (no CUDA context is created: device_count reads NVML/driver)."""
    driver = cuda_driver_problem()
    devices = torch.cuda.device_count() if torch.version.cuda and driver is None else 0
    return torch_problem(torch.__version__, torch.version.cuda, devices, driver)


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        why = torch_cuda_problem()
        if why:
            raise CudaUnavailable(f"run.device=cuda needs {why}")
        # One GPU per process: torchrun's LOCAL_RANK picks it.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

    Without that environment, or with WORLD_SIZE=1, this is a single process and no group is created.
    The backend is NCCL on CUDA and Gloo on CPU (``device="cpu"`` forces Gloo even when GPUs exist).
    Calling it again once a group exists returns the existing group's info.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = _resolve_device(device, local_rank)

    if is_distributed():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, torch_device, dist.get_backend())
    if world_size == 1:
        return DistInfo(0, 1, local_rank, torch_device, None)

    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        store=_attempt_store(world_size),  # None: torch's own env:// set-up
        rank=rank,
        world_size=world_size,
        device_id=torch_device if torch_device.type == "cuda" else None,
    )
    return DistInfo(rank, world_size, local_rank, torch_device, backend)


def _attempt_store(world_size: int) -> dist.Store | None:
    """The group's key-value store under torchrun's shared agent store, with keys of this attempt only.

    torchrun (c10d rendezvous, e.g. ``--standalone``) keeps one store for the whole launch and restarted workers join
    it again; torch's env:// set-up then reuses the same keys in every attempt, so a restarted rank can read a peer's
    address left by the failed attempt (gloo: "connection refused", or a hang). A prefix per attempt keeps them
    apart. Elsewhere (a static rendezvous, where rank 0 starts a fresh store) torch's set-up is used unchanged.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(minutes=30))
    return dist.PrefixStore(f"msn/attempt-{restart_count()}", store)


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (``--max-restarts``); 0 on a first attempt and
    outside torchrun. Workers restarted after a failure run the same command line again, so the trainer reads this
    to resume on its own (docs/training.md#restarts-under-torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_distributed() -> bool:
    """True when a process group with more than one rank is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Rank 0 writes checkpoints, logs and exports."""
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group, if any (safe to call in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _AllReduceMean(torch.autograd.Function):
    """Mean over ranks forward, identity backward.

    Every rank adds the same reduced value to its loss and DDP averages the gradients, so passing the gradient
    through unchanged yields exactly the gradient of the global quantity (as the official ``AllReduce``).
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        x = x.contiguous() / dist.get_world_size()  # a new tensor: the input is never modified
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def all_reduce_mean(x: Tensor) -> Tensor:
    """Autograd-aware mean of ``x`` over ranks (forward: mean, backward: identity); no-op in one process."""
    return _AllReduceMean.apply(x) if is_distributed() else x


@torch.no_grad()
def all_reduce_sum_(x: Tensor) -> Tensor:
    """Sum ``x`` over ranks in place, without autograd (Sinkhorn sums, prototype-gradient sums). Returns ``x``."""
    if is_distributed():
        if x.is_contiguous():
            dist.all_reduce(x)
        else:
            buf = x.contiguous()
            dist.all_reduce(buf)
            x.copy_(buf)
    return x


@torch.no_grad()
def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Give ``module`` rank ``src``'s parameters and buffers on every rank (no-op in one process).

    DDP does this for the network it wraps; a network it does not wrap (the EMA target) needs it too, or each rank
    would keep its own random initialisation (ranks seed differently, for different augmentations).
    """
    if is_distributed():
        for tensor in module.state_dict().values():  # detached views of the module's own storage
            dist.broadcast(tensor, src)


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj`` (e.g. its RNG states), in rank order, on every rank; ``[obj]`` in one process."""
    if not is_distributed():
        return [obj]
    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_min_int(value: int) -> int:
    """The smallest of every rank's ``value`` (e.g. a step count each rank derived from its own timing)."""
    return min(all_gather_object(int(value)))


def synchronize() -> None:
    """Wait for this process's queued GPU work (a no-op on CPU), so host clocks time what ran."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
