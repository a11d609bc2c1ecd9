"""A plan hand-edited to a mesh no rank can build (issue 36, severe 4): ``autopipe emit``
refuses it with the same rule ``autopipe run`` applies (:mod:`autopipe.core.mesh_rules`), in
one line, exit 2, nothing written."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
from autopipe.planner import plan as make_plan
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.tensor_parallel import annotate_tensor_parallel
from distributed_cases import tiny_gpt

from autopipe.cli import main
from autopipe.core.errors import UsageError
from autopipe.core.mesh_rules import mesh_problems
from autopipe.core.plan import Plan, replace_plan
from autopipe.core.request import PlanRequest


@cache
def tp_plan() -> Plan:
    """examples/gpt.py (4 heads: T = 2 allowed on 4 GPUs) planned at pp 2 x tp 2, with its
    profile embedded as ``autopipe plan --json`` writes it. Counted, not timed."""
    model, inputs, loss_fn = tiny_gpt()
    tp = sys.modules[type(model).__module__].tp_plan
    profile = annotate_tensor_parallel(profile_analytic(model, inputs, "a100", loss_fn=loss_fn),
                                       model, tp)  # fmt: skip
    plan = make_plan(profile, PlanRequest(gpus=4, tensor_parallel=2, microbatches=2))
    assert plan.mesh_shape == (2, 1, 2) and profile.tp_degrees == [2]
    return replace_plan(plan, profile=profile)


EDITS = {
    "tp3": ({"tensor_parallel": 3}, "tp-degree: tensor_parallel 3 does not divide"),
    "tp_huge": ({"tensor_parallel": 10**30}, "tp-degree: tensor_parallel 10000"),
    "replicas": ({"data_parallel": 2}, "mesh-devices: the mesh pp 2 x dp 2 x tp 2 is 8 devices"),
}
"""Edits a saved plan file can hold (the loader refuses a degree below 1, an unknown shard
and T > 1 without a tp_plan itself, :meth:`Plan.validate`)."""
IN_MEMORY = {
    "tp0": ({"tensor_parallel": 0}, "mesh-degrees: tensor_parallel=0"),
    "no_tp_plan": ({"tp_plan": {}}, "tp-plan: the plan has tensor_parallel 2 but no tp_plan"),
    "shard": ({"shard": "everything"}, "mesh-degrees: shard='everything'"),
}


def test_the_planned_mesh_breaks_no_rule() -> None:
    assert mesh_problems(tp_plan()) == []


@pytest.mark.parametrize("edit", sorted(EDITS.keys() | IN_MEMORY.keys()))
def test_each_rule_names_itself(edit: str) -> None:
    fields, words = {**EDITS, **IN_MEMORY}[edit]
    problems = mesh_problems(replace_plan(tp_plan(), **fields))
    assert problems and words in problems[0], problems


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_emit_refuses_a_hand_edited_mesh_in_one_line(
    edit: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fields, words = EDITS[edit]
    path = tmp_path / "plan.json"
    replace_plan(tp_plan(), **fields).save(path)
    for fmt in ("torch", "torchtitan", "torchtitan-python", "megatron"):
        out = tmp_path / f"{fmt}.out"
        assert main(["emit", str(path), fmt, "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
        assert not out.exists()


def test_tp3_without_the_profile_is_refused_for_the_node_and_the_devices() -> None:
    bare = replace_plan(tp_plan(), profile=None, tensor_parallel=3)
    problems = mesh_problems(bare)
    assert [p.split(":")[0] for p in problems] == ["tp-degree", "mesh-devices"], problems


@pytest.mark.parametrize("edit", ["tp3", "tp_huge"])
def test_run_refuses_the_same_plan_with_the_same_rule(edit: str) -> None:
    from autopipe.training import _check_world_size

    plan = replace_plan(tp_plan(), **EDITS[edit][0])
    with pytest.raises(UsageError, match=EDITS[edit][1]):
        _check_world_size(plan, 0, plan.world_size)  # refused before any process group
