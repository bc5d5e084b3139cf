import json
import logging
import math
from contextlib import nullcontext

import numpy as np
import torch

from training.model.vit import build_encoder
from training.run.collapse import CollapseDetector, RunGeometry
from training.run.monitor import TrainingMonitor
from training.run.probe import KnnProbe, ProbeImages

K = 64


def _monitor(tmp_path, **kwargs):
    detector = CollapseDetector(RunGeometry(image_size=28, patch_size=7, num_prototypes=K, batch_size=32,
                                            sharpen_temperature=0.25, me_max_weight=1.0, lr=1e-3))
    return TrainingMonitor(tmp_path, enabled=True, total_steps=100, start_step=0, progress_bar=False,
                           detector=detector, **kwargs)


def _healthy(**changes):
    return {"loss": 1.0, "lr": 1e-3, "prototype_usage_entropy": math.log(K), "entropy": 2.0,
            "target_entropy": 2.5, "embedding_spread": 0.9, **changes}


def test_metrics_are_written_as_json_lines(tmp_path):
    monitor = _monitor(tmp_path)
    monitor.step(global_batch=32)
    record = monitor.log(1, 0, {"loss": 1.5, "lr": 1e-3})
    monitor.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written == record and written["loss"] == 1.5 and written["images_per_sec"] > 0


def test_collapse_is_warned_once_and_recorded_on_the_step_it_is_confirmed(tmp_path, caplog):
    monitor = _monitor(tmp_path)
    one_prototype = _healthy(prototype_usage_entropy=0.05 * math.log(K))
    with caplog.at_level(logging.WARNING, logger="msn.train"):
        for step in range(10, 60, 10):
            monitor.log(step, 0, _healthy())
        assert not caplog.records and monitor.collapse is None
        for step in range(60, 120, 10):  # confirmed on the second record, 10 steps after the first
            monitor.log(step, 0, one_prototype)
        for step in range(120, 140, 10):
            monitor.log(step, 0, _healthy())
        for step in range(140, 200, 10):
            monitor.log(step, 0, one_prototype)  # the same kind again: not warned twice
    monitor.close()
    assert len(caplog.records) == 1 and "me_max_weight" in caplog.records[0].getMessage()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flagged = [r for r in records if "collapse" in r]
    assert [r["step"] for r in flagged] == [70] and flagged[0]["collapse"] == "one_prototype"
    assert monitor.collapse.step == 70 and all("loss" in r and "images_per_sec" in r for r in records)


def test_should_stop_only_with_stop_on_collapse(tmp_path):
    uniform = _healthy(entropy=math.log(K) - 1e-4, target_entropy=0.99 * math.log(K))
    for stop in (False, True):
        (tmp_path / str(stop)).mkdir()
        monitor = _monitor(tmp_path / str(stop), stop_on_collapse=stop)
        decisions = []
        for step in range(10, 60, 10):
            monitor.log(step, 0, uniform)
            decisions.append(monitor.should_stop())
        monitor.close()
        assert monitor.collapse.kind == "uniform_targets" and monitor.collapse.step == 20
        assert decisions == ([False, True, True, True, True] if stop else [False] * 5)
        assert (monitor.stopped_by is not None) is stop


def _probe(every_steps):
    """A real KnnProbe on a tiny encoder and two separable classes of images (dark and bright)."""
    generator = torch.Generator().manual_seed(0)
    dark = torch.randint(0, 60, (12, 3, 8, 8), dtype=torch.uint8, generator=generator)
    bright = torch.randint(190, 255, (12, 3, 8, 8), dtype=torch.uint8, generator=generator)
    images = ProbeImages(torch.cat([dark[:8], bright[:8]]), np.array([0] * 8 + [1] * 8),
                         torch.cat([dark[8:], bright[8:]]), np.array([0] * 4 + [1] * 4), "test")
    encoder = build_encoder("vit_tiny", patch_size=4, image_size=8, embed_dim=16, depth=1, num_heads=2)
    prep = {"resize": 8, "crop": 8, "mean": [0.5] * 3, "std": [0.25] * 3}
    return KnnProbe(images, encoder, feature="cls_pre_norm", eval_preprocessing=prep, device=torch.device("cpu"),
                    autocast=nullcontext, every_steps=every_steps)


def test_probe_results_join_the_logged_record_bar_and_tensorboard(tmp_path):
    monitor = _monitor(tmp_path, probe=_probe(every_steps=20), tensorboard=True)
    for step in range(10, 50, 10):
        monitor.step(global_batch=8)
        monitor.log(step, 0, _healthy(), final=step == 40)
    monitor.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("knn20_top1" in r) for r in records] == [False, True, False, True]
    assert all(0.0 <= r["knn20_top1"] <= 100.0 and r["probe_seconds"] > 0 for r in records if "knn20_top1" in r)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("probe/knn20_top1")] == [20, 40]


def test_disabled_monitor_writes_nothing_and_never_probes(tmp_path):
    probe = _probe(every_steps=1)
    monitor = TrainingMonitor(tmp_path, enabled=False, total_steps=10, start_step=0, probe=probe)
    record = monitor.log(1, 0, _healthy(), final=True)
    monitor.close()
    assert record["step"] == 1 and probe.last_step is None and not (tmp_path / "metrics.jsonl").exists()


def test_a_warning_never_shares_a_line_with_the_progress_bar(tmp_path, monkeypatch):
    """While the bar is shown, a log line to the console goes through tqdm: on a line of its own, the bar drawn again
    below it; once the monitor is closed, the console handler is the run's own again."""
    import io
    import re
    import sys

    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)  # the bar's stream, and the console handler's
    handler = logging.StreamHandler(console)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        monitor = TrainingMonitor(tmp_path, enabled=True, total_steps=10, start_step=0, progress_bar=True)
        monitor.step(8)
        logging.getLogger("msn.train").warning("the run looks stalled")
        monitor.step(8)
        monitor.close()
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)
    lines = [seg for seg in re.split(r"[\r\n]", console.getvalue()) if "stalled" in seg]
    assert lines == ["the run looks stalled"], console.getvalue()
    assert "step" in console.getvalue()  # the bar was drawn
