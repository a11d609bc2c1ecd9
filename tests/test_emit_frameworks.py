"""The emitted configs fed to the frameworks' own code (the ``emit`` extra: torchtitan
0.3.0 and megatron-core 0.16.1, which `make install` installs, deepspeed; torchtitan 0.2.2 when
it is first on PYTHONPATH;
each test skips with the reason where its package is not installed). How each framework's
code is reached, and what is not a registry package (Megatron-LM's ``validate_args``,
whose documented rules are checked on the flags), is in tests/framework_checks.py.

For examples/gpt.py and a tiny Hugging Face Llama, on 2 and 4 ranks, under every schedule
each framework has, the framework builds exactly the plan's stages with the plan's M; with
a mesh (pp x dp x tp, sharded or not) its own code accepts the degrees and lays the ranks
out as the plan does.

- DeepSpeed: :func:`deepspeed_partition_balanced` equals DeepSpeed's own
  ``partition_balanced`` (``DS_BUILD_OPS=0``; importing ``deepspeed.runtime.utils`` picks
  the CPU accelerator and builds no op).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import framework_checks as fc
import pytest
from autopipe.planner import plan as make_plan
from autopipe.planner.emit import (
    EmitError,
    emit,
    to_megatron,
    to_torch,
    to_torchtitan,
    to_torchtitan_python,
)
from autopipe.planner.layers import layer_stack

from autopipe.core.plan import Plan
from autopipe.core.request import PlanRequest


def _or_skip(check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except fc.Unavailable as exc:
        pytest.skip(str(exc))


def _model(name: str) -> Any:
    if name == "llama":
        pytest.importorskip("transformers")
    return fc.model(name)


def _plan(name: str, ranks: int, schedule: str, **request: Any) -> Plan:
    _model(name)
    return fc.make(name, ranks, schedule, **request)


def _mesh(schedule: str, replicas: int, tp: int, shard: str) -> Plan:
    """examples/gpt.py's plan on 2 pipeline ranks, then on a 2 x dp x tp mesh (the planner
    does not choose meshes yet: issue 20)."""
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    plan = make_plan(
        fc.counted("gpt"),
        PlanRequest(
            gpus=2, schedule=schedule, virtual_stages=v, microbatches=4 * v, batch_size=4 * v
        ),
    )
    tp_plan = {"*.attn.*": "colwise"} if tp > 1 else {}
    return dataclasses.replace(plan, data_parallel=replicas, tensor_parallel=tp, shard=shard,
                               tp_plan=tp_plan)  # fmt: skip


MESHES = [(1, 1, "none"), (2, 1, "none"), (1, 2, "none"), (2, 2, "parameters"),
          (2, 1, "gradients")]  # fmt: skip


# ---------------------------------------------------------------- torchtitan 0.2.2 (TOML)


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", fc.TORCH_SCHEDULES)
def test_torchtitan_builds_the_plans_stages_with_its_m(
    name: str, ranks: int, schedule: str, tmp_path: Path
) -> None:
    plan = _plan(name, ranks, schedule)
    assert _or_skip(fc.run_torchtitan_toml, plan, name, tmp_path) == fc.expected_stages(
        plan, "output"
    )


@pytest.mark.parametrize("replicas, tp, shard", MESHES)
def test_torchtitan_toml_mesh(replicas: int, tp: int, shard: str, tmp_path: Path) -> None:
    """The mesh degrees pass torchtitan 0.2.2's ParallelDims on the plan's world size (in
    the run); the stages and M stay the plan's."""
    plan = _mesh("interleaved-1f1b", replicas, tp, shard)
    if replicas > 1 and shard == "none":  # DDP beside PP: refused (the test below)
        with pytest.raises(EmitError, match="DDP has not supported"):
            to_torchtitan(plan)
        return
    assert _or_skip(fc.run_torchtitan_toml, plan, "gpt", tmp_path) == fc.expected_stages(
        plan, "output"
    )


