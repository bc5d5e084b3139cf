"""Linear probe with all labels on frozen features, following the official ``linear_eval.py``.

The classifier is the official ``LinearClassifier(normalize=True)``: LayerNorm, then L2 normalisation, then a linear
layer (weights N(0, 0.01), bias 0). It is trained with SGD, Nesterov momentum 0.9, no weight decay, and a cosine
learning-rate schedule from ``lr`` to 0 without warm-up; the default ``lr`` is the official 6.4 at batch 8192,
scaled linearly to the batch size. Unlike the official script, the features are extracted once (one resize + centre
crop, no RandomResizedCrop/flip augmentation) so a probe costs seconds rather than a pass over the images per epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["LinearClassifier", "LinearProbeResult", "train_linear_probe"]

OFFICIAL_LR, OFFICIAL_BATCH = 6.4, 8192


class LinearClassifier(nn.Module):
    """LayerNorm -> L2 normalisation -> Linear."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, num_classes)
        nn.init.normal_(self.linear.weight, std=0.01)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(nn.functional.normalize(self.norm(features), dim=1))


@dataclass
class LinearProbeResult:
    train_accuracy: float
    test_accuracy: float
    epochs: int
    lr: float
    batch_size: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 4096) -> float:
    correct = sum(int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
                  for i in range(0, len(x), batch_size))
    return 100.0 * correct / len(x)


def train_linear_probe(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                       test_labels: np.ndarray, *, epochs: int = 100, batch_size: int = 256,
                       lr: float | None = None, momentum: float = 0.9, seed: int = 0) -> LinearProbeResult:
    """Train the probe on all training features and report top-1 accuracies (%)."""
    classes, y_train = np.unique(np.asarray(train_labels), return_inverse=True)
    lookup = {c: i for i, c in enumerate(classes.tolist())}
    y_test = np.array([lookup.get(c, -1) for c in np.asarray(test_labels).tolist()], dtype=np.int64)
    x_train = torch.as_tensor(np.ascontiguousarray(train_features, dtype=np.float32))
    x_test = torch.as_tensor(np.ascontiguousarray(test_features, dtype=np.float32))
    y_train_t, y_test_t = torch.as_tensor(y_train, dtype=torch.int64), torch.as_tensor(y_test)
    lr = OFFICIAL_LR * batch_size / OFFICIAL_BATCH if lr is None else lr

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LinearClassifier(x_train.shape[1], len(classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(x_train) / batch_size)
    total_steps = max(1, epochs * steps_per_epoch)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            loss = loss_fn(model(x_train[batch]), y_train_t[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    model.eval()
    return LinearProbeResult(_accuracy(model, x_train, y_train_t), _accuracy(model, x_test, y_test_t),
                             epochs, lr, batch_size)
