"""The speed settings besides the precision that ``auto`` may time: CPU attention in bf16 and torch's CPU threads.

Each setting is an :class:`Options` decided by the one precedence ladder (``training/run/precedence.py``: set by you,
resumed, the rule): its candidates (one when nothing is worth timing, with the reason) and the value the flag rule
gives when the run is not timed. ``training/run/precision_timing.py`` times every combination of the
candidates on the run's own steps, in the same pass as the precision, and keeps the fastest.

* ``run.cpu_attention`` (``training/model/vit.py``): bf16 attention on a CPU as an explicit softmax with fp32 logits
  or PyTorch's fused ``scaled_dot_product_attention``. The explicit form won on a Zen 4 (the fused CPU kernel was
  ~2.5x slower forward + backward at 197 and 37 tokens), but on an AMX Xeon our ViT-S/16 step fell to x0.88 of the
  official step in bf16 with it, so the flag rule (explicit) is only the fallback. fp32 and CUDA always run SDPA:
  there is nothing to choose.
* ``run.cpu_threads``: torch picks its intra-op threads from the cores this process may use (or ``OMP_NUM_THREADS``,
  which torchrun sets to 1 for several processes per node). Data loader workers decode on the same cores, so one
  thread fewer can be faster; without workers, or with one thread, there is nothing to time.
* ``run.compile`` is never timed: it is off unless you set it, and compiling the step takes minutes on a CPU, more
  than the few seconds a timing window may cost.
"""
from __future__ import annotations

from typing import Any

import torch

from training.config import Config
from training.run.precedence import Options, Resumed, decide

__all__ = ["Options", "attention_options", "thread_options", "torch_default_threads"]

FLAG_ATTENTION = "explicit"  # what ``auto`` is when not timed: measured faster on a Zen 4 (vit.explicit_attention)


def attention_options(cfg: Config, device: torch.device, precisions: tuple[str, ...], *,
                      stored: dict[str, Any] | None = None) -> Options | None:
    """``run.cpu_attention``'s candidates (``training/run/precedence.py``'s ladder); None on a GPU (SDPA, the setting
    does not apply). ``precisions``: the precision's candidates; ``stored``: a resumed checkpoint's ``run`` config
    section (None: not resumed)."""
    key = "run.cpu_attention"
    if device.type != "cpu":
        return None
    resumed = None
    if stored is not None:
        kept = stored.get("cpu_attention")
        resumed = Resumed(kept if kept in ("explicit", "sdpa") else None, "the resumed checkpoint's; not timed "
                          "again, so the run continues bit-exactly", FLAG_ATTENTION, "resumed from a checkpoint that "
                          "records none: the flag rule; not timed")
    if "bf16" not in precisions:
        rule = Options(key, (FLAG_ATTENTION,), FLAG_ATTENTION, "not timed: fp32 attention is SDPA, this setting is "
                       "for bf16 only")
    else:
        rule = Options(key, ("explicit", "sdpa"), FLAG_ATTENTION, "explicit (fp32 logits) by the flag rule, "
                       "measured faster on a Zen 4; not timed")
    return decide(key, cfg.run.cpu_attention, auto="auto", rule=rule, resumed=resumed)


def torch_default_threads() -> int:
    """The intra-op threads torch starts a process with (the cores it may use, or ``OMP_NUM_THREADS``)."""
    return torch.get_num_threads()


def thread_options(cfg: Config, device: torch.device, *, stored: dict[str, Any] | None = None,
                   default: int | None = None) -> Options | None:
    """``run.cpu_threads``'s candidates (the same ladder); None on a GPU (the step runs there). ``default``: the
    threads torch gave this process (read now when None); ``stored`` as for :func:`attention_options`."""
    key = "run.cpu_threads"
    if device.type != "cpu":
        return None
    default = default or torch_default_threads()
    kept = "the resumed checkpoint's; not timed again"
    resumed = None if stored is None else Resumed(stored.get("cpu_threads") or None, kept, default, kept)
    why = f"torch's default for this process ({default})"
    if cfg.data.num_workers == 0:
        rule = Options(key, (default,), default, f"{why}; not timed: no data loader workers share the cores")
    elif default == 1:
        rule = Options(key, (1,), 1, f"{why}; not timed: one thread")
    else:
        rule = Options(key, (default, default - 1), default, f"{why}; not timed")
    return decide(key, cfg.run.cpu_threads, auto=0, rule=rule, resumed=resumed)
