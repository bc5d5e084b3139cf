"""The MSN objective (Assran et al., 2022), numerically matching the official ``src/losses.py`` + ``msn_train.py``.

Anchor views (masked/focal, online encoder) are matched to the target view (EMA encoder) through a soft
assignment to learnable prototypes. The targets are sharpened and, optionally, Sinkhorn-balanced; a mean-entropy
maximisation ("me-max") term over the *global* batch keeps all prototypes in use.

Differences from the official code, all value-preserving where the official code is finite:

- log-probabilities come from ``log_softmax`` instead of ``log(p ** -t)``, which over/underflows for confident
  predictions or small temperatures;
- sharpening is done in log space (``softmax(log p / T)`` equals ``p**(1/T)`` renormalised);
- the loss is computed in float32 (or float64) whatever the input dtype, so bf16 autocast is safe;
- Sinkhorn uses the all-reduced batch size instead of ``B_local * world_size`` (allows unequal local batches) and
  guards its divisions against prototypes with zero mass, where the official code would produce NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.distributed import all_reduce_mean, all_reduce_sum_

__all__ = ["LossTerms", "MSNLoss", "sharpen", "sinkhorn"]


def sharpen(p: Tensor, temperature: float) -> Tensor:
    """Return ``p ** (1 / temperature)`` renormalised over dim 1, computed in log space so it cannot overflow."""
    return torch.softmax(torch.log(p) / temperature, dim=1)


@torch.no_grad()
def sinkhorn(scores: Tensor, iterations: int = 3) -> Tensor:
    """Balance non-negative assignment scores (B, K) so each prototype gets equal mass over the global batch.

    The official ``distributed_sinkhorn``: the total sum and the per-prototype sums are all-reduced across ranks,
    the per-sample sums stay local. Each row of the result sums to 1 (for ``iterations >= 1``). Returns a new
    tensor; ``scores`` is left untouched.
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (batch, prototypes), got shape {tuple(scores.shape)}")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    tiny = torch.finfo(scores.dtype).tiny
    q = scores.t().clone()  # (K, B_local)
    num_prototypes = q.shape[0]
    batch = all_reduce_sum_(q.new_full((), float(q.shape[1])))  # a fill: torch.tensor(..., device) syncs on CUDA

    q /= all_reduce_sum_(q.sum()).clamp_min(tiny)
    for _ in range(iterations):
        # Each prototype receives total mass 1/K over the global batch...
        q /= all_reduce_sum_(q.sum(dim=1, keepdim=True)).clamp_min(tiny)
        q /= num_prototypes
        # ... and each sample distributes mass 1/B.
        q /= q.sum(dim=0, keepdim=True).clamp_min(tiny)
        q /= batch
    q *= batch
    return q.t()


@dataclass(frozen=True)
class LossTerms:
    """The detached parts of one loss evaluation, kept as tensors so that logging costs nothing between logs.

    ``me_max`` is over the global batch, the other terms over this rank's batch (as the official logs).
    """

    cross_entropy: Tensor
    me_max: Tensor
    entropy: Tensor
    target_probs: Tensor  # (B, K) sharpened (and balanced) targets

    @torch.no_grad()
    def summary(self) -> dict[str, float]:
        """The logged statistics, with one device sync for all of them.

        ``prototype_usage_entropy``: entropy of the mean anchor prediction (log K when every prototype is used
        evenly); ``num_used_prototypes``: prototypes that are some target's argmax; ``target_max_prob``: how
        sharp the targets are (Sinkhorn caps it near B / K when the batch B is smaller than K).
        """
        probs = self.target_probs
        num_prototypes = probs.shape[1]
        used = torch.zeros(num_prototypes, dtype=torch.bool, device=probs.device)
        used[probs.argmax(dim=1)] = True  # no host sync, unlike unique()
        values = {
            "cross_entropy": self.cross_entropy,
            "me_max": self.me_max,
            "entropy": self.entropy,
            "prototype_usage_entropy": math.log(num_prototypes) - self.me_max,
            "target_entropy": -torch.special.xlogy(probs, probs).sum(dim=1).mean(),
            "num_used_prototypes": used.sum().to(probs.dtype),
            "target_max_prob": probs.max(dim=1).values.mean(),
        }
        return dict(zip(values, torch.stack(list(values.values())).tolist()))


