"""The view probe: a label-free signal of learning, read against the run's start (training/run/view_probe.py)."""

from __future__ import annotations

import torch

from training.model.vit import VisionTransformer
from training.run.view_probe import ViewProbe, effective_rank, probe_views, view_signals
from training.views import MultiViewAugment


def test_views_that_match_retrieve_each_other_and_unrelated_ones_do_not():
    torch.manual_seed(0)
    a = torch.randn(128, 32)
    top1, margin = view_signals(a, a + 0.05 * torch.randn(128, 32))
    assert top1 == 100.0 and margin > 4
    top1, margin = view_signals(a, torch.randn(128, 32))
    assert top1 < 10 and abs(margin) < 0.5


def test_effective_rank_counts_the_directions_used():
    torch.manual_seed(0)
    low = torch.randn(256, 3) @ torch.randn(3, 64)
    assert effective_rank(low) < 3.01
    assert effective_rank(torch.randn(256, 64)) > 40


def test_the_probe_s_views_leave_the_run_s_random_streams_as_they_were():
    augment = MultiViewAugment(rand_size=28, focal_size=12, num_focal=0, mean=(0.5,) * 3, std=(0.5,) * 3)
    images = torch.randint(0, 256, (16, 3, 28, 28), dtype=torch.uint8)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first, second = probe_views(augment, images, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    again = probe_views(augment, images, torch.device("cpu"))  # a fixed private stream: the same views every launch
    assert torch.equal(first, again[0]) and torch.equal(second, again[1]) and not torch.equal(first, second)


def test_the_probe_reads_its_start_first_and_postpones_itself_past_its_share():
    encoder = VisionTransformer(image_size=28, patch_size=7, embed_dim=32, depth=1, num_heads=2)
    views = torch.randn(2, 24, 3, 28, 28)
    probe = ViewProbe(views[0], views[1], encoder, feature="cls_pre_norm", device=torch.device("cpu"),
                      autocast=_no_autocast, every_steps=10)
    assert probe.start.step == 0 and 0 <= probe.start.top1 <= 100
    assert probe.probe_seconds == 0  # the start, before training, is not counted against the share
    assert probe.maybe(5) is None  # not due yet
    signals = probe.maybe(10)
    assert signals is not None and signals.values() == probe.start.values()  # same weights, same values
    record = signals.record(probe.start)
    assert record["view_margin_cls_start"] == probe.start.margin_cls and "view_seconds" in record
    assert probe.maybe(20) is None  # its seconds so far are far over 5 % of the (instant) training between


def _no_autocast():
    return torch.autocast("cpu", enabled=False)
