import json
import logging
import math

from training.run.monitor import TrainingMonitor


def _monitor(tmp_path):
    return TrainingMonitor(tmp_path, enabled=True, total_steps=10, start_step=0, num_prototypes=64, progress_bar=False)


def test_metrics_are_written_as_json_lines(tmp_path):
    monitor = _monitor(tmp_path)
    monitor.step(global_batch=32)
    record = monitor.log(1, 0, {"loss": 1.5, "lr": 1e-3})
    monitor.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written == record and written["loss"] == 1.5 and written["images_per_sec"] > 0


def test_collapse_warns_once_then_rearms(tmp_path, caplog):
    monitor = _monitor(tmp_path)
    healthy = {"loss": 1.0, "lr": 1e-3, "prototype_usage_entropy": math.log(64), "embedding_spread": 0.9}
    collapsed_protos = dict(healthy, prototype_usage_entropy=0.05 * math.log(64))
    collapsed_embeddings = dict(healthy, embedding_spread=0.01)
    with caplog.at_level(logging.WARNING, logger="msn.train"):
        monitor.log(1, 0, healthy)
        assert not caplog.records
        monitor.log(2, 0, collapsed_protos)
        monitor.log(3, 0, collapsed_protos)
        assert len(caplog.records) == 1 and "collapsed" in caplog.records[0].getMessage()
        monitor.log(4, 0, healthy)
        monitor.log(5, 0, collapsed_embeddings)
        assert len(caplog.records) == 2
    monitor.close()