class MSNLoss(nn.Module):
    """MSN cross-entropy + me-max loss.

    Args:
        temperature: softmax temperature on cosine similarities to the prototypes (official ``tau`` 0.1).
        sharpen_temperature: default target sharpening temperature T (official 0.25); ``forward`` takes the value
            of a schedule per call.
        me_max_weight: weight of the mean-entropy-maximisation regulariser (official ``memax_weight`` 1.0).
        use_sinkhorn: balance the targets with distributed Sinkhorn (official ``use_sinkhorn: true``).
        sinkhorn_iterations: Sinkhorn iterations (official 3).
        label_smoothing: smoothing of the one-hot prototype labels (official ``label_smoothing`` 0.0).
        entropy_weight: weight of the mean per-sample prediction entropy (official ``ent_weight`` 0.0).
    """

    def __init__(
        self,
        temperature: float = 0.1,
        sharpen_temperature: float = 0.25,
        me_max_weight: float = 1.0,
        use_sinkhorn: bool = True,
        sinkhorn_iterations: int = 3,
        label_smoothing: float = 0.0,
        entropy_weight: float = 0.0,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not sharpen_temperature > 0:
            raise ValueError(f"sharpen_temperature must be > 0, got {sharpen_temperature}")
        if not me_max_weight >= 0:
            raise ValueError(f"me_max_weight must be >= 0, got {me_max_weight}")
        if sinkhorn_iterations < 0 or int(sinkhorn_iterations) != sinkhorn_iterations:
            raise ValueError(f"sinkhorn_iterations must be an integer >= 0, got {sinkhorn_iterations}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if not math.isfinite(entropy_weight):
            raise ValueError(f"entropy_weight must be finite, got {entropy_weight}")
        self.temperature = temperature
        self.sharpen_temperature = sharpen_temperature
        self.me_max_weight = me_max_weight
        self.use_sinkhorn = use_sinkhorn
        self.sinkhorn_iterations = int(sinkhorn_iterations)
        self.label_smoothing = label_smoothing
        self.entropy_weight = entropy_weight

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, sharpen_temperature={self.sharpen_temperature}, "
            f"me_max_weight={self.me_max_weight}, use_sinkhorn={self.use_sinkhorn}, "
            f"sinkhorn_iterations={self.sinkhorn_iterations}, label_smoothing={self.label_smoothing}, "
            f"entropy_weight={self.entropy_weight}"
        )

    def log_probs(self, z: Tensor, prototypes: Tensor) -> Tensor:
        """Log of the soft-nearest-neighbour assignment ``softmax(cos(z, prototypes) / tau) @ labels``.

        With label smoothing s the labels are ``(1 - s) I + s / K``, so the assignment is
        ``(1 - s) softmax + s / K``; its log is taken with ``logaddexp`` to stay finite.
        ``prototypes`` must already be L2-normalised.
        """
        logp = F.log_softmax(F.normalize(z, dim=1) @ prototypes.t() / self.temperature, dim=1)
        if self.label_smoothing > 0:
            s, k = self.label_smoothing, prototypes.shape[0]
            logp = torch.logaddexp(logp + math.log1p(-s), torch.full_like(logp, math.log(s / k)))
        return logp

    def forward(self, anchor: Tensor, target: Tensor, prototypes: Tensor,
                sharpen_temperature: float | None = None) -> tuple[Tensor, LossTerms]:
        """Compute the loss.

        Args:
            anchor: (M * B, d) anchor embeddings, view-major (view 0 of every image, then view 1, ...).
            target: (B, d) target embeddings; no gradient flows into them.
            prototypes: (K, d) prototype parameter (normalised here, never in place).
            sharpen_temperature: this step's target sharpening temperature (a schedule's value); None uses the
                constructor's.

        Returns:
            The scalar loss ``ce + me_max_weight * me_max + entropy_weight * entropy`` and its detached terms
            (``LossTerms.summary()`` turns them into logged floats with one device sync).
        """
        temperature = self.sharpen_temperature if sharpen_temperature is None else sharpen_temperature
        self._check_inputs(anchor, target, prototypes, temperature)
        dtype = torch.promote_types(anchor.dtype, torch.float32)
        anchor, prototypes = anchor.to(dtype), prototypes.to(dtype)
        target = target.detach().to(dtype)
        num_views = anchor.shape[0] // target.shape[0]
        num_prototypes = prototypes.shape[0]

        prototypes = F.normalize(prototypes, dim=1)
        anchor_logp = self.log_probs(anchor, prototypes)
        with torch.no_grad():
            target_probs = torch.softmax(self.log_probs(target, prototypes) / temperature, dim=1)
            if self.use_sinkhorn:
                target_probs = sinkhorn(target_probs, self.sinkhorn_iterations)
            targets = target_probs.repeat(num_views, 1)  # view-major, like the anchors

        cross_entropy = -(targets * anchor_logp).sum(dim=1).mean()

        probs = anchor_logp.exp()
        mean_probs = all_reduce_mean(probs.mean(dim=0))  # global mean prediction, gradient-correct under DDP
        # KL(mean_probs || uniform); the clamp only matters when a prototype's mass underflows to exactly 0.
        log_mean_probs = mean_probs.clamp_min(torch.finfo(dtype).tiny).log()
        me_max = (mean_probs * log_mean_probs).sum() + math.log(num_prototypes)
        entropy = -(probs * anchor_logp).sum(dim=1).mean()

        loss = cross_entropy
        if self.me_max_weight != 0:
            loss = loss + self.me_max_weight * me_max
        if self.entropy_weight != 0:
            loss = loss + self.entropy_weight * entropy
        return loss, LossTerms(cross_entropy.detach(), me_max.detach(), entropy.detach(), target_probs)

    def _check_inputs(self, anchor: Tensor, target: Tensor, prototypes: Tensor, sharpen_temperature: float) -> None:
        if not sharpen_temperature > 0:
            raise ValueError(f"sharpen_temperature must be > 0, got {sharpen_temperature}")
        for name, x in (("anchor", anchor), ("target", target), ("prototypes", prototypes)):
            if x.ndim != 2:
                raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
        if not anchor.shape[1] == target.shape[1] == prototypes.shape[1]:
            raise ValueError(
                "anchor, target and prototypes must share the embedding dim, got "
                f"{anchor.shape[1]}, {target.shape[1]}, {prototypes.shape[1]}"
            )
        if target.shape[0] == 0 or anchor.shape[0] % target.shape[0] != 0:
            raise ValueError(
                f"anchor rows ({anchor.shape[0]}) must be a positive multiple of target rows ({target.shape[0]})"
            )
        if anchor.shape[0] == 0:
            raise ValueError("anchor must have at least one row")
        if prototypes.shape[0] == 0:
            raise ValueError("prototypes must have at least one row")
