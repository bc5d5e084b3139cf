"""The untrained control: a bundle's architecture and preprocessing with randomly initialised weights.

What MSN's training added to a bundle is the difference between the bundle's score and the score of its untrained
twin: the same ``VisionTransformer`` (``msn.json``'s architecture), initialised under ``torch.manual_seed(seed)``
and nothing else, exported with the same preprocessing and feature, then measured with the same protocol. One
implementation writes every such bundle: the benchmark plans' ``random_init`` bundles (:func:`export_untrained`)
and the twins ``msn-eval --untrained [SEED]`` measures, which :mod:`training.evaluation.untrained` asks for in a
process of their own, since evaluation reads bundles and never imports the code that writes them::

    python -m training.bundle.untrained --bundle bundles/demo --seed 0 --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from msn_core.bundle import META_FILE, BundleInfo, load_bundle_info
from msn_core.durable import fsync_path
from training.bundle.export import export_bundle
from training.model.vit import VisionTransformer

__all__ = ["SOURCE_KIND", "export_twin", "export_untrained", "main", "untrained_encoder"]

SOURCE_KIND = "random-init"  # msn.json's source.kind of an untrained twin


def untrained_encoder(info: BundleInfo, seed: int) -> VisionTransformer:
    """``VisionTransformer(**architecture)`` initialised under ``torch.manual_seed(seed)``; the caller's RNG state
    is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VisionTransformer(**info.architecture.encoder_kwargs())


def export_untrained(reference: str | os.PathLike, out: str | os.PathLike, *, seed: int, feature: str | None = None,
                     parity_check: bool = True) -> dict:
    """Export the untrained twin of the bundle ``reference`` to ``out`` (atomically, as every export) and return
    its ``msn.json``; ``feature``: the graph's output (default: the reference's feature)."""
    info = load_bundle_info(reference)
    return export_bundle(untrained_encoder(info, seed), out, arch=info.architecture.name,
                         preprocessing=info.preprocessing.to_dict(), feature=feature or info.feature,
                         parity_check=parity_check, source_kind=SOURCE_KIND)


def export_twin(reference: str | os.PathLike, out: str | os.PathLike, *, seed: int) -> Path:
    """The untrained twin of ``reference`` (its feature) at ``out``, kept when already there.

    Exported to a private temporary directory beside ``out`` and renamed into place, so a reader never sees half a
    bundle, and when two processes export the same twin at once the first rename wins and both use its copy.
    """
    out = Path(out)
    if (out / META_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        export_untrained(reference, work / "bundle", seed=seed)
        try:
            os.rename(work / "bundle", out)
        except OSError:  # another process renamed its copy first
            if not (out / META_FILE).is_file():
                raise
        fsync_path(out.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.bundle.untrained", description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the bundle whose untrained twin to export")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the initialisation")
    parser.add_argument("--out", type=Path, required=True, help="the twin's directory (kept when already there)")
    args = parser.parse_args(argv)
    try:
        export_twin(args.bundle, args.out, seed=args.seed)
    except (OSError, ValueError, RuntimeError) as exc:
        raise SystemExit(f"untrained twin of {args.bundle}: error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
