"""Write one of our training checkpoints in the layout of the released facebookresearch/msn weights.

    python -m training.bundle.to_official runs/demo/checkpoint.pt --out demo-msn.pth.tar [--no-module-prefix]

The file holds ``target_encoder`` (trunk + projection head ``fc.*``, fused ``attn.qkv``, ``module.`` keys) and
``prototypes``, as the released ``vits16_800ep.pth.tar`` and friends do: the official evaluation scripts,
HuggingFace's converter, ``msn-export --from-official`` and ``pretrain.py --init-from`` all read it. The mapping is
:func:`training.bundle.convert.checkpoint_to_official`; the file is written atomically.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from msn_core.durable import atomic_write
from training.bundle.convert import checkpoint_to_official
from training.bundle.sources import _torch_load

__all__ = ["main", "write_official"]


def write_official(checkpoint_path: str | Path, out: str | Path, *, ddp_prefix: bool = True) -> dict:
    """Convert ``checkpoint_path`` (written by ``training/pretrain.py``) to ``out``; returns what was written."""
    official = checkpoint_to_official(_torch_load(Path(checkpoint_path)), ddp_prefix=ddp_prefix)
    atomic_write(out, lambda f: torch.save(official, f))
    return official


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.bundle.to_official", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint.pt written by training/pretrain.py")
    parser.add_argument("--out", type=Path, required=True, help="the .pth.tar file to write")
    parser.add_argument("--no-module-prefix", action="store_true",
                        help="keys without 'module.' (a single-GPU official run); default: with it, as released")
    args = parser.parse_args(argv)
    if not args.checkpoint.is_file():
        raise SystemExit(f"to_official: checkpoint not found: {args.checkpoint}")
    try:
        official = write_official(args.checkpoint, args.out, ddp_prefix=not args.no_module_prefix)
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise SystemExit(f"to_official: {args.checkpoint}: {message}") from None
    num_prototypes, dim = official["prototypes"].shape
    print(f"wrote {args.out}: target_encoder ({len(official['target_encoder'])} tensors), "
          f"prototypes {num_prototypes} x {dim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
