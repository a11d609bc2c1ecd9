"""Parameters torch's split weight pass cannot take: those used more than once along the
inputs' path (autopipe.profiler.weight_pass)."""

from __future__ import annotations

import torch
from autopipe.profiler.weight_pass import accumulator, reuse_reason, reused_parameters
from torch import nn


def shared_layer_graph(
    calls: int, input_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor, nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=input_grad)
    h = x
    for _ in range(calls):
        h = torch.tanh(lin(h))
    return h, x, lin


def test_a_layer_applied_twice_is_reported_with_its_uses() -> None:
    out, x, lin = shared_layer_graph(calls=2)
    params = dict(lin.named_parameters())
    assert reused_parameters([out], [x], params) == {"bias": 2, "weight": 2}
    out, x, lin = shared_layer_graph(calls=3)
    assert reused_parameters([out], [x], dict(lin.named_parameters())) == {"bias": 3, "weight": 3}


def test_one_use_or_no_input_gradient_is_not_reported() -> None:
    out, x, lin = shared_layer_graph(calls=1)
    assert reused_parameters([out], [x], dict(lin.named_parameters())) == {}
    # Inputs that need no gradient: torch runs the whole backward in W, nothing to report.
    out, x, lin = shared_layer_graph(calls=2, input_grad=False)
    assert reused_parameters([out], [x], dict(lin.named_parameters())) == {}


def test_frozen_parameters_are_left_out() -> None:
    out, x, lin = shared_layer_graph(calls=2)
    lin.bias.requires_grad_(False)
    assert reused_parameters([out], [x], {"bias": lin.bias, "weight": lin.weight}) == {"weight": 2}


def test_accumulator_of_leaves_and_results() -> None:
    leaf = torch.zeros(2, requires_grad=True)
    assert type(accumulator(leaf)).__name__ == "AccumulateGrad"
    assert accumulator(leaf) is accumulator(leaf)
    y = leaf * 2
    assert accumulator(y) is y.grad_fn
    assert accumulator(torch.zeros(2)) is None


def test_reuse_reason_names_the_first_parameter() -> None:
    assert reuse_reason({}) == ""
    line = reuse_reason({"weight": 2, "bias": 2}, where="chunk")
    assert line.startswith("parameter 'bias' (and 1 more) is used 2 times in the chunk;")
    assert "runs unsplit" in line