def test_torchtitan_refuses_names_its_split_would_drop() -> None:
    plan = _plan("gpt", 2, "1f1b")
    nested = [dataclasses.replace(s, units=[f"body.{u}" for u in s.units]) for s in plan.stages]
    for emitter in (to_torchtitan, to_torchtitan_python):
        with pytest.raises(EmitError, match="pipeline_module_split only keeps") as info:
            emitter(dataclasses.replace(plan, stages=nested))
        assert "\n" not in str(info.value)


def test_torchtitan_refuses_zero_1() -> None:
    plan = _mesh("1f1b", 2, 1, "optimizer")
    for emitter in (to_torchtitan, to_torchtitan_python):
        with pytest.raises(EmitError, match="no ZeRO-1|ZeRO-1"):
            emitter(plan)


# ---------------------------------------------------------------- torchtitan 0.3.0 (Python)


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", fc.TORCH_SCHEDULES)
def test_torchtitan_python_builds_the_plans_stages_with_its_m(
    name: str, ranks: int, schedule: str, tmp_path: Path
) -> None:
    plan = _plan(name, ranks, schedule)
    assert _or_skip(fc.run_torchtitan_python, plan, name, tmp_path) == fc.expected_stages(
        plan, "lm_head"
    )


@pytest.mark.parametrize("replicas, tp, shard", MESHES)
def test_torchtitan_python_mesh(replicas: int, tp: int, shard: str, tmp_path: Path) -> None:
    """torchtitan 0.3.0's config system takes the module, its ParallelDims builds the mesh
    on every rank of the world with the plan's coordinates, and the fields are the plan's."""
    plan = _mesh("interleaved-1f1b", replicas, tp, shard)
    assert _or_skip(fc.run_torchtitan_python, plan, "gpt", tmp_path) == fc.expected_stages(
        plan, "lm_head"
    )
    parallelism, training, _ = fc.load_torchtitan_python(plan, tmp_path)
    assert training.local_batch_size // parallelism.pipeline_parallel_microbatch_size == (
        plan.microbatches
    )
    assert training.global_batch_size == (plan.batch_size * replicas if replicas > 1 else -1)
    assert parallelism.tensor_parallel_degree == tp
    assert parallelism.data_parallel_shard_degree == (replicas if shard != "none" else 1)
    if shard != "none":
        policy = {"parameters": "always", "gradients": "never"}[shard]
        assert parallelism.fsdp_reshard_after_forward == policy


def test_torchtitan_python_checkpointing_and_base(tmp_path: Path) -> None:
    text = to_torchtitan_python(_plan("gpt", 2, "1f1b", checkpoint="always"))
    assert "FULL_ACTIVATION_CHECKPOINT = True" in text and "BASE = ''" in text
    namespace: dict[str, Any] = {}
    pytest.importorskip("torchtitan")
    try:
        exec(compile(text, "autopipe_pp.py", "exec"), namespace)
    except ImportError as exc:
        pytest.skip(f"torchtitan 0.3's activation_checkpoint does not import: {exc}")
    with pytest.raises(ValueError, match="set BASE"):
        namespace["autopipe_config"]()
    with pytest.raises(EmitError, match="not MODULE:FUNCTION"):
        to_torchtitan_python(_plan("gpt", 2, "1f1b"), base="no function")


# ---------------------------------------------------------------- Megatron-Core 0.16


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", fc.MEGATRON_SCHEDULES)
def test_megatron_builds_the_plans_stages_with_its_m(name: str, ranks: int, schedule: str) -> None:
    """Counted profiles (the same cut every run): 8 chunks of a 4-layer model must cut the
    embedding or head units apart, which Megatron's layout cannot say (refused)."""
    _model(name)
    plan = fc.make(name, ranks, schedule, count=True)
    units = [u for s in plan.stages for u in s.units]
    stack = layer_stack(units)
    assert stack is not None
    stage_of = {u: s.index for s in plan.stages for u in s.units}
    head = {stage_of[u] for u in units[: stack.start] if u != "model.rotary_emb"}
    tail = {stage_of[u] for u in units[stack.end :]}
    if len(head) > 1 or len(tail) > 1:
        # The planner cut the embedding (or the norm and head) apart; Megatron's E and L are
        # one stage's each: refused in one line.
        assert len(plan.stages) == 8
        with pytest.raises(EmitError, match="Megatron keeps the embedding") as info:
            to_megatron(plan)
        assert "\n" not in str(info.value)
        return
    built = _or_skip(fc.run_megatron, plan)
    assert built == [(c, n, plan.microbatches) for c, n in enumerate(fc.plan_layers(plan))]


