"""Models that apply one layer several times (parameters shared across depth).

A model file in autopipe's convention: ``autopipe plan tests/shared_layers_models.py:albert
--gpus 2`` or ``torchrun ... -m autopipe run tests/shared_layers_models.py:looped ...``.
``albert()``: Hugging Face ALBERT (one ``AlbertLayer`` called ``num_hidden_layers`` times);
``looped()``: plain torch, one block of two ``nn.Linear`` called 3 times. Each factory builds the
model seeded with dropout off; ``example_inputs_NAME(batch_size)`` gives seeded inputs, with
``labels = input_ids`` for ALBERT, so every row has the same number of labelled tokens. Not a
test module (no ``test_`` prefix).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for a hub

VOCAB = 64
SEQ = 8
FEATURES = 16
LOOPS = 3


def albert() -> nn.Module:
    """ALBERT for masked LM: 4 hidden layers, all one shared ``AlbertLayer``."""
    import transformers

    cfg = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=4 * SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.AlbertForMaskedLM(cfg)


def example_inputs_albert(batch_size: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


class Block(nn.Module):
    """``Linear -> tanh -> Linear -> tanh``: ``(batch, FEATURES) -> (batch, FEATURES)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, FEATURES)
        self.fc2 = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


class Looped(nn.Module):
    """An input projection, one :class:`Block` (two ``nn.Linear``) applied ``LOOPS`` times, a
    head: ``(batch, FEATURES) -> (batch, 4)``. Two calls of the block in one piece of the
    pipeline make torch's split weight pass fail (its two Linears are two parameter groups
    whose passes overlap)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, FEATURES)
        self.block = Block()
        self.head = nn.Linear(FEATURES, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(LOOPS):
            x = self.block(x)
        return self.head(x)


def looped() -> nn.Module:
    torch.manual_seed(0)
    return Looped()


def example_inputs_looped(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, FEATURES, generator=g)


def build_model() -> nn.Module:
    return albert()


def example_inputs(batch_size: int = 8) -> Any:
    return example_inputs_albert(batch_size)


def build(name: str) -> tuple[nn.Module, Any]:
    """(model, example inputs at batch 8) of ``albert`` or ``looped``."""
    return globals()[name](), globals()[f"example_inputs_{name}"](8)


def has_transformers() -> bool:
    """Whether ``albert()`` can be built here."""
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
