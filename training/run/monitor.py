"""Watching a run, on rank 0: a progress bar, ``metrics.jsonl``, optional TensorBoard, a kNN probe, collapse and
stalls.

Every logged step writes one JSON record (loss terms, schedules, images/s, the collapse statistics). Three watchers
add to the same record, so a reader of ``metrics.jsonl`` sees one line per logged step, always with the same core:

- the kNN probe (``training/run/probe.py``), when labels are available: ``knn20_top1`` and ``probe_seconds`` on
  the steps it ran (every ``run.probe_every_steps`` and the last), also on the progress bar and in TensorBoard;
- the collapse detector (``training/run/collapse.py``), with or without labels: ``collapse`` and
  ``collapse_message`` on the step a collapse is confirmed, logged once as a warning. With ``run.stop_on_collapse``
  every rank agrees to stop there (``should_stop``: one tiny collective per logged step, only with that setting);
- the view probe (``training/run/view_probe.py``), with or without labels: ``view_top1``, ``view_margin`` (and
  their ``_cls`` forms), ``feature_rank``, the same at the run's start (``_start``) and ``view_seconds``, about
  every 1 % of the run;
- the stall detector (``training/run/stall.py``), with or without labels: ``stall`` and ``stall_message`` on the
  step a stall is confirmed, logged once as a warning. A stall never stops the run: it may still be worth finishing.

While the progress bar is shown, log records to the console go through tqdm (``logging_redirect_tqdm``: the bar is
cleared, the line written, the bar drawn again below it), so a warning never shares a line with the bar.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from msn_core.optional import require
from training import distributed as dist
from training.run.collapse import Collapse, CollapseDetector
from training.run.probe import KnnProbe
from training.run.stall import Stall, StallDetector
from training.run.view_probe import ViewProbe

log = logging.getLogger("msn.train")


class TrainingMonitor:
    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress_bar: bool = True,
        tensorboard: bool = False,
        detector: CollapseDetector | None = None,
        probe: KnnProbe | None = None,
        stop_on_collapse: bool = False,
        stall_detector: StallDetector | None = None,
        view_probe: ViewProbe | None = None,
    ):
        self.enabled = enabled
        self.detector = detector if enabled else None
        self.probe = probe if enabled else None
        self.stop_on_collapse = stop_on_collapse
        self.collapse: Collapse | None = None  # the first collapse confirmed (rank 0)
        self.stall_detector = stall_detector if enabled else None
        self.view_probe = view_probe if enabled else None
        self.stall: Stall | None = None  # the stall confirmed (rank 0)
        self.stopped_by: Collapse | str | None = None  # set on every rank when should_stop() says stop
        self._last_time = time.perf_counter()
        self._images_since = 0
        self._postfix: dict[str, str] = {}
        self.bar = None
        self.writer = None
        self._console = ExitStack()  # the logging redirection while the bar is shown
        if not enabled:
            return
        self.metrics_file = open(output_dir / "metrics.jsonl", "a")  # noqa: SIM115 (open for the whole run)
        if progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            self._console.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))
        if tensorboard:
            require("tensorboard", "run.tensorboard=true")  # torch.utils.tensorboard's own error names no install
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def step(self, global_batch: int) -> None:
        self._images_since += global_batch
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, epoch: int, values: dict[str, Any], *, final: bool = False) -> dict[str, Any]:
        """Write one metrics record, with a probe when one is due (always on the ``final`` step) and any collapse or
        stall confirmed; returns it. images/s counts the training time since the last record, not the probe's."""
        extra: dict[str, Any] = {}
        if self.probe is not None:
            result = self.probe.maybe(step, final=final)
            if result is not None:
                extra.update(result.record())
        if self.view_probe is not None:
            signals = self.view_probe.maybe(step)
            if signals is not None:
                extra.update(signals.record(self.view_probe.start))
        now = time.perf_counter()
        probed = extra.get("probe_seconds", 0.0) + extra.get("view_seconds", 0.0)
        elapsed = max(now - self._last_time - probed, 1e-9)
        record = {"step": step, "epoch": epoch, **values, "images_per_sec": self._images_since / elapsed, **extra}
        self._last_time, self._images_since = now, 0
        if not self.enabled:
            return record
        if self.detector is not None:
            collapse = self.detector.update(step, record)
            if collapse is not None:
                record.update(collapse.record())
                self.collapse = self.collapse or collapse
                log.warning("%s", collapse.message)
        if self.stall_detector is not None:
            stall = self.stall_detector.update(step, record)
            if stall is not None:
                record.update(stall.record())
                self.stall = stall
                log.warning("%s", stall.message)
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self._show(step, record)
        return record

    def _show(self, step: int, record: dict[str, Any]) -> None:
        knn = next((key for key in record if key.startswith("knn") and key.endswith("_top1")), None)
        if self.bar is not None:
            self._postfix.update(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                 img_s=f"{record['images_per_sec']:.0f}")
            if knn is not None:
                self._postfix[knn.removesuffix("_top1")] = f"{record[knn]:.1f}%"
            if "collapse" in record:
                self._postfix["collapse"] = record["collapse"]
            if "stall" in record:
                self._postfix["stall"] = record["stall"]
            self.bar.set_postfix(self._postfix)
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    probed = key in (knn, "probe_seconds", "feature_rank") or key.startswith("view_")
                    group = "probe" if probed else "train"
                    self.writer.add_scalar(f"{group}/{key}", value, step)
            if "collapse" in record:
                self.writer.add_text("collapse", record["collapse_message"], step)
            if "stall" in record:
                self.writer.add_text("stall", record["stall_message"], step)

    def should_stop(self) -> bool:
        """True on every rank once rank 0 confirmed a collapse and ``run.stop_on_collapse`` is set. Call it on
        every rank at every logged step: with that setting it is a collective (ranks agree to stop together)."""
        if not self.stop_on_collapse:
            return False
        if dist.all_reduce_min_int(0 if self.collapse is not None else 1) == 0:
            self.stopped_by = self.collapse or "collapse on rank 0"
            return True
        return False

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
        self._console.close()
        if self.writer is not None:
            self.writer.close()
        self.metrics_file.close()
