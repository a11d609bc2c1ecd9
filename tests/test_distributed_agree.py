"""What the ranks compare before training and after each step
(autopipe.runtime.distributed.agree), on fingerprints built in one process."""

from __future__ import annotations

import copy

import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.distributed.agree import (
    graph_fingerprint,
    mismatch,
    model_fingerprint,
    nonfinite,
    plan_fingerprint,
)
from autopipe.runtime.planned_stages import partition
from torch import nn

from autopipe.core.plan import INSTRUCTION_FIELDS, STAGE_INSTRUCTION_FIELDS, Plan, StagePlan
from autopipe.core.trainer_options import TrainerOptions


class Chain(nn.Module):
    def __init__(self, act: str = "tanh") -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.act = torch.tanh if act == "tanh" else torch.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.act(self.b(self.act(self.a(x)))))


def two_stage_plan(model: nn.Module, x: torch.Tensor, microbatches: int = 2) -> Plan:
    names = trace_units(model, x, granularity="module").unit_names
    stages = [
        StagePlan(index=0, device="cpu", units=names[:2]),
        StagePlan(index=1, device="cpu", units=names[2:]),
    ]
    return Plan(2, microbatches, 2, 4, stages, granularity="module")


def test_plan_fingerprint_flattens_fields_and_digests_lists() -> None:
    model, x = Chain(), torch.randn(4, 4)
    fp = plan_fingerprint(two_stage_plan(model, x))
    assert fp["num_stages"] == 2 and fp["microbatches"] == 2 and fp["stages"] == 2
    units = fp["stages[0].units"]
    assert units.startswith("a..b (2 units, #") and len(units.rsplit("#", 1)[1]) == 13
    assert fp["stages[1].units"].startswith("c (1 units, #")
    assert plan_fingerprint(two_stage_plan(model, x)) == fp
    plan = two_stage_plan(model, x)
    plan.stages[1].checkpoint = True
    assert plan_fingerprint(plan)["stages[1].checkpoint"] is True


def test_the_plan_fingerprint_holds_the_instructions_not_the_report() -> None:
    """Ranks compare what they execute (#37): the instruction fields, every one; a
    prediction, a note or a chunk's predicted seconds never makes them refuse to start."""
    model, x = Chain(), torch.randn(4, 4)
    plan = two_stage_plan(model, x)
    fp = plan_fingerprint(plan)
    assert set(fp) == set(INSTRUCTION_FIELDS) - {"trainer"} | {
        f"stages[{i}].{f}"
        for i in range(2)
        for f in STAGE_INSTRUCTION_FIELDS
        if f != "split_backward"
    } | {"actions[0]", "actions[1]"} | {
        f"trainer.{f}" for f in TrainerOptions().to_dict()
    }  # split_backward: only written under a zero-bubble schedule; each trainer option apart
    assert fp["microbatches"] == 2 and fp["stages[1].checkpoint"] is False
    predicted = two_stage_plan(model, x)
    predicted.iteration_time_s = float("inf")
    predicted.bubble_fraction, predicted.notes = 0.5, ["another note"]
    predicted.stages[0].forward_s = 1.0
    assert plan_fingerprint(predicted) == fp
    assert not {"iteration_time_s", "bubble_fraction", "notes", "report"} & set(fp)
    same = [
        {"plan": p, "model": model_fingerprint(model)} for p in (fp, plan_fingerprint(predicted))
    ]
    assert mismatch(same) is None


def test_the_first_salient_plan_field_is_named() -> None:
    """M changes the predicted time too; the message names M, the cause."""
    model, x = Chain(), torch.randn(4, 4)
    ours, theirs = two_stage_plan(model, x), two_stage_plan(model, x, microbatches=4)
    theirs.iteration_time_s = 2.0  # predictions: not compared
    theirs.bubble_fraction = 0.5
    theirs.stages[0].checkpoint = theirs.stages[1].checkpoint = True
    line = mismatch(
        [
            {"plan": plan_fingerprint(ours), "model": model_fingerprint(model)},
            {"plan": plan_fingerprint(theirs), "model": model_fingerprint(model)},
        ]
    )
    assert line == (
        "the ranks loaded different plans: microbatches is 4 on rank 1 but 2 on rank 0 (and 4 "
        "more field(s): stages[0].checkpoint, stages[1].checkpoint, actions[0]); give every "
        "rank the same --plan file"
    )


