"""MSN projection head and prototypes, as in the official ``init_model`` / ``main``.

The head's child names (fc1, bn1, gelu1, fc2, bn2, gelu2, fc3) match the official ``encoder.fc`` so official
``fc.*`` keys load 1:1. There is no L2-norm layer: normalisation belongs to the loss.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

__all__ = ["ProjectionHead", "init_prototypes"]


class ProjectionHead(nn.Sequential):
    """3-layer MLP ``in_dim -> hidden_dim -> hidden_dim -> out_dim`` with optional BatchNorm and GELU.

    Linear layers keep their biases even before BatchNorm, as the official head does, so checkpoints convert
    without loss.
    """

    def __init__(self, in_dim: int, hidden_dim: int = 2048, out_dim: int = 256, use_bn: bool = True) -> None:
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["fc1"] = nn.Linear(in_dim, hidden_dim)
        if use_bn:
            layers["bn1"] = nn.BatchNorm1d(hidden_dim)
        layers["gelu1"] = nn.GELU()
        layers["fc2"] = nn.Linear(hidden_dim, hidden_dim)
        if use_bn:
            layers["bn2"] = nn.BatchNorm1d(hidden_dim)
        layers["gelu2"] = nn.GELU()
        layers["fc3"] = nn.Linear(hidden_dim, out_dim)
        super().__init__(layers)
        self.in_dim, self.hidden_dim, self.out_dim, self.use_bn = in_dim, hidden_dim, out_dim, use_bn
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)


def init_prototypes(num_prototypes: int = 1024, dim: int = 256) -> nn.Parameter:
    """Learnable prototypes ``(num_prototypes, dim)`` drawn from U(-1/sqrt(dim), 1/sqrt(dim)) as officially."""
    bound = 1.0 / math.sqrt(dim)
    return nn.Parameter(torch.empty(num_prototypes, dim).uniform_(-bound, bound), requires_grad=True)
