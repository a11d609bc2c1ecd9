"""A plan hand-edited to a mesh no rank can build (issue 36, severe 4): ``autopipe emit``
refuses it with the same rule ``autopipe run`` applies (:mod:`autopipe.core.mesh_rules`), in
one line, exit 2, nothing written. And the ``mesh-schedule`` rule (no zero-bubble schedule on
the mesh runtime): the planner's mesh search plans nothing ``autopipe run``'s own check
refuses."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
from autopipe.planner import PlanningError
from autopipe.planner import plan as make_plan
from autopipe.planner.mesh import MeshCandidate
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.tensor_parallel import annotate_tensor_parallel
from distributed_cases import tiny_gpt
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_planner_context_expert import long_profile

from autopipe.cli import main
from autopipe.core.cluster import Cluster, Device
from autopipe.core.errors import UsageError
from autopipe.core.mesh_rules import mesh_problems, mesh_schedule_problem, mesh_schedules, uses_mesh
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


PLAIN = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")


@pytest.mark.parametrize(
    ("tp", "shard", "cp", "ep", "runs"),
    [
        (1, "none", 1, 1, PLAIN),  # the plain K x D path (any D) runs every schedule
        (2, "none", 1, 1, PLAIN[:4]),
        (1, "optimizer", 1, 1, PLAIN[:4]),
        (1, "parameters", 1, 1, PLAIN[:4]),
        (1, "none", 2, 1, PLAIN[:4]),
        (1, "none", 1, 2, PLAIN[:4]),
    ],
)
def test_mesh_schedules_are_every_schedule_but_split_backward_on_the_mesh_runtime(
    tp: int, shard: str, cp: int, ep: int, runs: tuple[str, ...]
) -> None:
    mesh = MeshCandidate(pp=2, dp=2, tp=tp, shard=shard, cp=cp, ep=ep)
    assert mesh_schedules(mesh) == runs
    assert [s for s in PLAIN if mesh_schedule_problem(mesh, s) is None] == list(runs)
    assert mesh_schedule_problem(mesh, "auto") is None  # not a schedule: other rules' word
    if runs != PLAIN:
        assert mesh_schedule_problem(mesh, "dualpipev") == (
            "mesh-schedule: dualpipev splits the weight pass, which autopipe run does not "
            "combine with TP, sharded state, context or expert parallelism; use --schedule "
            "auto or one it runs on this mesh: gpipe, 1f1b, interleaved-1f1b, looped-bfs"
        )


DEGREES = st.sampled_from([1, 2, "auto"])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    tp=DEGREES,
    dp=DEGREES,
    cp=DEGREES,
    ep=DEGREES,
    shard=st.sampled_from(["none", "optimizer", "parameters", "auto"]),
    memory=st.sampled_from([None, 3_000_000]),
)
# each picked a zero-bubble schedule (dualpipev, zbv) before the search applied the rule
@example(seed=0, tp=2, dp=1, cp=1, ep=1, shard="none", memory=None)
@example(seed=0, tp=1, dp=1, cp=2, ep=1, shard="none", memory=None)
def test_run_accepts_every_plan_the_auto_search_makes_on_a_mesh(
    seed: int,
    tp: int | str,
    dp: int | str,
    cp: int | str,
    ep: int | str,
    shard: str,
    memory: int | None,
) -> None:
    """``schedule="auto"`` over small random meshes of 4 GPUs (T, D, C, E fixed or auto, any
    sharding, an MoE Llama-like profile): every plan the search returns passes the mesh
    runtime's own check (``check_mesh_plan``, what every rank of ``autopipe run`` applies
    to a mesh plan before building anything)."""
    from autopipe.runtime.distributed.mesh import check_mesh_plan

    p = long_profile(n_blocks=4, seed=seed, moe=True)
    request = PlanRequest(
        cluster=Cluster([Device("gpu", memory, 1.0, 1e11, 0.0)] * 4), batch_size=16,
        gpus_per_node=4, schedule="auto", checkpoint="auto", baselines=False,
        tensor_parallel=tp, data_parallel=dp, shard=shard,  # type: ignore[arg-type]
        context_parallel=cp, expert_parallel=ep,
    )  # fmt: skip
    try:
        out = make_plan(p, request)
    except PlanningError:  # a request no mesh of 4 GPUs fits (or bad input): nothing planned
        return
    assert mesh_schedule_problem(out, out.schedule) is None
    if uses_mesh(out):
        check_mesh_plan(out)  # raises MeshPlanError, one line, on what run refuses
