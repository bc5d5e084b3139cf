"""MSNLoss against an independent transcription of the official loss, plus stability and multi-process checks."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from training.distributed import all_reduce_mean, all_reduce_sum_, cleanup, init_distributed, is_distributed
from training.model.losses import MSNLoss, sharpen, sinkhorn

# ---------------------------------------------------------------------------------------------------------------
# Reference: the official src/losses.py formulas, written out literally (single process).
# ---------------------------------------------------------------------------------------------------------------


def official_one_hot(num_classes: int, smoothing: float, dtype=torch.float64) -> torch.Tensor:
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    labels = torch.arange(num_classes).view(-1, 1)
    return torch.full((num_classes, num_classes), off_value, dtype=dtype).scatter_(1, labels, on_value)


@torch.no_grad()
def official_sinkhorn(q: torch.Tensor, num_itr: int = 3) -> torch.Tensor:
    q = q.T.clone()
    b, k = q.shape[1], q.shape[0]
    q /= torch.sum(q)
    for _ in range(num_itr):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= b
    q *= b
    return q.T


def official_loss(
    anchor, target, prototypes, *, tau=0.1, T=0.25, use_sinkhorn=True, smoothing=0.0, ent_weight=0.0
):
    """ploss + me_max + ent_weight * ent with the official log(p ** -t) forms; returns (loss, ploss, rloss, t)."""
    labels = official_one_hot(prototypes.shape[0], smoothing, dtype=anchor.dtype)
    num_views = anchor.shape[0] // target.shape[0]

    def snn(query, supports):
        query, supports = F.normalize(query), F.normalize(supports)
        return torch.softmax(query @ supports.T / tau, dim=1) @ labels

    probs = snn(anchor, prototypes)
    with torch.no_grad():
        targets = snn(target, prototypes) ** (1.0 / T)
        targets /= torch.sum(targets, dim=1, keepdim=True)
        if use_sinkhorn:
            targets = official_sinkhorn(targets)
        targets = torch.cat([targets for _ in range(num_views)], dim=0)
    ploss = torch.mean(torch.sum(torch.log(probs ** (-targets)), dim=1))
    avg_probs = torch.mean(probs, dim=0)
    rloss = -torch.sum(torch.log(avg_probs ** (-avg_probs))) + math.log(float(len(avg_probs)))
    sloss = torch.mean(torch.sum(torch.log(probs ** (-probs)), dim=1))
    return ploss + rloss + ent_weight * sloss, ploss, rloss, targets


def make_inputs(batch=6, views=3, dim=16, num_prototypes=32, dtype=torch.float64, seed=0):
    """Anchors are noisy copies of their image's target so that the assignments are informative."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, dim, generator=g, dtype=dtype)
    anchor = target.repeat(views, 1) + 0.7 * torch.randn(views * batch, dim, generator=g, dtype=dtype)
    prototypes = torch.empty(num_prototypes, dim, dtype=dtype).uniform_(-(dim**-0.5), dim**-0.5, generator=g)
    return anchor, target, prototypes


def grads(loss_fn, anchor, target, prototypes):
    a = anchor.clone().requires_grad_(True)
    p = prototypes.clone().requires_grad_(True)
    loss = loss_fn(a, target, p)
    loss = loss[0] if isinstance(loss, tuple) else loss
    ga, gp = torch.autograd.grad(loss, (a, p))
    return loss.detach(), ga, gp


# ---------------------------------------------------------------------------------------------------------------
# Equivalence with the official loss
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_sinkhorn", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_official_loss_and_gradients(use_sinkhorn, smoothing):
    anchor, target, prototypes = make_inputs()
    ours = MSNLoss(use_sinkhorn=use_sinkhorn, label_smoothing=smoothing)
    ref_loss, ref_ga, ref_gp = grads(
        lambda a, t, p: official_loss(a, t, p, use_sinkhorn=use_sinkhorn, smoothing=smoothing)[0],
        anchor,
        target,
        prototypes,
    )
    loss, ga, gp = grads(ours, anchor, target, prototypes)
    assert ref_loss > 0.5  # a non-degenerate case
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, ref_ga, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gp, ref_gp, rtol=1e-9, atol=1e-12)
    assert gp.abs().sum() > 0 and ga.abs().sum() > 0


