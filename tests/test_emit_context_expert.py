"""The plan's context- and expert-parallel degrees in torchtitan's and Megatron-LM's words
(issue 35): ``[parallelism] context_parallel_degree`` / ``expert_parallel_degree``
(torchtitan/config/configs.py) and ``--context-parallel-size`` /
``--expert-model-parallel-size``; absent when the plan does not use them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import framework_checks as fc
import pytest
import tomllib
from autopipe.planner.emit import EmitError, to_megatron, to_torchtitan, to_torchtitan_python
from autopipe.planner.emit_torchtitan import TORCHTITAN_PYTHON_VERSION, torchtitan_fields
from test_emit import _gpt_plan

from autopipe.core.plan import Plan


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


# ---------------------------------------------------------------- checked with their own code

# (D, T, C, E, shard) on 2 pipeline ranks: each of CP and EP alone and together, beside
# replicas and TP; the torchtitan ones shard the replicas (EP borrows from dp_shard).
TITAN_MESHES = [(1, 1, 2, 1, "none"), (2, 1, 2, 1, "parameters"), (1, 2, 2, 1, "none"),
                (2, 1, 1, 2, "parameters"), (2, 2, 1, 2, "gradients"), (1, 2, 1, 2, "none"),
                (2, 1, 2, 2, "parameters"), (2, 2, 2, 4, "gradients")]  # fmt: skip
MEGATRON_MESHES = [(1, 1, 2, 1, "none"), (2, 1, 2, 1, "optimizer"), (1, 2, 2, 1, "none"),
                   (2, 1, 1, 2, "none"), (2, 2, 1, 2, "optimizer"), (1, 2, 1, 2, "none"),
                   (2, 2, 2, 4, "none")]  # fmt: skip


def _cp_ep(replicas: int, tp: int, cp: int, ep: int, shard: str) -> Plan:
    from test_emit_frameworks import _mesh

    plan = _mesh("interleaved-1f1b", replicas, tp, shard)
    return dataclasses.replace(plan, context_parallel=cp, expert_parallel=ep)


@pytest.mark.parametrize("replicas, tp, cp, ep, shard", TITAN_MESHES)
def test_torchtitan_03_takes_cp_and_ep(
    replicas: int, tp: int, cp: int, ep: int, shard: str, tmp_path: Path
) -> None:
    """torchtitan 0.3.0's config classes take the emitted module and its ParallelDims builds
    the mesh on every rank of the plan's world (fake process group) with the plan's pp,
    batch, cp and tp coordinates and its EP group (E consecutive ranks of dp_shard x cp x
    tp); its pipeline split and schedule give the plan's chunks and M."""
    plan = _cp_ep(replicas, tp, cp, ep, shard)
    assert plan.world_size == 2 * replicas * tp * cp
    try:
        built = fc.run_torchtitan_python(plan, "gpt", tmp_path)
    except fc.Unavailable as exc:
        pytest.skip(str(exc))
    assert built == fc.expected_stages(plan, "lm_head")
    fields = torchtitan_fields(plan, TORCHTITAN_PYTHON_VERSION)
    assert fields.parallelism.get("context_parallel_degree", 1) == cp
    assert fields.parallelism.get("expert_parallel_degree", 1) == ep
    assert fields.training["disable_cuda_graphs"] is True


@pytest.mark.parametrize("replicas, tp, cp, ep, shard", TITAN_MESHES)
def test_torchtitan_022_toml_takes_cp_and_ep(
    replicas: int, tp: int, cp: int, ep: int, shard: str, tmp_path: Path
) -> None:
    """torchtitan 0.2.2's ConfigManager reads every emitted key and its ParallelDims lays the
    degrees out as the plan on every rank (pp, batch, cp, tp and the EP group)."""
    plan = _cp_ep(replicas, tp, cp, ep, shard)
    try:
        built = fc.run_torchtitan_toml(plan, "gpt", tmp_path)
    except fc.Unavailable as exc:
        pytest.skip(str(exc))
    assert built == fc.expected_stages(plan, "output")


