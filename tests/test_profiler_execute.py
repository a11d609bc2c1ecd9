"""Running a model unit by unit (autopipe.profiler.execute): each unit's callable with the
values it received in one full forward pass."""

from __future__ import annotations

import torch
from autopipe.profiler.execute import detach_args, fresh_inputs, run_units, split_units
from autopipe.profiler.units import trace_units
from torch import nn


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h)


def test_one_forward_records_every_units_arguments_and_output() -> None:
    torch.manual_seed(0)
    model, x = Skip(), torch.randn(3, 4)
    graph = trace_units(model, x, granularity="module")
    split = split_units(graph, model)
    assert [n for n, _ in split.named_children()] == ["submod_0", "submod_1", "submod_2"]
    started: list[int] = []
    out, calls = run_units(split, graph.flat_inputs(x), lambda i, _m: started.append(i))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert started == [0, 1, 2] and [c.index for c in calls] == [0, 1, 2]
    # Unit 0 takes the model input; unit 1 (b and the add) takes a's output; unit 2 c's input.
    assert calls[0].activation_args == (False,)
    assert all(all(c.activation_args) for c in calls[1:])
    torch.testing.assert_close(calls[1].args[0], model.a(x), rtol=0, atol=0)
    torch.testing.assert_close(calls[2].module(*calls[2].args), out, rtol=0, atol=0)


def test_after_may_replace_a_units_outputs() -> None:
    model, x = Skip(), torch.randn(3, 4)
    graph = trace_units(model, x, granularity="module")
    split = split_units(graph, model)

    def zero_first(call):  # type: ignore[no-untyped-def]
        return torch.zeros_like(call.outputs) if call.index == 0 else None

    out, calls = run_units(split, graph.flat_inputs(x), after=zero_first)
    assert torch.equal(calls[0].outputs, torch.zeros(3, 4))
    torch.testing.assert_close(out, model.c(model.b(torch.zeros(3, 4))))


def test_fresh_and_detached_arguments() -> None:
    h = torch.ones(2, requires_grad=True) * 2
    mask = torch.ones(2)
    fresh = fresh_inputs((h, mask), (True, False))
    assert fresh[0] is not h and torch.equal(fresh[0], h) and fresh[1] is mask
    fresh[0].relu_()  # an in-place first op writes into the copy only
    assert fresh[0].grad_fn is not None  # still reaches h's gradient
    model, x = Skip(), torch.randn(3, 4)
    graph = trace_units(model, x, granularity="module")
    _, calls = run_units(split_units(graph, model), graph.flat_inputs(x))
    (leaf,) = detach_args(calls[1])
    assert leaf.is_leaf and leaf.requires_grad and leaf is not calls[1].args[0]
    (same,) = detach_args(calls[0])
    assert same is calls[0].args[0]  # the model input passes unchanged
