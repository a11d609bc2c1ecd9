"""Cutting a traced graph into stages that talk only to their neighbours
(autopipe.runtime.split): the checks on a stage map, in-place writes into a stage's inputs,
and parameters several stages use."""

from __future__ import annotations

import pytest
import torch
from autopipe.runtime.split import StageSplitError, own_copy, shared_parameters, split_graph
from torch import fx, nn


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x)))) * scale


def traced() -> fx.GraphModule:
    return fx.symbolic_trace(Chain())


def test_stage_maps_that_cannot_be_cut_are_named() -> None:
    gm = traced()
    calls = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert calls == ["a", "b", "relu", "c", "mul"]
    with pytest.raises(StageSplitError, match="graph node 'mul' has no stage"):
        split_graph(gm, {"a": 0, "b": 0, "relu": 1, "c": 1}, 2)
    with pytest.raises(StageSplitError, match=r"stages \[1\] have no graph nodes"):
        split_graph(gm, dict.fromkeys(calls, 0), 2)
    with pytest.raises(StageSplitError, match=r"stages \[2\] are outside \[0, 2\)"):
        split_graph(gm, {**dict.fromkeys(calls, 0), "mul": 2}, 2)
    backwards = {"a": 1, "b": 0, "relu": 1, "c": 1, "mul": 1}
    with pytest.raises(StageSplitError, match="node 'b' in stage 0 reads a from a later stage"):
        split_graph(gm, backwards, 2)


def test_a_model_input_used_late_is_relayed_and_stage_0_keeps_the_signature() -> None:
    torch.manual_seed(0)
    model = Chain()
    gm = fx.symbolic_trace(model)
    stages = split_graph(gm, {"a": 0, "b": 1, "relu": 1, "c": 2, "mul": 2}, 3)
    assert [s.input_names for s in stages] == [["x", "scale"], ["scale", "a"], ["scale", "relu"]]
    assert [s.output_names for s in stages] == [["scale", "a"], ["scale", "relu"], []]
    x = torch.randn(3, 4)
    values = stages[0].module(x)  # ``scale`` left at the model's default
    values = stages[1].module(*values)
    torch.testing.assert_close(stages[2].module(*values), model(x), rtol=0, atol=0)


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.view(-1).mul_(2.0)  # through a view: still a write into the stage's input
        return self.b(torch.relu_(h))


def test_a_stage_writing_into_its_input_gets_its_own_copy() -> None:
    torch.manual_seed(0)
    model = WritesItsInput()
    gm = fx.symbolic_trace(model)
    node_stage = {n.name: int(n.name != "a") for n in gm.graph.nodes if n.op == "call_module"}
    node_stage |= {n.name: 1 for n in gm.graph.nodes if n.op == "call_method"}
    node_stage |= {n.name: 1 for n in gm.graph.nodes if n.op == "call_function"}
    first, second = split_graph(gm, node_stage, 2)
    targets = [n.target for n in second.module.graph.nodes if n.op == "call_function"]
    assert own_copy in targets
    x = torch.randn(2, 4)
    (h,) = first.module(x)
    leaf = h.detach().requires_grad_(True)  # as both runtimes hand it over
    before = leaf.detach().clone()
    out = second.module(leaf)  # autograd refuses an in-place write into this leaf itself
    torch.testing.assert_close(out, model(x))
    assert torch.equal(leaf.detach(), before)
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == (2, 4)


def test_own_copy_clones_every_tensor_of_a_structure() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    copied = own_copy((a, [b, 4]))
    assert torch.equal(copied[0], a) and copied[0] is not a
    assert copied[1][0] is not b and copied[1][1] == 4


def test_shared_parameters_list_every_later_use() -> None:
    emb, head, mid = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    head.weight = emb.weight
    stage0, stage1, stage2 = nn.Module(), nn.Module(), nn.Module()
    stage0.emb, stage1.mid, stage2.head = emb, mid, head
    assert list(shared_parameters([stage0, stage1, stage2])) == [
        (0, "emb.weight", 2, "head.weight")
    ]
    assert list(shared_parameters([stage0, stage1])) == []
