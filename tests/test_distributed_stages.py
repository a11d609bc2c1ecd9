"""One stage of a plan as a module for torch.distributed.pipelining
(autopipe.runtime.distributed.stages): values on the wire, the stage checks, owned outputs."""

from __future__ import annotations

import pytest
import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.distributed.stages import (
    StageModule,
    from_wire,
    split_stages,
    to_wire,
    wire_of,
)
from autopipe.runtime.split import StageSplitError
from torch import nn


def test_nested_values_with_numbers_round_trip_over_the_wire() -> None:
    x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: sent as a contiguous copy
    value = {"h": x, "n": 7, "pair": (1.5, torch.ones(2))}
    wire = wire_of(value)
    assert wire.width == 4 and wire.numbers == [False, True, True, False]
    tensors = to_wire(value)
    assert all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors)
    assert tensors[1].dim() == 0 and tensors[1].item() == 7
    (back, extra) = from_wire([*tensors, torch.zeros(1)], [wire, wire_of(torch.zeros(1))])
    assert back["n"] == 7 and isinstance(back["n"], int) and back["pair"][0] == 1.5
    assert torch.equal(back["h"], x) and torch.equal(back["pair"][1], torch.ones(2))
    assert torch.equal(extra, torch.zeros(1))


def test_a_leaf_that_cannot_travel_is_named() -> None:
    with pytest.raises(TypeError, match="^a Python str$"):
        wire_of((torch.ones(1), "mean"))


def chain() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), torch.randn(3, 4)


def test_stage_maps_must_be_contiguous_and_cover_every_stage() -> None:
    model, x = chain()
    graph = trace_units(model, x, granularity="module")
    with pytest.raises(StageSplitError, match="contiguous runs of units starting at stage 0"):
        split_stages(graph, [0, 1, 0])
    with pytest.raises(StageSplitError, match="contiguous runs of units starting at stage 0"):
        split_stages(graph, [1, 1, 1])
    with pytest.raises(StageSplitError, match="every stage needs at least one unit"):
        split_stages(graph, [0, 0, 2])
    first, last = split_stages(graph, [0, 1, 1])
    assert first.output_names and last.output_names == []


def test_stage_modules_chain_to_the_model_and_check_their_inputs() -> None:
    model, x = chain()
    graph = trace_units(model, x, granularity="module")
    first, last = (StageModule(s) for s in split_stages(graph, [0, 1, 1]))
    (h,) = first(x)
    torch.testing.assert_close(last(h), model(x))
    assert sorted(first.model_named_parameters()) == ["0.bias", "0.weight"]
    assert sorted(last.model_named_parameters()) == ["2.bias", "2.weight"]
    with pytest.raises(TypeError, match="stage 1 takes 1 tensors for its inputs"):
        last(h, h)


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(3, 2)  # a view crosses the cut


class ViewAcrossCut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Transposed()
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_own_outputs_copies_views_sent_on() -> None:
    """The zero-bubble schedules detach outputs in place, which autograd refuses for views."""
    model, x = ViewAcrossCut(), torch.randn(2, 3)
    graph = trace_units(model, x, granularity="module")
    stage = split_stages(graph, [0, 1])[0]
    (shared,) = StageModule(stage)(x)
    (owned,) = StageModule(stage, own_outputs=True)(x)
    assert shared._is_view() and not owned._is_view()
    torch.testing.assert_close(owned, shared)
