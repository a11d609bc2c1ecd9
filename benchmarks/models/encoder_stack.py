"""A stack of ``nn.TransformerEncoderLayer`` blocks (d_model 256, 4 heads, MLP 1024, seq 64):
identical blocks, the case where measuring each block on its own wastes time and adds noise.

    autopipe profile benchmarks/models/encoder_stack.py:layers_48
"""

from __future__ import annotations

import torch
from torch import nn

D_MODEL, HEADS, FFN, SEQ = 256, 4, 1024, 64


def build_model(layers: int = 4) -> nn.Sequential:
    """``layers`` encoder layers in an ``nn.Sequential``; input and output (batch, 64, 256)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
    )


def layers_4() -> nn.Sequential:
    return build_model(4)


def layers_16() -> nn.Sequential:
    return build_model(16)


def layers_48() -> nn.Sequential:
    return build_model(48)


def example_inputs(batch_size: int = 8) -> torch.Tensor:
    """(batch, 64, 256) float32 activations."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, SEQ, D_MODEL, generator=g)