def test_torchtitan_ep_on_plain_replicas_is_refused_as_its_mesh_refuses_it() -> None:
    """EP never borrows torchtitan's dp_replicate ranks: E = 2 over 2 plain replicas (T = C
    = 1) is one line; torchtitan 0.3.0's own ParallelDims cannot lay those degrees out."""
    plan = _cp_ep(2, 1, 1, 2, "none")
    with pytest.raises(EmitError, match=r"dp_shard x cp x tp = 1 x 1 x 1") as info:
        to_torchtitan_python(plan)
    assert "\n" not in str(info.value)
    with pytest.raises(EmitError):  # 0.2.2: its DDP beside PP is refused first
        to_torchtitan(plan)
    pytest.importorskip("torchtitan")
    if not (fc.version("torchtitan") or "").startswith("0.3."):
        pytest.skip("torchtitan 0.3 is not installed")
    from torchtitan.distributed.parallel_dims import ParallelDims

    ranks = fc._fake_ranks(4)
    next(ranks)
    try:
        dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=2, ep=2, world_size=4)
        with pytest.raises(Exception):  # noqa: B017 - whatever torchtitan raises
            dims.build_mesh()
    finally:
        ranks.close()


def test_torchtitan_cp_without_sharding_is_noted() -> None:
    """torchtitan's fsdp mesh is dp_shard x cp: it shards over the CP ranks always."""
    note = torchtitan_fields(_cp_ep(1, 1, 2, 1, "none"), TORCHTITAN_PYTHON_VERSION).note
    assert "FSDP over its 2 context-parallel ranks" in note
    assert "context-parallel" not in torchtitan_fields(_cp_ep(2, 1, 2, 1, "parameters")).note


def test_torchtitan_022_toml_pins_expert_tp_1() -> None:
    """0.2.2 has expert_tensor_parallel_degree: 1 (its default) is EP over dp_shard x cp x
    tp, the planner's layout; 0.3.0 has no such key (it always lays EP out so)."""
    toml = tomllib.loads(to_torchtitan(_cp_ep(2, 2, 1, 2, "gradients")))["parallelism"]
    assert (toml["expert_parallel_degree"], toml["expert_tensor_parallel_degree"]) == (2, 1)
    python = torchtitan_fields(_cp_ep(2, 2, 1, 2, "gradients"), TORCHTITAN_PYTHON_VERSION)
    assert "expert_tensor_parallel_degree" not in python.parallelism


@pytest.mark.parametrize("replicas, tp, cp, ep, shard", MEGATRON_MESHES)
def test_megatron_takes_cp_and_ep(replicas: int, tp: int, cp: int, ep: int, shard: str) -> None:
    """Megatron-Core's TransformerConfig takes the CP and EP flags (with the experts the
    output asks for), its rank arithmetic lays pp, dp, cp, tp and the EP groups out as the
    plan's mesh, and validate_args' rules hold (CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP,
    the world a multiple of T x K x C): tests/framework_checks.py run_megatron."""
    plan = _cp_ep(replicas, tp, cp, ep, shard)
    out = to_megatron(plan)
    assert out["world_size"] == 2 * replicas * tp * cp
    assert ("env" in out) == (tp > 1 or cp > 1)
    args = out["args"]
    assert ("--expert-tensor-parallel-size" in args) == (ep > 1)
    try:
        built = fc.run_megatron(plan)
    except fc.Unavailable as exc:
        pytest.skip(str(exc))
    assert [m for _, _, m in built] == [plan.microbatches] * len(plan.stages)


def test_megatron_refuses_ep_with_tp_without_sequence_parallelism() -> None:
    """Megatron-Core's ModelParallelConfig: sequence parallelism must be used with EP and TP."""
    plan = _cp_ep(2, 2, 1, 2, "none")
    trainer = dataclasses.replace(plan.trainer, sequence_parallel=False)
    with pytest.raises(EmitError, match="sequence parallelism with expert and tensor") as info:
        to_megatron(dataclasses.replace(plan, trainer=trainer))
    assert "\n" not in str(info.value)
    assert "--sequence-parallel" in to_megatron(plan)["args"]
