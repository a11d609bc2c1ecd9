"""A model file whose ``loss_fn`` builds its target from the row index (``arange(rows) %
10``): it sees one micro-batch's rows, never the whole batch's, in every runtime
(tests/test_objective.py). Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES)
    )


def example_inputs(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 12, generator=g)


def loss_fn(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    target = torch.arange(output.shape[0]) % CLASSES
    return F.cross_entropy(output, target)
