"""Is a collapsing run reported early? The 8 px digits run that once "finished successfully" with uniform targets.

    python -m benchmarks.training.collapse_check                      # the old 8 px failure, 10-minute plan
    python -m benchmarks.training.collapse_check --recipe planned     # the same images, planned by --data alone
    python -m benchmarks.training.collapse_check --image-size 32      # the same recipe on upsampled digits
    python -m benchmarks.training.collapse_check --total-steps 2468  # the failing run's own length

scikit-learn's handwritten digits (1,797 grey 8 x 8 images, installed with scikit-learn: no download) are written
as one flat folder of PNGs with no labels, and pretrained with ``run.stop_on_collapse=true``:

- ``--recipe old`` (default) is the small-image recipe as it stood when the failure was seen (``OLD_RECIPE``,
  ``configs/fmnist_vit_tiny.yaml`` at that time, frozen here so later fixes to the shipped recipe do not hide the
  failure this reproduces) at ``model.image_size=8``: 2 px patches, views cropped from an 8 px image;
- ``--recipe planned`` gives the trainer only ``--data DIR`` and the budget, as a new user would.

The trainer plans ``--budget-minutes`` of steps (the denominator; ``--total-steps N`` fixes it instead, so that a
loaded machine's slower calibration does not move it) and stops at the step the collapse detector
(``training/run/collapse.py``) confirms a collapse; a run that is not flagged is ended by this script at
``--max-fraction`` of its planned steps (the detector's job is to speak early), so the script never runs the
whole budget. Reported: the flagged step, the planned total, their ratio, the detector's message, and the wall
time. The result goes to ``benchmarks/results/collapse_check-old-<size>px.json`` or ``collapse_check-planned.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import REPO, RESULTS, save_json

# The small-image recipe when 8 px digits collapsed with it (configs/fmnist_vit_tiny.yaml then; data made generic).
OLD_RECIPE = {
    "model": {"arch": "vit_tiny", "image_size": 28, "patches_per_side": 4, "depth": 4, "drop_path_rate": 0.0,
              "head_hidden_dim": 1024, "head_out_dim": 256, "num_prototypes": 1024, "feature": "cls_patch_tokens"},
    "data": {"load_size": None, "batch_size": 64, "num_workers": 0, "eval_resize_ratio": 1.0},
    "mask": {"ratio": 0.3, "shared": True, "num_focal": 0, "rand_crop_scale": [0.3, 1.0]},
    "augment": {"color_jitter_strength": 0.5},
    "loss": {"temperature": 0.1, "sharpen_start": 0.25, "sharpen_end": 0.25, "me_max_weight": 1.0,
             "use_sinkhorn": True},
    "optim": {"epochs": 1, "warmup_epochs": 0.1, "start_lr": 2.0e-4, "lr": 2.5e-4, "final_lr": 1.0e-6,
              "weight_decay": 0.04, "final_weight_decay": 0.4, "ema_start": 0.99, "ema_end": 1.0,
              "horizon_scale": 1.0, "clip_grad": 3.0},
    "run": {"checkpoint_every_steps": 100, "log_every_steps": 10},
}
PLANNED_STEPS = re.compile(r"(\d+) steps \(\d+ warm-up\)")


def write_digits(out: Path, *, limit: int | None = None) -> int:
    """scikit-learn's digits as ``out/NNNN.png`` (8 x 8 grey, 0-16 scaled to 0-255), no labels; returns the count."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    images = load_digits().images[:limit]
    out.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        pixels = np.clip(np.rint(image * (255 / 16)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(out / f"{i:04d}.png")
    return len(images)


def pretrain_command(images: Path, output_dir: Path, *, recipe: str, image_size: int, budget_minutes: float,
                     total_steps: int | None, seed: int, extra: list[str] = ()) -> list[str]:
    length = ([f"optim.budget_minutes={budget_minutes}"] if total_steps is None else
              ["optim.budget_minutes=null", f"optim.total_steps={total_steps}"])
    sets = [*length, "run.stop_on_collapse=true", "run.progress_bar=false", f"run.seed={seed}", *extra]
    command = [sys.executable, str(REPO / "training" / "pretrain.py"), "--data", str(images),
               "--output-dir", str(output_dir)]
    if recipe == "old":
        config = output_dir.parent / "old_recipe.yaml"
        config.write_text(yaml.safe_dump(OLD_RECIPE, sort_keys=False))
        command += ["--config", str(config)]
        sets.append(f"model.image_size={image_size}")
    return command + ["--set", *sets]


def run_check(images: Path, work: Path, *, recipe: str = "old", image_size: int = 8, budget_minutes: float = 10,
              total_steps: int | None = None, max_fraction: float = 0.1, seed: int = 0, extra: list[str] = (),
              timeout: float = 3600) -> dict:
    """Pretrain on ``images`` until a collapse is flagged or ``max_fraction`` of the planned steps; the result."""
    output_dir = work / "run"
    command = pretrain_command(images, output_dir, recipe=recipe, image_size=image_size,
                               budget_minutes=budget_minutes, total_steps=total_steps, seed=seed, extra=extra)
    start = time.monotonic()
    log_path = work / "pretrain.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        total, cut_at = _watch(proc, log_path, output_dir / "metrics.jsonl", max_fraction, start + timeout)
    wall = time.monotonic() - start
    records = _records(output_dir / "metrics.jsonl")
    flagged = next((r for r in records if "collapse" in r), None)
    result = {
        "recipe": recipe, "image_size": image_size, "seed": seed,
        "length": f"{total_steps} steps" if total_steps else f"{budget_minutes:g}-minute budget",
        "images": sum(1 for _ in images.iterdir()), "planned_steps": total,
        "last_step": records[-1]["step"] if records else 0, "exit_code": proc.returncode,
        "ended_by": "collapse" if flagged else ("this script" if cut_at else "the trainer"),
        "flagged_step": flagged["step"] if flagged else None,
        "flagged_fraction": flagged["step"] / total if flagged and total else None,
        "kind": flagged["collapse"] if flagged else None,
        "message": flagged["collapse_message"] if flagged else None,
        "wall_seconds": round(wall, 1), "command": [str(c) for c in command[1:]],
        "log_tail": log_path.read_text()[-1500:] if proc.returncode not in (0, 1) and not cut_at else None,
    }
    # the detector's signals over the run (training/run/collapse.py): step, information (nats), target uniformity
    config = yaml.safe_load((output_dir / "config.yaml").read_text()) if (output_dir / "config.yaml").exists() else {}
    log_k = math.log(config["model"]["num_prototypes"]) if config else None
    result["signals"] = [[r["step"], round(r["prototype_usage_entropy"] - r["entropy"], 5),
                          round(r["target_entropy"] / log_k, 4) if log_k else None] for r in records]
    if records:
        last = records[-1]
        result["last_record"] = {k: last[k] for k in ("loss", "target_entropy", "entropy", "prototype_usage_entropy",
                                                      "grad_norm", "embedding_spread") if k in last}
    return result


def _watch(proc: subprocess.Popen, log_path: Path, metrics: Path, max_fraction: float,
           deadline: float) -> tuple[int | None, bool]:
    """Wait for the trainer; end it once it passes ``max_fraction`` of its planned steps unflagged."""
    total = None
    while proc.poll() is None:
        time.sleep(1.0)
        if total is None:
            found = PLANNED_STEPS.search(log_path.read_text())
            total = int(found.group(1)) if found else None
        records = _records(metrics)
        past = total is not None and records and records[-1]["step"] >= max_fraction * total
        if (past and not any("collapse" in r for r in records)) or time.monotonic() > deadline:
            proc.terminate()
            proc.wait(timeout=60)
            return total, True
    if total is None:
        found = PLANNED_STEPS.search(log_path.read_text())
        total = int(found.group(1)) if found else None
    return total, False


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("old", "planned"), default="old")
    parser.add_argument("--image-size", type=int, default=8, help="model.image_size with --recipe old")
    parser.add_argument("--budget-minutes", type=float, default=10.0, help="the planned run (the denominator)")
    parser.add_argument("--total-steps", type=int, help="plan this many steps instead of a budget (a fixed "
                        "denominator, e.g. the 2,468 steps 10 minutes gave on the AVX2 machine the failure was "
                        "seen on)")
    parser.add_argument("--max-fraction", type=float, default=0.1,
                        help="end an unflagged run at this fraction of its planned steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary folder")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/collapse_check-<old-Npx|planned>.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="collapse_check-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        images = work / "digits"
        if not images.is_dir():
            write_digits(images)
        result = run_check(images, work, recipe=args.recipe, image_size=args.image_size,
                           budget_minutes=args.budget_minutes, total_steps=args.total_steps,
                           max_fraction=args.max_fraction, seed=args.seed)
    name = f"old-{args.image_size}px" if args.recipe == "old" else "planned"
    out = args.out or RESULTS / f"collapse_check-{name}.json"
    save_json(out, result)
    flagged = (f"flagged at step {result['flagged_step']} of {result['planned_steps']} planned "
               f"({100 * result['flagged_fraction']:.1f} %)" if result["flagged_step"] else "not flagged")
    print(f"collapse_check ({name}): {flagged}; ended by {result['ended_by']} at step "
          f"{result['last_step']} after {result['wall_seconds']:.0f} s")
    if result["message"]:
        print(result["message"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
