"""Model files whose ``loss_fn`` tests the objective's contract (tests/test_objective.py).

``position`` : a classifier whose ``loss_fn`` builds its target from the row index
(``arange(rows) % 10``), so it sees a micro-batch's own rows, never the whole batch's.
``summed`` : the same classifier, its ``loss_fn`` returning ``(sum, count)`` over the rows
whose label is not ``-100``, a different number in each micro-batch.
Not a test module (no ``test_`` prefix).
"""

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


def summed() -> nn.Module:
    return build_model()


def example_inputs_summed(batch_size: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=g)
    # Rows 0, 1, 2, 5: ignored, so the micro-batches of 2 count 0, 1, 2 and 2 rows.
    labels[[0, 1, 2, 5]] = -100
    return {"input": torch.randn(batch_size, 12, generator=g), "labels": labels}


class _Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()

    def forward(self, input: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(input)


def summed_model() -> nn.Module:
    return _Keyword()


def loss_fn_summed(output: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple:
    labels = inputs["labels"]
    total = F.cross_entropy(output, labels, ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()
