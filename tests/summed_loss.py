"""A model file whose ``loss_fn`` returns ``(sum, count)``: cross-entropy summed over the
rows whose label is not ``-100``, which the batch spreads unevenly over its micro-batches
(tests/test_objective.py). Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 10


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES)
        )

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Classifier()


def example_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=g)
    # Micro-batches of 2 then count 0, 1, 2 and 2 rows (at batch 8).
    ignored = torch.tensor([0, 1, 2, 5])
    labels[ignored[ignored < batch_size]] = -100
    return {"features": torch.randn(batch_size, 12, generator=g), "labels": labels}


def loss_fn(
    output: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    labels = inputs["labels"]
    total = F.cross_entropy(output, labels, ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()
