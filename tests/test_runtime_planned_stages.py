"""From (model, plan) to stage graphs (autopipe.runtime.planned_stages): the unit -> stage
map, the chunk count, a batch-polymorphic graph, and tied parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from autopipe.runtime.distributed.pipeline import build_stage
from autopipe.runtime.planned_stages import (
    partition,
    stage_of_unit,
    tied_parameters,
)
from autopipe.runtime.split import StageSplitError
from profiler_models import ChildPicker
from torch import nn

from autopipe.core.plan import Plan, StagePlan
from autopipe.parallelizing import parallelize


def plan_of(stage_units: list[list[str]], microbatch_size: int, virtual: int = 1) -> Plan:
    stages = [StagePlan(index=i, device="cpu", units=u) for i, u in enumerate(stage_units)]
    num_stages = len(stages) // virtual
    return Plan(num_stages, 2, microbatch_size, 2 * microbatch_size, stages, virtual_stages=virtual)


def test_stage_of_unit_maps_contiguous_runs() -> None:
    assert stage_of_unit(["a", "b", "c", "d"], [["a"], ["b", "c"], ["d"]]) == [0, 1, 1, 2]
    with pytest.raises(StageSplitError, match="stage 1 of the plan has no units"):
        stage_of_unit(["a", "b"], [["a", "b"], []])
    with pytest.raises(
        StageSplitError, match=r"plan has 2; not in plan: \['c'\], unknown to the model: \[\]"
    ):
        stage_of_unit(["a", "b", "c"], [["a"], ["b"]])
    with pytest.raises(StageSplitError, match="do not match the model's 2 traced units"):
        stage_of_unit(["a", "b"], [["b"], ["a"]])  # same names, another order


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_the_chunk_count_must_be_stages_times_virtual_stages() -> None:
    plan = plan_of([["a"], ["b"]], 2, virtual=1)
    plan.virtual_stages = 2
    with pytest.raises(StageSplitError, match="num_stages x virtual_stages = 4 but lists 2"):
        partition(Chain(), torch.randn(4, 8), plan)


def test_a_batch_polymorphic_graph_is_traced_once() -> None:
    model, x = Chain(), torch.randn(8, 8)
    planned = partition(model, x, plan_of([["a"], ["b"]], microbatch_size=2))
    assert planned.static_microbatch_size is None
    assert [s.input_names for s in planned.stages][1] == ["a"]
    h = planned.stages[0].module(x[:3])
    torch.testing.assert_close(planned.stages[1].module(*h), model(x[:3]))


class BatchBranch(nn.Module):
    """Python control flow on the batch size. Traced at 8 rows, torch.export takes the ReLU
    branch and keeps dim 0 symbolic behind a guard on it (``> 4``, ``!= 2``, ``% 4``; for
    ``== 8`` the symbol is replaced by 8; ``> 1`` needs no guard, export's sizes start at
    2); at 2 rows (1 for ``> 1``) the model skips the ReLU."""

    def __init__(self, takes: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.takes = takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        rows = h.shape[0]
        if self.takes == "eq8":
            branch = rows == 8
        elif self.takes == "gt4":
            branch = rows > 4
        elif self.takes == "ne2":
            branch = rows != 2
        elif self.takes == "gt1":
            branch = rows > 1
        else:
            branch = rows % 4 == 0
        if branch:
            h = torch.relu(h)
        return self.b(h)


@pytest.mark.parametrize(
    ("takes", "size"), [("eq8", 2), ("gt4", 2), ("ne2", 2), ("even", 2), ("gt1", 1)]
)
def test_a_branch_on_the_batch_size_runs_as_the_model_does_at_the_microbatch_size(
    takes: str, size: int
) -> None:
    torch.manual_seed(0)
    model, x = BatchBranch(takes), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    plan = plan_of([["a"], ["b"]], microbatch_size=size)
    plan.microbatches, plan.batch_size = 8 // size, 8
    pipe = parallelize(model, x, ["cpu", "cpu"], plan=plan)
    out = pipe(x)
    out.square().sum().backward()
    expected = torch.cat([reference(x[i : i + size]) for i in range(0, 8, size)])
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=f"grad of {name}")


def test_a_one_row_microbatch_of_a_graph_dynamic_from_two_rows_is_refused() -> None:
    """Export took 1 row for a constant, so a branch on ``rows > 1`` is baked in without a
    guard: a batch of 7 in 4 micro-batches ends in a 1-row one, which ran the 2-row branch
    silently."""
    torch.manual_seed(0)
    model = BatchBranch("gt1")
    plan = plan_of([["a"], ["b"]], microbatch_size=2)
    plan.microbatches, plan.batch_size = 4, 8
    pipe = parallelize(model, torch.randn(8, 4), ["cpu", "cpu"], plan=plan)
    assert pipe.static_microbatch_size is None  # batch-dynamic from 2 rows on
    pipe(torch.randn(8, 4))  # four micro-batches of 2 rows run
    with pytest.raises(ValueError, match=r"only at micro-batches of 2 samples or more .* 1, 2;"):
        pipe(torch.randn(7, 4))


@pytest.mark.parametrize(("takes", "traced"), [("gt4", "abcd"), ("lt4", "ab"), ("gt1", "abcd")])
def test_a_hooks_chain_that_branches_on_the_batch_size_runs_as_the_model_does_or_is_refused(
    takes: str, traced: str
) -> None:
    torch.manual_seed(0)
    model, x = ChildPicker(takes), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    stage_units = [["a", "b"], ["c", "d"]] if traced == "abcd" else [["a"], ["b"]]
    plan = plan_of(stage_units, microbatch_size=2)
    plan.microbatches, plan.batch_size = 4, 8
    with pytest.warns(UserWarning, match="forward hooks"):
        if takes != "gt1":
            with pytest.raises(
                ValueError,
                match=r"^at micro-batch size 2 the forward of ChildPicker runs the children "
                rf"\[{'a, b' if takes == 'gt4' else 'a, b, c, d'}\], not the",
            ):
                parallelize(model, x, ["cpu", "cpu"], plan=plan)
            return
        pipe = parallelize(model, x, ["cpu", "cpu"], plan=plan)
    out = pipe(x)
    out.square().sum().backward()
    expected = torch.cat([reference(x[i : i + 2]) for i in range(0, 8, 2)])
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=f"grad of {name}")


def test_tied_parameters_named_by_the_model_or_the_first_stage() -> None:
    emb, head = nn.Linear(2, 2), nn.Linear(2, 2)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Tanh(), head)
    stage0, stage1 = nn.Module(), nn.Module()
    stage0.first, stage1.last = emb, head
    (tied,) = tied_parameters([stage0, stage1], model)
    assert tied.name == "0.weight" and tied.stages == [0, 1]
    assert tied.names == {0: ["first.weight"], 1: ["last.weight"]}
    (unnamed,) = tied_parameters([stage0, stage1])
    assert unnamed.name == "first.weight"
    assert tied_parameters([stage0]) == []


def test_the_distributed_stages_of_a_batch_branch_run_as_the_model_does() -> None:
    torch.manual_seed(0)
    model, x = BatchBranch("gt4"), torch.randn(8, 4)
    plan = plan_of([["a"], ["b"]], microbatch_size=2)
    plan.microbatches, plan.batch_size = 4, 8
    first, last = (build_stage(model, plan, x, stage) for stage in (0, 1))
    out = last(*first(x[:2]))
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x[:2]))