def test_stats_match_official_logs():
    anchor, target, prototypes = make_inputs()
    _, ploss, rloss, targets = official_loss(anchor, target, prototypes)
    stats = MSNLoss()(anchor, target, prototypes)[1].summary()
    assert stats["cross_entropy"] == pytest.approx(ploss.item(), rel=1e-12)
    assert stats["me_max"] == pytest.approx(rloss.item(), rel=1e-12)
    assert stats["prototype_usage_entropy"] == pytest.approx(math.log(32) - rloss.item(), rel=1e-12)
    assert stats["num_used_prototypes"] == len(set(targets.argmax(dim=1).tolist()))
    assert stats["target_max_prob"] == pytest.approx(targets.max(dim=1).values.mean().item(), rel=1e-12)
    t = targets[: target.shape[0]]
    assert stats["target_entropy"] == pytest.approx(-(t * t.log()).sum(1).mean().item(), rel=1e-10)
    assert set(stats) == {
        "cross_entropy",
        "me_max",
        "entropy",
        "prototype_usage_entropy",
        "target_entropy",
        "num_used_prototypes",
        "target_max_prob",
    }
    assert all(isinstance(v, float) for v in stats.values())


def test_entropy_term_and_weights():
    anchor, target, prototypes = make_inputs()
    ref_loss, ref_ga, ref_gp = grads(
        lambda a, t, p: official_loss(a, t, p, ent_weight=0.3)[0], anchor, target, prototypes
    )
    loss, ga, gp = grads(MSNLoss(entropy_weight=0.3), anchor, target, prototypes)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, ref_ga, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gp, ref_gp, rtol=1e-9, atol=1e-12)

    _, ploss, rloss, _ = official_loss(anchor, target, prototypes)
    loss, terms = MSNLoss(me_max_weight=0.5)(anchor, target, prototypes)
    stats = terms.summary()
    assert loss.item() == pytest.approx(ploss.item() + 0.5 * rloss.item(), rel=1e-12)
    assert stats["me_max"] == pytest.approx(rloss.item(), rel=1e-12)


def test_sharpen_temperature_is_taken_per_call():
    anchor, target, prototypes = make_inputs()
    criterion = MSNLoss()
    before, _ = criterion(anchor, target, prototypes)
    after, _ = criterion(anchor, target, prototypes, sharpen_temperature=0.5)
    assert criterion(anchor, target, prototypes)[0] == before  # the call did not change the default
    assert not torch.isclose(before, after)
    torch.testing.assert_close(after, official_loss(anchor, target, prototypes, T=0.5)[0], rtol=1e-12, atol=0)


def test_no_gradient_into_targets_and_prototypes_not_modified():
    anchor, target, prototypes = make_inputs()
    target.requires_grad_(True)
    prototypes.requires_grad_(True)
    proto_before = prototypes.detach().clone()
    loss, _ = MSNLoss()(anchor, target, prototypes)
    loss.backward()
    assert target.grad is None
    torch.testing.assert_close(prototypes.detach(), proto_before, rtol=0, atol=0)


def test_collapsed_targets_are_reported():
    _anchor, target, prototypes = make_inputs()
    same = target[:1].repeat(target.shape[0], 1)
    stats = MSNLoss(use_sinkhorn=False)(same.repeat(3, 1), same, prototypes)[1].summary()
    assert stats["num_used_prototypes"] == 1
    assert stats["prototype_usage_entropy"] < math.log(32) - 0.5


# ---------------------------------------------------------------------------------------------------------------
# Sinkhorn and sharpening
# ---------------------------------------------------------------------------------------------------------------


def test_sinkhorn_matches_official_and_balances():
    g = torch.Generator().manual_seed(1)
    scores = torch.softmax(torch.randn(24, 8, generator=g, dtype=torch.float64) * 3, dim=1)
    before = scores.clone()
    q = sinkhorn(scores, 3)
    torch.testing.assert_close(q, official_sinkhorn(scores, 3), rtol=1e-12, atol=0)
    torch.testing.assert_close(scores, before, rtol=0, atol=0)  # input untouched
    torch.testing.assert_close(q.sum(dim=1), torch.ones(24, dtype=torch.float64), rtol=0, atol=1e-12)

    balanced = sinkhorn(scores, 200)
    torch.testing.assert_close(
        balanced.sum(dim=0), torch.full((8,), 24 / 8, dtype=torch.float64), rtol=1e-6, atol=0
    )
    unbalanced_spread = scores.sum(0).max() - scores.sum(0).min()
    assert q.sum(0).max() - q.sum(0).min() < 0.2 * unbalanced_spread  # 3 iterations already help a lot


