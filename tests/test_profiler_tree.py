"""Flattening model inputs and outputs to tensors (autopipe.profiler.tree): pytree
containers and dataclasses (a model's own output class)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from autopipe.profiler.tree import float_tensor_leaves, leaves, map_tensors, tensor_leaves


@dataclass
class Output:
    logits: torch.Tensor
    extra: tuple[torch.Tensor, int]
    note: str = "x"
    cache: list[int] = field(default_factory=list, init=False)


def sample() -> dict:
    return {
        "out": Output(torch.ones(2), (torch.arange(3), 4)),
        "mask": torch.zeros(2, dtype=torch.bool),
        "h": [torch.full((1,), 2.0)],
    }


def test_leaves_in_order_through_dataclasses() -> None:
    found = leaves(sample())  # the empty ``cache`` list holds no leaf
    assert [type(x).__name__ for x in found] == [
        "Tensor",
        "Tensor",
        "int",
        "str",
        "Tensor",
        "Tensor",
    ]
    assert [t.shape for t in tensor_leaves(sample())] == [(2,), (3,), (2,), (1,)]
    floats = float_tensor_leaves(sample())
    assert [t.dtype for t in floats] == [torch.float32, torch.float32]


def test_map_tensors_keeps_the_structure_and_non_tensors() -> None:
    value = sample()
    doubled = map_tensors(lambda t: t * 2, value)
    assert isinstance(doubled["out"], Output) and doubled["out"] is not value["out"]
    assert torch.equal(doubled["out"].logits, torch.full((2,), 2.0))
    assert doubled["out"].extra[1] == 4 and doubled["out"].note == "x"
    assert torch.equal(doubled["h"][0], torch.full((1,), 4.0))
    assert torch.equal(value["out"].logits, torch.ones(2))  # the original is untouched
