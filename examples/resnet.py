"""A ResNet-style CNN: a convolutional stem, residual BasicBlocks with BatchNorm in
four stages of growing width, global pooling and a classifier.

    autopipe plan examples/resnet.py --gpus 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet(
    widths: tuple[int, ...] = (32, 64, 128, 256), blocks_per_stage: int = 2, num_classes: int = 100
) -> nn.Sequential:
    """An nn.Sequential ResNet (so it also runs under ``autopipe.GPipe`` with a balance)."""
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
    ]
    in_ch = widths[0]
    for i, width in enumerate(widths):
        for j in range(blocks_per_stage):
            layers.append(BasicBlock(in_ch, width, stride=2 if (i > 0 and j == 0) else 1))
            in_ch = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return resnet()


def example_inputs(batch_size: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 32, 32, generator=g)