def test_a_rank_whose_actions_differ_is_named() -> None:
    """The actions are instructions (#37): a plan whose rank 1 runs another order is
    refused at start, naming that rank's actions."""
    model, x = Chain(), torch.randn(4, 4)
    ours, theirs = two_stage_plan(model, x), two_stage_plan(model, x)
    theirs.actions = [ours.actions[0], sorted(ours.actions[1], key=lambda a: a.phase)]
    fp_ours, fp_theirs = plan_fingerprint(ours), plan_fingerprint(theirs)
    assert fp_ours["actions[0]"] == fp_theirs["actions[0]"]
    assert fp_ours["actions[1]"].startswith("4 actions #") and fp_ours["actions"] == 2
    line = mismatch(
        [
            {"plan": fp_ours, "model": model_fingerprint(model)},
            {"plan": fp_theirs, "model": model_fingerprint(model)},
        ]
    )
    assert line is not None and line.startswith(
        f"the ranks loaded different plans: actions[1] is {fp_theirs['actions[1]']!r} on rank 1"
    )


def test_model_fingerprint_ignores_values_not_dtypes() -> None:
    torch.manual_seed(0)
    a, b = Chain(), Chain()
    assert not torch.equal(a.a.weight, b.a.weight)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a)["summary"] == "Chain with 6 tensors, 50 elements"
    assert model_fingerprint(copy.deepcopy(a).double())["digest"] != model_fingerprint(a)["digest"]
    # Built on meta (no values at all): the same fingerprint.
    with torch.device("meta"):
        meta = Chain()
    assert model_fingerprint(meta) == model_fingerprint(a)


def test_graph_fingerprint_is_equal_for_the_same_graph_and_names_the_stage_that_differs() -> None:
    x = torch.randn(4, 4)
    tanh, tanh_again, relu = Chain(), Chain(), Chain(act="relu")
    plan = two_stage_plan(tanh, x)
    fp = graph_fingerprint(partition(tanh, x, plan, check_parameters=False))
    assert fp == graph_fingerprint(partition(tanh_again, x, plan, check_parameters=False))
    other = graph_fingerprint(partition(relu, x, plan, check_parameters=False))
    assert fp["nodes"] == other["nodes"] and len(fp["stages"]) == 2
    # Both stages apply the activation: both differ, the first is named.
    assert other["stages"][0] != fp["stages"][0] and other["digest"] != fp["digest"]
    base = {"plan": {"n": 1}, "model": {"digest": "m", "summary": "M"}, "failure": None}
    line = mismatch([{**base, "graph": fp}, {**base, "graph": other}])
    assert line is not None and line.startswith(
        f"rank 1 traced a different graph of the model than rank 0 (stage 0: #{other['stages'][0]}"
    )


def test_nonfinite_loss() -> None:
    assert nonfinite(float("nan")) == "nan"
    assert nonfinite(float("inf")) == "inf" and nonfinite(float("-inf")) == "-inf"
    assert nonfinite(0.0) is None and nonfinite(1e308) is None


def test_a_rank_whose_trainer_options_differ_is_named() -> None:
    """The trainer options are instructions (#34): a rank that would compile its stages
    while rank 0 runs them eager is refused at start, naming the option."""
    model, x = Chain(), torch.randn(4, 4)
    ours, theirs = two_stage_plan(model, x), two_stage_plan(model, x)
    theirs.trainer = TrainerOptions(compile=True)
    line = mismatch(
        [
            {"plan": plan_fingerprint(ours), "model": model_fingerprint(model)},
            {"plan": plan_fingerprint(theirs), "model": model_fingerprint(model)},
        ]
    )
    assert line == (
        "the ranks loaded different plans: trainer.compile is True on rank 1 but False on "
        "rank 0; give every rank the same --plan file"
    )
