"""Which unit calls share one measurement (autopipe.profiler.sharing), over the per-unit
split of a traced stack of identical blocks."""

from __future__ import annotations

import torch
from autopipe.profiler.execute import run_units, split_units
from autopipe.profiler.sharing import UnitSharing
from autopipe.profiler.units import trace_units
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def stack() -> tuple[nn.Module, torch.Tensor]:
    """embed, three identical blocks, a widening Linear, a wider block, head: 7 units, 5
    distinct graphs."""
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(8), Block(8), Block(8), nn.Linear(8, 16), Block(16))
    return nn.Sequential(nn.Linear(4, 8), blocks, nn.Linear(16, 2)), torch.randn(3, 4)


def sharing_of(enabled: bool = True) -> tuple[UnitSharing, list]:
    model, x = stack()
    graph = trace_units(model, x)
    assert graph.unit_names == ["0", "1.0", "1.1", "1.2", "1.3", "1.4", "2"]
    split = split_units(graph, model)
    sharing = UnitSharing(split, enabled=enabled)
    _, calls = run_units(split, graph.flat_inputs(x), share=sharing)
    return sharing, calls


def test_identical_blocks_are_counted_and_share_the_first_call() -> None:
    sharing, calls = sharing_of()
    assert [sharing.copies(i) for i in range(7)] == [1, 3, 3, 3, 1, 1, 1]
    assert sharing.expected_runs(7) == 5
    assert [c.same_as for c in calls] == [None, None, 1, 1, None, None, None]
    assert len(set(sharing.signatures.values())) == 5


def test_disabled_sharing_records_signatures_and_runs_every_unit() -> None:
    sharing, calls = sharing_of(enabled=False)
    assert all(c.same_as is None for c in calls)
    assert sharing.expected_runs(7) == 7
    assert sharing.signatures[1] == sharing.signatures[2] != sharing.signatures[4]
