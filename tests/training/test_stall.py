"""The stall detector: its rule on recorded and synthetic logged signals (a stalled run is warned within the first
10 % of its steps, a healthy one never, noise trips nothing), the monitor's record and warning, and a real tiny
training with a planted tiny learning rate."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

from training.run.monitor import TrainingMonitor
from training.run.stall import StallDetector, StallSettings

REPO = Path(__file__).resolve().parents[2]
K = 1024
LOG_K = math.log(K)

# Fashion-MNIST, the demo recipe (configs/fmnist_vit_tiny.yaml, 2,850 planned steps) with optim.lr and start_lr
# 100x smaller, as logged (step, loss, target_entropy, entropy): the loss hardly leaves log K, the targets flatten.
LR_100X_SMALLER = [
    (10, 6.901, 5.419, 6.738), (20, 6.947, 5.392, 6.736), (30, 6.9, 5.407, 6.738), (40, 6.912, 5.432, 6.739),
    (50, 6.92, 5.428, 6.739), (60, 6.973, 5.439, 6.739), (70, 6.823, 5.439, 6.743), (80, 6.872, 5.52, 6.741),
    (90, 6.848, 5.467, 6.742), (100, 6.897, 5.459, 6.741), (110, 6.846, 5.475, 6.742), (120, 6.842, 5.506, 6.743),
    (130, 6.831, 5.475, 6.744), (140, 6.876, 5.486, 6.743), (150, 6.885, 5.48, 6.743), (160, 6.816, 5.517, 6.742),
    (170, 6.779, 5.49, 6.743), (180, 6.815, 5.497, 6.745), (190, 6.807, 5.528, 6.743), (200, 6.755, 5.583, 6.743),
    (210, 6.769, 5.539, 6.742), (220, 6.807, 5.518, 6.743), (230, 6.764, 5.568, 6.742), (240, 6.789, 5.536, 6.742),
    (250, 6.696, 5.59, 6.74), (260, 6.831, 5.538, 6.741), (270, 6.764, 5.576, 6.739), (280, 6.755, 5.559, 6.742),
]
# The same recipe at its own learning rate, as logged: the targets first flatten, the loss falls from the start.
HEALTHY = [
    (10, 6.772, 5.419, 6.745), (20, 6.705, 5.472, 6.744), (30, 6.589, 5.55, 6.699), (40, 6.604, 5.604, 6.66),
    (50, 6.493, 5.627, 6.629), (60, 6.652, 5.589, 6.593), (70, 6.473, 5.61, 6.583), (80, 6.468, 5.646, 6.511),
    (90, 6.41, 5.598, 6.53), (100, 6.516, 5.603, 6.524), (110, 6.467, 5.672, 6.529), (120, 6.301, 5.56, 6.502),
    (130, 6.381, 5.551, 6.482), (140, 6.476, 5.479, 6.472), (150, 6.377, 5.471, 6.45), (160, 6.38, 5.369, 6.422),
    (170, 6.196, 5.293, 6.381), (180, 6.251, 5.258, 6.309), (190, 6.166, 5.21, 6.305), (200, 6.081, 5.193, 6.253),
    (210, 6.201, 5.158, 6.236), (220, 6.239, 5.103, 6.255), (230, 6.015, 5.073, 6.198), (240, 6.08, 5.041, 6.197),
    (250, 5.956, 5.057, 6.13), (260, 6.215, 4.982, 6.149), (270, 5.985, 5.0, 6.059), (280, 5.91, 4.968, 6.083),
]


def _detector(total_steps=2850, lr=2.5e-4, batch=64, k=K, start_step=0, easy_views=False, small_images=True):
    views = {"crop_min": 0.6, "mask_ratio": 0.15, "photometric": False} if easy_views else {}
    views["small_images"] = small_images
    return StallDetector(StallSettings(num_prototypes=k, global_batch=batch, lr=lr, sharpen_start=0.25,
                                       sharpen_end=0.25, **views),
                         total_steps=total_steps, start_step=start_step)


def _record(loss, target_entropy, entropy):
    return {"loss": loss, "target_entropy": target_entropy, "entropy": entropy}


def _feed(detector, rows):
    """(step, loss, target_entropy, entropy) rows in; the stalls found, by step."""
    return [s for s in (detector.update(step, _record(*values)) for step, *values in rows) if s is not None]


def test_a_recorded_stall_is_warned_within_a_tenth_of_the_run_and_names_the_learning_rate():
    found = _feed(_detector(lr=2.5e-6), LR_100X_SMALLER)
    assert len(found) == 1 and found[0].step <= 0.1 * 2850 and found[0].cause == "learning_rate"
    message = found[0].message
    assert "--set optim.lr=0.00025 optim.start_lr=0.0002" in message and "100x below" in message
    assert found[0].record() == {"stall": "learning_rate", "stall_message": message}


def test_the_recorded_healthy_start_is_not_warned():
    assert not _feed(_detector(), HEALTHY)


def test_a_stall_at_the_rule_s_learning_rate_points_at_the_views_then_the_target_temperature():
    found = _feed(_detector(), LR_100X_SMALLER)  # the same signals, but the learning rate is the rule's
    assert found[0].cause == "views"
    assert ("--set mask.rand_crop_scale=[0.6,1.0] mask.ratio=0.15 augment.color_jitter_p=0 augment.grayscale_p=0 "
            "augment.blur_p=0") in found[0].message and "crops from 30% of the area" in found[0].message
    for detector in (_detector(easy_views=True), _detector(small_images=False)):  # views that keep most of the
        found = _feed(detector, LR_100X_SMALLER)  # image, or large images, where the views were never measured
        assert found[0].cause == "targets" and "loss.sharpen_start=0.15 loss.sharpen_end=0.15" in found[0].message


def _synthetic(total, *, learning, seed, noise=0.08, every=10):
    """A run's logged signals: the loss falls from near log K towards ~75 % of it (learning) or stays near it, the
    targets flatten a little first and then sharpen (learning) or not; Gaussian noise of ``noise`` nats."""
    rng = random.Random(seed)
    rows = []
    for step in range(every, total + 1, every):
        drop = 0.02 + 0.24 * (1 - math.exp(-step / 700)) if learning else 0.012  # the recorded runs' envelopes
        flatten = 0.15 * math.exp(-((step - 100) / 60) ** 2)
        sharpen = 1.6 * (1 - math.exp(-max(0, step - 150) / 900)) if learning else 0.0
        rows.append((step, LOG_K * (1 - drop) + rng.gauss(0, noise), 5.42 + flatten - sharpen + rng.gauss(0, noise),
                     6.74 - (1.5 * (1 - math.exp(-step / 700)) if learning else 0.0) + rng.gauss(0, 0.01)))
    return rows


def test_healthy_synthetic_runs_are_never_warned_and_stalled_ones_always_early():
    for seed in range(20):
        assert not _feed(_detector(total_steps=2850), _synthetic(2850, learning=True, seed=seed))
        found = _feed(_detector(total_steps=2850), _synthetic(2850, learning=False, seed=seed))
        assert len(found) == 1 and found[0].step <= 285


def test_a_loss_coming_down_from_above_log_k_is_learning():
    # a small head's confident random predictions start the loss far above log K (a 16-d head, K = 32: 4.9 against
    # 3.47); coming down to log K is progress, sitting up there is not
    log_k = math.log(32)
    falling = [(step, 4.9 - 1.5 * (1 - math.exp(-step / 60)), 1.7, 2.5) for step in range(10, 400, 10)]
    assert min(loss for _, loss, _, _ in falling[10:]) > (1 - 0.03) * log_k
    assert not _feed(_detector(total_steps=1200, batch=8, k=32), falling)
    stuck = [(step, 4.9 + 0.3 * math.sin(step), 1.7, 1.8) for step in range(10, 400, 10)]
    assert _feed(_detector(total_steps=1200, batch=8, k=32), stuck)


def test_noisy_records_alone_neither_warn_nor_hide_a_stall():
    # single wild batches (a loss spike back to log K + 1 among healthy records) do not move a window's median
    rows = _synthetic(1000, learning=True, seed=1)
    rows = [(s, LOG_K + 1, h, e) if s % 70 == 0 else (s, loss, h, e) for s, loss, h, e in rows]
    assert not _feed(_detector(total_steps=1000), rows)
    # ... nor do single lucky ones (a loss well below) inside a stall
    rows = _synthetic(1000, learning=False, seed=2)
    rows = [(s, 5.0, h, e) if s % 70 == 0 else (s, loss, h, e) for s, loss, h, e in rows]
    assert _feed(_detector(total_steps=1000), rows)


def test_the_check_waits_for_a_share_of_the_run_and_a_resumed_run_is_not_checked():
    flat = [(step, LOG_K - 0.02, 5.4, 6.74) for step in range(10, 3001, 10)]
    assert _feed(_detector(total_steps=100), flat)[0].step == 110  # at least 100 steps in, then 2 checks
    assert _feed(_detector(total_steps=40_000), flat)[0].step == 2010  # 5 % of the planned steps
    assert not _feed(_detector(start_step=500), flat)


def test_records_without_the_statistics_are_skipped():
    detector = _detector()
    assert all(detector.update(step, {"loss": 6.9}) is None for step in range(10, 400, 10))
    assert all(detector.update(step, _record(float("nan"), 5.4, 6.7)) is None for step in range(400, 800, 10))


def test_the_monitor_logs_the_stall_once_and_records_it(tmp_path, caplog):
    monitor = TrainingMonitor(tmp_path, enabled=True, total_steps=2850, start_step=0, progress_bar=False,
                              stall_detector=_detector(lr=2.5e-6))
    with caplog.at_level(logging.WARNING, logger="msn.train"):
        for step, loss, target_entropy, entropy in LR_100X_SMALLER:
            monitor.log(step, 0, {"lr": 2.5e-6, **_record(loss, target_entropy, entropy)})
    monitor.close()
    assert len(caplog.records) == 1 and "training has stalled" in caplog.records[0].getMessage()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flagged = [r for r in records if "stall" in r]
    assert len(flagged) == 1 and flagged[0]["step"] == monitor.stall.step and flagged[0]["stall"] == "learning_rate"


# ---------------------------------------------------------------------------------------------- a real run

TINY = [
    "data.source=synthetic", "data.synthetic_size=64", "data.load_size=16", "data.batch_size=8",
    "data.num_workers=0", "model.arch=vit_tiny", "model.image_size=16", "model.patch_size=4",
    "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.head_hidden_dim=64",
    "model.head_out_dim=16", "model.num_prototypes=32", "mask.focal_size=8", "mask.num_focal=2",
    "mask.ratio=0.5", "run.log_every_steps=10", "run.progress_bar=false", "run.probe_every_steps=0",
    "run.checkpoint_every_steps=100000",
]


def test_a_planted_tiny_learning_rate_is_warned_through_the_trainer(tmp_path):
    """1,200 planned steps cut at 10 % of them, side by side (one thread each): at a learning rate ~900x below the
    rule the warning is in the log and in metrics.jsonl by then; at the default learning rate there is none."""
    runs = {}
    for name, lr in (("planted", ["optim.lr=1e-7", "optim.start_lr=1e-7"]), ("healthy", [])):
        sets = [*TINY, "optim.total_steps=1200", "run.max_steps=120", *lr]
        runs[name] = subprocess.Popen(
            [sys.executable, str(REPO / "training" / "pretrain.py"), "--output-dir", str(tmp_path / name),
             "--set", *sets], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    done = {name: proc.communicate(timeout=300) for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, done[name][1][-2000:]
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in runs}
    flagged = [r for r in records["planted"] if "stall" in r]
    assert len(flagged) == 1 and flagged[0]["stall"] == "learning_rate" and flagged[0]["step"] <= 120
    assert "training has stalled" in done["planted"][1] and "--set optim.lr=" in flagged[0]["stall_message"]
    assert records["healthy"][-1]["step"] == 120 and not any("stall" in r for r in records["healthy"])


def test_the_views_advised_follow_the_images_detail():
    """The digits (8 px of detail) stalled on the official views and learned on views that keep more and jitter
    less; the rendered glyphs (19-28 px) did worse on those and best with pose and stroke jitter."""
    from training.config import Config

    cfg = Config()
    cfg.model.image_size = 32
    digits, recipe = StallSettings.from_config(cfg, 64, detail=8), StallSettings.from_config(cfg, 64)
    glyphs = StallSettings.from_config(cfg, 64, detail=19)
    assert digits.hard_views() and recipe.hard_views() and glyphs.hard_views()  # no survey: as the digits
    for settings, advice in ((digits, "augment.blur_p=0"), (glyphs, "augment.affine_p=0.8 augment.stroke_p=0.8")):
        found = _feed(StallDetector(settings, total_steps=2850), LR_100X_SMALLER)
        assert found[0].cause == "views" and found[0].message.endswith(advice + ".")
    cfg.mask.rand_crop_scale, cfg.mask.ratio = [0.6, 1.0], 0.15
    cfg.augment.affine_p = cfg.augment.stroke_p = 0.8
    assert not StallSettings.from_config(cfg, 64, detail=19).hard_views()  # the glyphs' views: nothing to add
    assert StallSettings.from_config(cfg, 64, detail=8).hard_views()  # photometric jitter still on for the digits
    cfg.model.image_size = 224
    assert not StallSettings.from_config(cfg, 64, detail=8).hard_views()


# ------------------------------------------------------------------------------------------- with the view probe

# The CLS view margin (training/run/view_probe.py) as logged, (step, margin), start first, with each run's loss: the
# planted lr/100 on 2,000 Fashion-MNIST images (1,500 planned steps: the loss drifts 3-6 % below log K while the
# margin never moves), and the 28-px digits with the plan's views (5,000 planned steps; benchmarks/results/
# stall_cases.json). The glyph-like run learns while its loss stays within 3 % of log K.
PLANTED_MARGIN = [(0, 0.882), (30, 0.88), (60, 0.88), (90, 0.88), (120, 0.88), (150, 0.88), (180, 0.88),
                  (210, 0.88), (240, 0.88)]
PLANTED_LOSS = [6.93, 6.927, 6.907, 6.854, 6.815, 6.816, 6.846, 6.773, 6.757]
DIGITS_MARGIN = [(0, 0.579), (100, 0.72), (200, 1.0), (300, 1.16), (400, 1.21), (500, 1.25)]
DIGITS_LOSS = [6.93, 6.565, 6.066, 5.913, 5.631, 5.453]


def _probe_records(margins, losses, target_entropy=5.4, entropy=6.7):
    start = margins[0][1]
    return [(step, {**_record(loss, target_entropy, entropy), "view_margin_cls": margin,
                    "view_margin_cls_start": start}) for (step, margin), loss in zip(margins, losses, strict=True)]


def _feed_records(detector, records):
    return [s for s in (detector.update(step, record) for step, record in records) if s is not None]


def test_with_the_view_probe_a_planted_stall_is_warned_though_its_loss_drifts_down():
    found = _feed_records(_detector(total_steps=1500, lr=2.5e-6), _probe_records(PLANTED_MARGIN, PLANTED_LOSS))
    assert len(found) == 1 and found[0].cause == "learning_rate" and found[0].step <= 150
    assert "view margin 0.88 against 0.88" in found[0].message
    assert found[0].sets == {"optim.lr": 0.00025, "optim.start_lr": 0.0002}


def test_with_the_view_probe_a_learning_run_is_not_warned_whatever_its_loss():
    digits = _probe_records(DIGITS_MARGIN, DIGITS_LOSS)
    assert not _feed_records(_detector(total_steps=5000), digits)
    flat_loss = [(step, {**record, "loss": 6.85}) for step, record in digits]  # the glyphs' kind of plateau
    assert not _feed_records(_detector(total_steps=5000), flat_loss)
    # the same flat loss without the probe's fields: the loss rule reads it as a stall
    assert _feed(_detector(total_steps=5000), [(step, 6.85, 5.4, 6.7) for step in range(10, 600, 10)])


def test_the_demo_s_early_dip_of_its_cls_margin_is_read_with_its_served_feature():
    """The demo recipe (5,000 planned steps) as logged: its CLS margin dips below the start for ~250 steps while the
    served feature's margin already rises; either rising counts as learning."""
    cls = [(0, 0.715), (100, 0.69), (200, 0.64), (300, 0.81), (400, 1.05)]
    served = [0.92, 0.92, 0.99, 1.15, 1.25]
    records = [(step, {**record, "view_margin": margin, "view_margin_start": served[0]})
               for (step, record), margin in zip(_probe_records(cls, [6.9, 6.5, 6.1, 5.8, 5.85]), served, strict=True)]
    detector = _detector(total_steps=2000)  # checked from step 100: the dip is inside the check
    assert not _feed_records(detector, records)
    assert not _feed_records(_detector(total_steps=2000), [(0, records[0][1])] + [
        (step, {k: v for k, v in record.items() if not k.startswith("view_margin_cls")})
        for step, record in records[1:]])  # the served feature's gain alone
    cls_only = [(step, {k: v for k, v in record.items() if k.startswith("view_margin_cls") or "margin" not in k})
                for step, record in records]
    assert [s.step for s in _feed_records(_detector(total_steps=2000), cls_only)] == [200]  # what it would say