@pytest.mark.parametrize("replicas, tp, shard", [(1, 1, "none"), (2, 1, "none"),
                                                 (1, 2, "none"), (2, 2, "optimizer")])  # fmt: skip
def test_megatron_mesh(replicas: int, tp: int, shard: str) -> None:
    """TransformerConfig takes TP and sequence parallelism, Megatron-Core's rank arithmetic
    lays the world size out as the plan's mesh (in the run), and M is the plan's."""
    plan = _mesh("interleaved-1f1b", replicas, tp, shard)
    try:
        to_megatron(plan)
    except EmitError as exc:
        pytest.skip(f"refused: {exc}")
    built = _or_skip(fc.run_megatron, plan)
    assert [m for _, _, m in built] == [plan.microbatches] * len(plan.stages)
    args = to_megatron(plan)["args"]
    assert ("--sequence-parallel" in args) == (tp > 1)
    assert ("--use-distributed-optimizer" in args) == (shard == "optimizer")
    assert to_megatron(plan)["world_size"] == 2 * replicas * tp


def test_megatron_sequence_parallel_needs_tp() -> None:
    """The rule the flags keep: Megatron-Core refuses sequence parallelism without TP."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                          sequence_parallel=True, tensor_model_parallel_size=1)  # fmt: skip
    assert "--sequence-parallel" not in to_megatron(_plan("gpt", 2, "1f1b"))["args"]


def test_megatron_refuses_zero_2_and_3() -> None:
    for shard in ("gradients", "parameters"):
        plan = _mesh("1f1b", 2, 1, shard)
        with pytest.raises(EmitError, match="optimizer state only"):
            to_megatron(plan)


def test_megatron_recompute_flags() -> None:
    # the counted profile: a timed one cut 3 + 1 blocks once on a loaded CI host
    plan = _plan("gpt", 2, "1f1b", count=True, checkpoint="always")
    args = to_megatron(plan)["args"]
    if len(set(fc.plan_layers(plan))) == 1:
        _or_skip(fc.run_megatron, plan)
        assert args[args.index("--recompute-method") + 1] == "uniform"
    else:
        pytest.fail(f"expected an even 4-block split on 2 ranks, got {args}")


def test_per_unit_plans_pass_both_frameworks(tmp_path: Path) -> None:
    """A plan re-materializing every stage per unit: Megatron-Core's TransformerConfig takes
    one layer per recompute, torchtitan 0.2.2's JobConfig mode "full"; the stages and M
    stay the plan's."""
    plan = _plan("gpt", 2, "1f1b", checkpoint="always")
    plan = dataclasses.replace(
        plan,
        stages=[dataclasses.replace(s, checkpoint_granularity="unit") for s in plan.stages],
    )
    args = to_megatron(plan)["args"]
    assert args[args.index("--recompute-num-layers") + 1] == "1"
    megatron = _or_skip(fc.run_megatron, plan)
    assert [layers for _, layers, _ in megatron] == fc.plan_layers(plan)
    titan = _or_skip(fc.run_torchtitan_toml, plan, "gpt", tmp_path)
    assert titan == fc.expected_stages(plan, "output")


# ---------------------------------------------------------------- torch


@pytest.mark.parametrize("replicas, tp, shard", MESHES)
def test_torch_mesh_shape_builds_a_device_mesh(replicas: int, tp: int, shard: str) -> None:
    """init_device_mesh takes the emitted shape and names on every rank of the world."""
    import torch

    plan = _mesh("1f1b", replicas, tp, shard)
    spec = to_torch(plan)
    assert spec["mesh_dim_names"] == ["pp", "dp", "tp"] and spec["shard"] == shard
    assert ("tp_plan" in spec) == (tp > 1)
    for rank in fc._fake_ranks(plan.world_size):
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", tuple(spec["mesh_shape"]), mesh_dim_names=tuple(spec["mesh_dim_names"])
        )
        assert mesh["pp"].size() == 2 and mesh["dp"].size() == replicas
        assert mesh["tp"].size() == tp and mesh.get_coordinate()[0] == rank // (replicas * tp)
    assert "mesh_shape" in emit(plan, "torch")