def test_sinkhorn_survives_prototypes_with_zero_mass():
    scores = torch.zeros(4, 5)
    scores[:, :2] = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [1.0, 0.0]])
    q = sinkhorn(scores, 3)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.sum(dim=1), torch.ones(4))
    assert torch.isnan(official_sinkhorn(scores.double(), 3)).any()  # the official form divides 0 by 0


def test_sinkhorn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        sinkhorn(torch.rand(3), 3)
    with pytest.raises(ValueError, match="iterations"):
        sinkhorn(torch.rand(3, 4), -1)


def test_sharpen():
    p = torch.softmax(torch.randn(5, 7, dtype=torch.float64), dim=1)
    ref = p**4 / (p**4).sum(dim=1, keepdim=True)
    torch.testing.assert_close(sharpen(p, 0.25), ref, rtol=1e-12, atol=1e-15)
    p32 = torch.softmax(torch.randn(2, 4) * 30, dim=1)
    assert torch.isfinite(sharpen(p32, 0.01)).all()  # p ** 100 would underflow every entry to 0 -> 0/0


# ---------------------------------------------------------------------------------------------------------------
# Numerical stability and precision
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_sinkhorn", [False, True])
def test_small_temperature_finite_where_official_overflows(use_sinkhorn):
    anchor, target, prototypes = make_inputs(dtype=torch.float64)
    anchor[: target.shape[0]] = -target  # anchors pointing away from their targets: p underflows where t > 0
    kw = {"tau": 0.01, "T": 0.25, "use_sinkhorn": use_sinkhorn}
    official32 = official_loss(anchor.float(), target.float(), prototypes.float(), **kw)[0]
    assert not torch.isfinite(official32)
    ref64 = official_loss(anchor, target, prototypes, **kw)[0]
    criterion = MSNLoss(temperature=0.01, use_sinkhorn=use_sinkhorn)
    ours32, _ = criterion(anchor.float(), target.float(), prototypes.float())
    assert torch.isfinite(ours32) and torch.isfinite(ref64)
    torch.testing.assert_close(criterion(anchor, target, prototypes)[0], ref64, rtol=1e-12, atol=0)
    # Sinkhorn rescales near-zero target mass, so float32 vs float64 is ill-conditioned there.
    if not use_sinkhorn:
        torch.testing.assert_close(ours32.double(), ref64, rtol=1e-6, atol=0)

    a = anchor.float().requires_grad_(True)
    p = prototypes.float().requires_grad_(True)
    loss, _ = MSNLoss(temperature=0.001, sharpen_temperature=0.05)(a, target.float(), p)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all() and torch.isfinite(p.grad).all()


def test_bf16_inputs_are_computed_in_float32():
    anchor, target, prototypes = (x.to(torch.bfloat16) for x in make_inputs(dtype=torch.float32))
    a = anchor.clone().requires_grad_(True)
    p = prototypes.clone().requires_grad_(True)
    loss, _ = MSNLoss()(a, target, p)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()
    ref = official_loss(anchor.double(), target.double(), prototypes.double())[0]
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"sharpen_temperature": -1.0}, "sharpen_temperature"),
        ({"me_max_weight": -0.1}, "me_max_weight"),
        ({"sinkhorn_iterations": -1}, "sinkhorn_iterations"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"entropy_weight": float("nan")}, "entropy_weight"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSNLoss(**kwargs)


