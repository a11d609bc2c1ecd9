"""The plan's context- and expert-parallel degrees in torchtitan's and Megatron-LM's words
(issue 35): ``[parallelism] context_parallel_degree`` / ``expert_parallel_degree``
(torchtitan/config/configs.py) and ``--context-parallel-size`` /
``--expert-model-parallel-size``; absent when the plan does not use them."""

from __future__ import annotations

import dataclasses

import tomllib
from autopipe.planner.emit import to_megatron, to_torchtitan
from test_emit import _gpt_plan


def test_cp_and_ep_keys_in_torchtitan_and_megatron() -> None:
    plan = _gpt_plan(stages=2, schedule="1f1b")[2]
    plain = tomllib.loads(to_torchtitan(plan))["parallelism"]
    assert "context_parallel_degree" not in plain and "expert_parallel_degree" not in plain
    args = to_megatron(plan)["args"]
    assert "--context-parallel-size" not in args and "--expert-model-parallel-size" not in args

    both = dataclasses.replace(plan, context_parallel=4, expert_parallel=2)
    toml = tomllib.loads(to_torchtitan(both))["parallelism"]
    assert toml["context_parallel_degree"] == 4 and toml["expert_parallel_degree"] == 2
    flags = to_megatron(both)["args"]
    flag = dict(zip(flags[::2], flags[1::2], strict=False))
    assert flags[flags.index("--context-parallel-size") + 1] == "4"
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    assert flag["--pipeline-model-parallel-size"] == "2"


def test_autopipe_run_sizes_cp_and_ep_plans_alone_and_together() -> None:
    from autopipe.runtime.distributed.mesh import mesh_size_problem

    plan = _gpt_plan(stages=2, schedule="1f1b")[2]
    assert mesh_size_problem(plan, plan.world_size) is None
    cp = dataclasses.replace(plan, context_parallel=2)  # runs: context_parallel.py
    assert mesh_size_problem(cp, cp.world_size) is None
    why = mesh_size_problem(cp, plan.world_size)
    assert why is not None and "cp 2" in why and "\n" not in why
    # EP is carved out of the data-parallel ranks (expert_parallel.py): D = 1 cannot hold 2.
    ep = mesh_size_problem(dataclasses.replace(plan, expert_parallel=2), 2)
    assert ep is not None and "must divide the 1 data-parallel" in ep and "\n" not in ep
    # With CP, EP is carved out of the dp x cp ranks (torchtitan's way): C = 2 holds E = 2.
    both = dataclasses.replace(plan, context_parallel=2, expert_parallel=2)
    assert mesh_size_problem(both, both.world_size) is None
    four = dataclasses.replace(plan, context_parallel=2, expert_parallel=4)
    why = mesh_size_problem(four, four.world_size)
    assert why is not None and "1 x 2 dp x cp ranks" in why and "\n" not in why
