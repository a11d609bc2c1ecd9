"""A deep MLP as an nn.Sequential of Linear + ReLU layers with a wide middle.

autopipe plan examples/mlp.py --gpus 4
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(widths: tuple[int, ...] = (512, 1024, 2048, 2048, 1024, 512, 256, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp()


def example_inputs(batch_size: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 512, generator=g)