def test_forward_validation():
    anchor, target, prototypes = make_inputs()
    criterion = MSNLoss()
    with pytest.raises(ValueError, match="multiple"):
        criterion(anchor[:-1], target, prototypes)
    with pytest.raises(ValueError, match="embedding dim"):
        criterion(anchor, target, prototypes[:, :-1])
    with pytest.raises(ValueError, match="2-D"):
        criterion(anchor[None], target, prototypes)
    with pytest.raises(ValueError, match="sharpen_temperature"):
        criterion(anchor, target, prototypes, sharpen_temperature=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Two processes (gloo) == one process on the concatenated batch
# ---------------------------------------------------------------------------------------------------------------

WORLD = 2
VIEWS = 3
SINKHORN_SPLIT = (3, 5)  # unequal local batches for the bare Sinkhorn check


def _local_rows(rank: int, batch: int) -> torch.Tensor:
    """Indices into the view-major global anchor matrix of the anchors whose images live on ``rank``."""
    per_rank = batch // WORLD
    images = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    return torch.cat([v * batch + images for v in range(VIEWS)])


def _dist_worker(rank: int, port: int, data_path: str, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    try:
        assert (info.rank, info.world_size, info.backend) == (rank, WORLD, "gloo")
        data = torch.load(data_path)
        anchor, target, prototypes = data["anchor"], data["target"], data["prototypes"]
        batch = target.shape[0]
        per_rank = batch // WORLD
        local_target = target[rank * per_rank : (rank + 1) * per_rank]
        local_anchor = anchor[_local_rows(rank, batch)]
        out = {}
        for use_sinkhorn in (True, False):
            a = local_anchor.clone().requires_grad_(True)
            p = prototypes.clone().requires_grad_(True)
            loss, terms = MSNLoss(use_sinkhorn=use_sinkhorn, label_smoothing=0.1)(a, local_target, p)
            stats = terms.summary()
            loss.backward()
            out[use_sinkhorn] = {
                "loss": loss.detach(),
                "anchor_grad": a.grad,
                "proto_grad": p.grad,
                "stats": stats,
            }

        start = sum(SINKHORN_SPLIT[:rank])
        out["sinkhorn"] = sinkhorn(data["scores"][start : start + SINKHORN_SPLIT[rank]], 3)

        x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = all_reduce_mean(x)
        (y * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
        out["mean"], out["mean_grad"] = y.detach(), x.grad
        out["sum"] = all_reduce_sum_(torch.full((2,), float(rank + 1)))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        cleanup()


def test_single_process_needs_no_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, None)
    assert info.device == torch.device("cpu") and not is_distributed()
    x = torch.ones(3, requires_grad=True)
    assert all_reduce_mean(x) is x
    y = torch.arange(4.0)
    assert all_reduce_sum_(y) is y and y.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="device"):
        init_distributed("tpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_match_single_process_on_full_batch(tmp_path):
    batch = 8
    anchor, target, prototypes = make_inputs(batch=batch, views=VIEWS)
    scores = torch.softmax(torch.randn(sum(SINKHORN_SPLIT), 32, dtype=torch.float64) * 3, dim=1)
    data_path = str(tmp_path / "data.pt")
    torch.save({"anchor": anchor, "target": target, "prototypes": prototypes, "scores": scores}, data_path)

    mp.spawn(_dist_worker, args=(_free_port(), data_path, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    for use_sinkhorn in (True, False):
        single_loss, single_ga, single_gp = grads(
            MSNLoss(use_sinkhorn=use_sinkhorn, label_smoothing=0.1), anchor, target, prototypes
        )
        single_stats = MSNLoss(use_sinkhorn=use_sinkhorn, label_smoothing=0.1)(anchor, target, prototypes)[1].summary()
        per_rank = [r[use_sinkhorn] for r in ranks]
        # Equal local batches: the mean of the per-rank losses is the global loss, and me-max is global on each rank.
        torch.testing.assert_close(sum(r["loss"] for r in per_rank) / WORLD, single_loss, rtol=1e-12, atol=0)
        for r in per_rank:
            assert r["stats"]["me_max"] == pytest.approx(single_stats["me_max"], rel=1e-12)
        # DDP averages gradients over ranks; the averaged per-rank gradients equal the full-batch gradients.
        for rank, r in enumerate(per_rank):
            torch.testing.assert_close(
                r["anchor_grad"] / WORLD, single_ga[_local_rows(rank, batch)], rtol=1e-9, atol=1e-14
            )
        avg_gp = sum(r["proto_grad"] for r in per_rank) / WORLD
        torch.testing.assert_close(avg_gp, single_gp, rtol=1e-9, atol=1e-14)
        # Without the collectives (lightly's local me-max, local Sinkhorn) rank 0 would get different gradients.
        local = grads(
            MSNLoss(use_sinkhorn=use_sinkhorn, label_smoothing=0.1),
            anchor[_local_rows(0, batch)],
            target[: batch // WORLD],
            prototypes,
        )
        assert (local[1] - per_rank[0]["anchor_grad"]).abs().max() > 1e-4

    torch.testing.assert_close(
        torch.cat([r["sinkhorn"] for r in ranks]), sinkhorn(scores, 3), rtol=1e-12, atol=0
    )

    for r in ranks:
        torch.testing.assert_close(r["mean"], torch.full((3,), 1.5, dtype=torch.float64))
        # identity backward
        torch.testing.assert_close(r["mean_grad"], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        torch.testing.assert_close(r["sum"], torch.full((2,), 3.0))
