"""Memory accounting (autopipe.profiler.memory): bytes saved for backward per unit, each
storage once and parameters left out; parameters, gradients and optimizer state per unit."""

from __future__ import annotations

import pytest
import torch
from autopipe.profiler.memory import (
    SavedTensorCounter,
    parameter_accounting,
    parameter_storages,
    storage_bytes,
    storage_key,
    tensor_bytes,
)
from autopipe.profiler.units import trace_units
from torch import nn

F32 = 4


def test_views_share_one_storage() -> None:
    x = torch.zeros(10)
    view = x[:3]
    assert tensor_bytes(view) == 3 * F32 and storage_bytes(view) == 10 * F32
    assert storage_key(view) == storage_key(x) != storage_key(torch.zeros(10))


def saved_bytes(exclude_parameters: bool) -> dict:
    torch.manual_seed(0)
    lin = nn.Linear(4, 8)
    x = torch.randn(3, 4, requires_grad=True)
    counter = SavedTensorCounter(exclude=parameter_storages(lin) if exclude_parameters else set())
    with counter.counting():
        counter.tag = 0
        h = lin(x)  # saves x and the weight
        counter.tag = 1
        y = h * h  # saves h twice: one storage
    y.sum().backward()  # the saved tensors still work
    return counter.bytes_by_tag


def test_saved_tensors_counted_once_per_storage_without_parameters() -> None:
    assert saved_bytes(exclude_parameters=True) == {0: 3 * 4 * F32, 1: 3 * 8 * F32}
    # Without the exclusion the weight would count as an activation of unit 0.
    assert saved_bytes(exclude_parameters=False) == {0: (3 * 4 + 8 * 4) * F32, 1: 3 * 8 * F32}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(idx)))


def test_parameter_accounting_counts_a_tied_weight_in_each_unit_and_once_in_total() -> None:
    model = Tied()
    graph = trace_units(model, torch.tensor([1, 2, 3]), granularity="module")
    assert graph.unit_names == ["emb", "norm", "head"]
    rows, total = parameter_accounting(graph, model, "adam")
    emb_bytes = 10 * 4 * F32
    assert total == emb_bytes + 2 * 4 * F32
    assert [r["parameter_bytes"] for r in rows] == [emb_bytes, 8 * F32, emb_bytes]
    assert [r["shared_parameters"] for r in rows] == [["emb.weight"], [], ["emb.weight"]]
    assert [r["optimizer_bytes"] for r in rows] == [2 * emb_bytes, 16 * F32, 2 * emb_bytes]
    # running mean, running var (float) and the batch counter (int64)
    assert rows[1]["buffer_bytes"] == 2 * 4 * F32 + 8
    # 16 bytes per parameter in all: 4 parameter + 4 gradient + 8 state
    rows16, _ = parameter_accounting(graph, model, "sgd", state_bytes_per_parameter=16)
    assert rows16[0]["optimizer_bytes"] == 16 * 40 - 2 * emb_bytes
    model.norm.weight.requires_grad_(False)
    rows, _ = parameter_accounting(graph, model, "adam")
    assert rows[1]["gradient_bytes"] == 4 * F32 and rows[1]["optimizer_bytes"] == 8 * F32


def test_no_storage_is_counted_twice_when_freed_and_reused() -> None:
    """Counted storages are kept alive: a freed one's address cannot pass for counted."""
    counter = SavedTensorCounter()
    with counter.counting():
        for _ in range(3):
            a = torch.ones(16, requires_grad=True)
            (a * a).sum().backward()
    assert counter.total_bytes == 3 * 16 * F32


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum"])
def test_optimizer_state_follows_the_optimizer(optimizer: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    graph = trace_units(model, torch.randn(2, 4), granularity="module")
    (row,), _ = parameter_accounting(graph, model, optimizer)
    assert row["optimizer_bytes"] == (0 if optimizer == "sgd" else 20 * F32)
