"""Training telemetry on rank 0: a progress bar, ``metrics.jsonl``, optional TensorBoard, collapse warnings.

MSN collapses in two recognisable ways: every image maps to the same few prototypes (the entropy of the mean
prediction falls towards 0) or every image maps to the same embedding (the per-dimension spread of the
normalised target embeddings falls towards 0). Both are cheap to watch at every logged step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger("msn.train")

# Fractions of their healthy values below which we call it collapse.
MIN_PROTOTYPE_USAGE = 0.15  # entropy of the mean prediction / log(K)
MIN_EMBEDDING_SPREAD = 0.1  # std of normalised embeddings * sqrt(d); ~1 for well-spread embeddings


class TrainingMonitor:
    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        num_prototypes: int,
        progress_bar: bool = True,
        tensorboard: bool = False,
    ):
        self.enabled = enabled
        self.num_prototypes = num_prototypes
        self.collapse_warned = False
        self._last_time = time.perf_counter()
        self._last_step = start_step
        self._images_since = 0
        self.bar = None
        self.writer = None
        if not enabled:
            return
        self.metrics_file = open(output_dir / "metrics.jsonl", "a")  # noqa: SIM115 (open for the whole run)
        if progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def step(self, global_batch: int) -> None:
        self._images_since += global_batch
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, epoch: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write one metrics record; returns it (images/s included)."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        record = {"step": step, "epoch": epoch, **values, "images_per_sec": self._images_since / elapsed}
        self._last_time, self._last_step, self._images_since = now, step, 0
        if not self.enabled:
            return record
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", img_s=f"{record['images_per_sec']:.0f}"
            )
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.writer.add_scalar(f"train/{key}", value, step)
        self._check_collapse(step, record)
        return record

    def _check_collapse(self, step: int, record: dict[str, Any]) -> None:
        usage = record.get("prototype_usage_entropy", math.log(self.num_prototypes)) / math.log(self.num_prototypes)
        spread = record.get("embedding_spread", 1.0)
        if usage < MIN_PROTOTYPE_USAGE or spread < MIN_EMBEDDING_SPREAD:
            if not self.collapse_warned:
                log.warning(
                    "step %d: training looks collapsed (prototype usage %.3f of log K, embedding spread %.3f): "
                    "check the learning rate, me-max weight and sharpening temperature",
                    step,
                    usage,
                    spread,
                )
            self.collapse_warned = True
        else:
            self.collapse_warned = False

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.metrics_file.close()