# ---------------------------------------------------------------- DeepSpeed


def test_deepspeed_rule_is_deepspeeds_partition_balanced() -> None:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[emit]')")
    try:
        from deepspeed.runtime.utils import partition_balanced
    except ImportError as exc:
        pytest.skip(f"deepspeed.runtime.utils does not import here: {exc}")
    from autopipe.planner.baselines import deepspeed_partition_balanced

    rng = random.Random(0)
    for _ in range(300):
        n, parts = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.choice([0, 1, 5, 100, rng.randint(0, 1000)]) for _ in range(n)]
        ours = deepspeed_partition_balanced(weights, parts)
        assert ours == [int(b) for b in partition_balanced(weights, parts)], (weights, parts)


# ---------------------------------------------------------------- framework rows


def _row(plan: Plan, name: str) -> dict[str, Any]:
    return plan.baselines[name]


def test_framework_rows_run_each_frameworks_own_schedule() -> None:
    """torchtitan's row: torchtitan's stages per rank (2 for a multi-stage schedule, not the
    plan's V = 3), its split the one generate_llm_fqn_per_model_part makes; Megatron's row at
    the plan's V, n/a under a schedule Megatron lacks; DeepSpeed's row one stage per rank
    under its 1F1B, split by partition_balanced over the parameter counts; no torch row."""
    from autopipe.planner.baselines import FRAMEWORK_DEFAULTS, deepspeed_partition_balanced

    from autopipe.explain import framework_table

    _, measured = _model("gpt")
    looped = make_plan(
        measured,
        PlanRequest(
            gpus=2, schedule="interleaved-1f1b", virtual_stages=3, microbatches=4, batch_size=4
        ),
    )
    assert set(FRAMEWORK_DEFAULTS) <= set(looped.baselines) and "torch-even" not in looped.baselines
    titan = _row(looped, "torchtitan-even")
    assert titan["schedule"] == "interleaved-1f1b" and titan["virtual_stages"] == 2
    assert len(titan["balance"]) == 4 and sum(titan["balance"]) == len(measured.units)
    if fc.version("torchtitan") == "0.2.2":
        own = fc.torchtitan_022_default_split(4, 4)
        assert [sum(n.startswith("layers.") for n in part) for part in own] == [
            b - extra for b, extra in zip(titan["balance"], [3, 0, 0, 2], strict=True)
        ]  # examples/gpt.py: 3 units before its blocks, 2 after
    megatron = _row(looped, "megatron-uniform")
    assert megatron["iteration_time_s"] is None and "divisible by 6" in megatron["reason"]

    gpipe = make_plan(measured, PlanRequest(gpus=2, schedule="gpipe", microbatches=4, batch_size=4))
    assert "no gpipe schedule" in _row(gpipe, "megatron-uniform")["reason"]
    assert _row(gpipe, "torchtitan-even")["virtual_stages"] == 1
    deepspeed = _row(gpipe, "deepspeed-parameters")
    assert (deepspeed["schedule"], deepspeed["virtual_stages"]) == ("1f1b", 1)
    bounds = deepspeed_partition_balanced([u.parameter_count for u in measured.units], 2)
    assert deepspeed["balance"] == [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    table = "\n".join(framework_table(gpipe))
    assert "torch.distributed.pipelining" not in table and "[1f1b, V=1]" in table


# torchtitan 0.2.2's models run plain replicas as DDP and refuse it beside PP or TP; the
# TOML carries such a plan's replicas as FSDP (sharded plans) or refuses it (issue 36).
PARALLELIZED = [(2, 1, "parameters"), (2, 1, "gradients"), (1, 2, "none"), (2, 2, "parameters")]


@pytest.mark.parametrize("replicas, tp, shard", PARALLELIZED)
def test_torchtitan_toml_parallelizes(replicas: int, tp: int, shard: str, tmp_path: Path) -> None:
    """torchtitan 0.2.2's own parallelize_llama takes the emitted degrees."""
    text = to_torchtitan(_mesh("interleaved-1f1b", replicas, tp, shard))
    assert _or_skip(fc.parallelize_torchtitan_toml, text, tmp_path) == 2 * replicas * tp


def test_torchtitan_toml_refuses_plain_replicas_beside_pp(tmp_path: Path) -> None:
    """What the TOML said before (replicate degree 2 on 2 pipeline ranks) torchtitan 0.2.2
    refuses; emit now refuses it in one line, and the Python form (0.3.0) takes it."""
    plan = _mesh("interleaved-1f1b", 2, 1, "none")
    with pytest.raises(EmitError, match="DDP has not supported > 1D parallelism") as info:
        to_torchtitan(plan)
    assert "\n" not in str(info.value)
    assert "'data_parallel_replicate_degree': 2" in to_torchtitan_python(plan)
    sharded = to_torchtitan(_mesh("interleaved-1f1b", 2, 1, "parameters"))
    old = sharded.replace(
        "data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"
    )
    old = old.replace("data_parallel_shard_degree = 2", "data_parallel_shard_degree = 1")
    with pytest.raises(RuntimeError, match="DDP has not supported > 1D parallelism"):
        _or_skip(fc.parallelize_torchtitan_toml, old, tmp_path)


def test_megatron_command_line_sets_what_validate_args_asserts_with_tp() -> None:
    """Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1."""
    tp = _mesh("1f1b", 1, 2, "none")
    text = json.loads(emit(tp, "megatron"))
    assert text["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    line = shlex.split(text["command_line"])
    assert line[:4] == ["CUDA_DEVICE_MAX_CONNECTIONS=1", "torchrun", "--nproc-per-node", "4"]
    assert line[4:] == ["pretrain_gpt.py", *text["args"]]
    plain = json.loads(emit(_mesh("1f1b", 1, 1, "none"), "megatron"))
    assert "env" not in plain and plain["command_line"].startswith("torchrun ")


def _torch_styles(tp_plan: dict[str, str]) -> dict[str, Any]:
    """The emitted styles built with torch's own classes (names from
    torch.distributed.tensor.parallel and torch.distributed.tensor only)."""
    import torch.distributed.tensor as tensor
    import torch.distributed.tensor.parallel as parallel

    names = {n: getattr(parallel, n) for n in parallel.__all__} | {
        "Replicate": tensor.Replicate, "Shard": tensor.Shard}  # fmt: skip
    return {p: eval(call, {"__builtins__": {}}, names) for p, call in tp_plan.items()}  # noqa: S307


def test_torch_tp_plan_is_what_parallelize_module_takes() -> None:
    """The torch format's tp_plan holds torch ParallelStyles (as constructor calls), which
    torch's parallelize_module applies to examples/gpt.py over a 2-rank TP mesh; the Hugging
    Face words it held before torch refuses."""
    import sys

    import torch
    from distributed_cases import tiny_gpt
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    from autopipe.core.vocabulary import REPLICATED_TP_STYLES, TORCH_TP_STYLES, TP_STYLES

    assert set(TORCH_TP_STYLES) == set(TP_STYLES) - set(REPLICATED_TP_STYLES)
    assert all(isinstance(s, ParallelStyle) for s in _torch_styles(TORCH_TP_STYLES).values())
    model = tiny_gpt()[0]
    words = sys.modules[type(model).__module__].tp_plan()
    plan = dataclasses.replace(_mesh("1f1b", 1, 2, "none"), tp_plan=words)
    spec = to_torch(plan)
    assert set(spec["tp_plan"]) == set(words)
    styles = _torch_styles(spec["tp_plan"])
    for rank in fc._fake_ranks(2):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
        with pytest.raises(TypeError, match="parallelize_plan"):
            parallelize_module(tiny_gpt()[0], mesh, dict(words))
        split = parallelize_module(tiny_gpt()[0], mesh, styles)
        qkv = split.get_submodule("blocks.0.attn.qkv").weight
        assert isinstance(qkv, DTensor) and qkv.to_local().shape[0] * 2 == qkv.shape[0], rank


TORCHTITAN_022 = Path(sys.prefix) / "torchtitan-0.2.2"
"""Where ``make install`` puts torchtitan 0.2.2 (the Makefile's TORCHTITAN_022)."""
TOML_CHECKS = "toml or torchtitan_builds or per_unit or framework_rows or 022"
"""The checks that feed the TOML to torchtitan 0.2.2 (here and in test_emit_context_expert)."""


@pytest.mark.slow
def test_torchtitan_022_checks_run_beside_030() -> None:
    """One child pytest runs the TOML's checks with make install's torchtitan 0.2.2 first on
    PYTHONPATH (it shares its package name with 0.3.0, installed here), so CI checks both
    releases' formats; none of them may skip for a missing torchtitan."""
    if fc.version("torchtitan") == "0.2.2":
        pytest.skip("torchtitan 0.2.2 is first here: its checks run in this process")
    if not (TORCHTITAN_022 / "torchtitan").is_dir():
        pytest.skip(f"no torchtitan 0.2.2 in {TORCHTITAN_022} (make install puts it there)")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TORCHTITAN_022), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    child = subprocess.run(
        [sys.executable, "-m", "pytest", str(here / "test_emit_frameworks.py"),
         str(here / "test_emit_context_expert.py"), "-k", TOML_CHECKS, "-p", "no:cacheprovider",
         "-p", "no:xdist", "-W", "ignore", "-rs"],
        env=env, cwd=here.parent, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = child.stdout[-3000:]
    assert child.returncode == 0, tail
    assert "torchtitan 0.2.2 is not" not in child.stdout, tail
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed is not None and int(passed.group(1)) >= 40, tail


def test_torchtitan_toml_and_python_compile_where_the_plan_or_async_tp_needs_it(
    tmp_path: Path,
) -> None:
    """A plan made for compiled stages (``--compile``, which ``autopipe run`` now compiles) is
    emitted with torchtitan's compile on, and so is one asking for async TP, which torchtitan
    runs only compiled: its ``maybe_enable_async_tp`` raised "Async TP requires 'model' in
    --compile.components and --compile.enable" on the TOML emitted before (which set
    ``enable_async_tensor_parallel`` alone); that plan also gets a note that its units were
    priced uncompiled. Neither: no compile key (the base config's kept)."""
    mesh = _mesh("1f1b", 2, 2, "parameters")

    def with_options(**changes: Any) -> Plan:
        return dataclasses.replace(mesh, trainer=dataclasses.replace(mesh.trainer, **changes))

    plain, compiled, async_tp = (
        with_options(),
        with_options(compile=True),
        with_options(tp_comm_overlap=True),
    )
    assert "[compile]" not in to_torchtitan(plain) and "COMPILE = {}" in to_torchtitan_python(plain)
    for plan in (compiled, async_tp):
        toml = to_torchtitan(plan)
        assert "\n[compile]\nenable = true\n" in toml
        assert ("priced its units uncompiled" in toml) == (plan is async_tp)
    assert "COMPILE = {'enable': True}" in to_torchtitan_python(compiled)
    assert (
        "COMPILE = {'enable': True, 'enable_async_tensor_parallel': True}"
        in to_torchtitan_python(async_tp)
    )
    # torchtitan's own configs take every emitted key: 0.3.0's CompileConfig (its
    # __post_init__ refuses async TP uncompiled), 0.2.2's JobConfig (in the child pytest)
    if (fc.version("torchtitan") or "").startswith("0.3."):
        from torchtitan.config.configs import CompileConfig

        namespace: dict[str, Any] = {}
        text = to_torchtitan_python(async_tp)
        start = text.index("COMPILE = ")
        exec(text[start : text.index("\n", start)], namespace)
        CompileConfig(**namespace["COMPILE"])
    _or_skip(fc.run_torchtitan_toml, async_tp, "gpt", tmp_path)
