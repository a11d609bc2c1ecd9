"""The emitted configs fed to the frameworks' own code (the ``emit`` extra: torchtitan
0.2.2, megatron-core 0.16.1, deepspeed; each test skips with the reason where its package
is not installed).

For examples/gpt.py and a tiny Hugging Face Llama, on 2 and 4 ranks, under every schedule
each framework has, the framework builds exactly the plan's stages with the plan's M:

- torchtitan: the TOML is parsed by torchtitan's own ``ConfigManager`` into its
  ``JobConfig``; its ``pipeline_module_split`` cuts a meta model (examples/gpt.py itself, or
  torchtitan's own Llama3 ``Transformer`` for the Hugging Face Llama, whose names the TOML
  maps) on every pipeline rank of torch's in-process ``fake`` process group, and its
  ``build_pipeline_schedule`` builds the schedule from those stages and the ``JobConfig``.
  torchtitan's package ``__init__`` files import triton kernels, tensorboard and datasets
  (CUDA-only or heavy, none of them on this path): the test registers torchtitan's packages
  without running those ``__init__`` files, and a stand-in for the one triton kernel
  module and for ``protocols.train_spec`` (a registry of trainers), so only the config,
  model and pipeline modules run, unchanged.
- Megatron-Core: ``TransformerConfig`` validates the layout and recompute flags and
  ``PipelineParallelLayerLayout`` says which layers each (rank, virtual stage) builds;
  Megatron-Core's ``ConstantNumMicroBatchesCalculator`` turns the batch flags into M.
  Megatron-LM's ``validate_args`` is not a registry package: its rule that at most one of
  ``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank``,
  ``--pipeline-model-parallel-layout`` is given is checked on the flags as documented.
- DeepSpeed: :func:`deepspeed_partition_balanced` equals DeepSpeed's own
  ``partition_balanced`` (``DS_BUILD_OPS=0``; importing ``deepspeed.runtime.utils`` picks
  the CPU accelerator and builds no op).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from autopipe.planner import plan as make_plan
from autopipe.planner.emit import EmitError, to_megatron, to_torchtitan
from autopipe.planner.layers import layer_stack
from autopipe.profiler.measure import profile
from distributed_cases import tiny_gpt

from autopipe.core.plan import Plan

TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv")
TORCH_SCHEDULES += ("dualpipev",)
FAST = {"warmup": 0, "repeat": 1, "progress": False, "microbatch_sizes": ()}
LLAMA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "use_cache": False,
}  # fmt: skip


@cache
def _model(name: str) -> tuple[torch.nn.Module, Any]:
    """(model, profile) of examples/gpt.py (4 blocks) or the tiny Hugging Face Llama,
    timed (the cut may differ between runs; every test here holds for any cut)."""
    torch.manual_seed(0)
    if name == "gpt":
        model, inputs, loss_fn = tiny_gpt()
        return model, profile(model, inputs, loss_fn=loss_fn, **FAST)
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    ids = torch.randint(0, 64, (8, 16))
    return model, profile(model, {"input_ids": ids, "labels": ids}, **FAST)


def _plan(name: str, ranks: int, schedule: str, **request: Any) -> Plan:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    m = 2 * ranks * v  # enough for 1F1B and DualPipeV, a multiple of K for the rounds rule
    return make_plan(_model(name)[1], ranks, schedule=schedule, microbatches=m,
                     batch_size=m, virtual_stages=v, **request)  # fmt: skip


# ---------------------------------------------------------------- torchtitan 0.2.2


@cache
def _torchtitan() -> types.SimpleNamespace:
    """torchtitan's config, pipeline and Llama3 modules, imported without the package
    ``__init__`` files that pull triton/tensorboard/datasets (see the module docstring)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed (pip install -e '.[emit]')")
    root = list(spec.submodule_search_locations)[0]
    for name in ("torchtitan", "torchtitan.protocols", "torchtitan.models",
                 "torchtitan.models.llama3"):  # fmt: skip
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = package
    kernels = types.ModuleType("torchtitan.models.moe.kernels")

    def generate_permute_indices(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the triton MoE kernel is not loaded in this test")

    kernels.generate_permute_indices = generate_permute_indices  # type: ignore[attr-defined]
    sys.modules.setdefault(kernels.__name__, kernels)
    import torchtitan.protocols.model as protocol_model

    train_spec = types.ModuleType("torchtitan.protocols.train_spec")
    train_spec.BaseModelArgs = protocol_model.BaseModelArgs  # type: ignore[attr-defined]
    train_spec.ModelProtocol = protocol_model.ModelProtocol  # type: ignore[attr-defined]
    train_spec.ParallelizeFunction = object  # type: ignore[attr-defined]
    sys.modules.setdefault(train_spec.__name__, train_spec)
    import torchtitan.distributed.pipeline_parallel as pipeline_parallel
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    return types.SimpleNamespace(
        pp=pipeline_parallel, ConfigManager=ConfigManager,
        Transformer=Transformer, TransformerModelArgs=TransformerModelArgs,
    )  # fmt: skip


def _torchtitan_model(name: str, tt: types.SimpleNamespace) -> torch.nn.Module:
    """The model torchtitan would train, on the meta device: examples/gpt.py itself, or
    torchtitan's own Llama3 at the tiny Llama's sizes."""
    with torch.device("meta"):
        if name == "gpt":
            return tiny_gpt()[0]
        args = tt.TransformerModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                       vocab_size=64, max_seq_len=32)  # fmt: skip
        return tt.Transformer(args)


def _tag(model: torch.nn.Module) -> torch.nn.Module:
    """Name every top-level module and entry of a top-level ModuleList/ModuleDict in an
    attribute (torchtitan renumbers the ModuleList it keeps; deepcopy keeps the tag)."""
    for child_name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for key, entry in child.named_children():
                entry.autopipe_fqn = f"{child_name}.{key}"
        else:
            child.autopipe_fqn = child_name
    return model


def _kept(chunk: torch.nn.Module) -> list[str]:
    """The modules a torchtitan stage kept (their names in the whole model): top-level ones
    that are not None, and the entries of its top-level ModuleList/ModuleDict."""
    out = []
    for child in chunk.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += [entry.autopipe_fqn for entry in child.children()]
        elif child is not None:
            out.append(child.autopipe_fqn)
    return out


def _run_torchtitan(plan: Plan, name: str, tmp_path: Path) -> list[tuple[int, list[str], int]]:
    """Per (rank, chunk) torchtitan builds: (stage index, modules kept, its schedule's M),
    from the emitted TOML read by torchtitan's ConfigManager."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tt = _torchtitan()
    path = tmp_path / "pp.toml"
    path.write_text(to_torchtitan(plan))
    job = tt.ConfigManager().parse_args(["--job.config_file", str(path)])
    parts = job.parallelism.module_fqns_per_model_part
    model = _tag(_torchtitan_model(name, tt))
    k = plan.num_stages
    built = []
    for rank in range(k):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=k)
        try:
            mesh = dist.device_mesh.init_device_mesh("cpu", (k,), mesh_dim_names=("pp",))
            stages, chunks = tt.pp.pipeline_module_split(
                model, mesh, job.parallelism.pipeline_parallel_schedule, torch.device("cpu"),
                parts,
            )  # fmt: skip
            schedule = tt.pp.build_pipeline_schedule(job, stages, lambda out, target: out.sum())
            built += [(s.stage_index, _kept(c), schedule._n_microbatches)
                      for s, c in zip(stages, chunks, strict=True)]  # fmt: skip
        finally:
            dist.destroy_process_group()
    return sorted(built)


TORCHTITAN_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm",
                    "lm_head": "output"}  # fmt: skip


def _in_torchtitan(unit: str) -> str | None:
    if unit.startswith("model.layers."):
        return unit.removeprefix("model.")
    return TORCHTITAN_NAMES.get(unit, None if unit == "model.rotary_emb" else unit)


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_torchtitan_builds_the_plans_stages_with_its_m(
    name: str, ranks: int, schedule: str, tmp_path: Path
) -> None:
    plan = _plan(name, ranks, schedule)
    built = _run_torchtitan(plan, name, tmp_path)
    expected = [
        (i, [n for u in stage.units if (n := _in_torchtitan(u)) is not None], plan.microbatches)
        for i, stage in enumerate(plan.stages)
    ]
    assert built == expected


def test_torchtitan_refuses_names_its_split_would_drop() -> None:
    import dataclasses

    plan = _plan("gpt", 2, "1f1b")
    nested = [dataclasses.replace(s, units=[f"body.{u}" for u in s.units]) for s in plan.stages]
    with pytest.raises(EmitError, match="pipeline_module_split only keeps") as info:
        to_torchtitan(dataclasses.replace(plan, stages=nested))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- Megatron-Core 0.16


MEGATRON_ONE_OF = (
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--pipeline-model-parallel-layout",
)


def _megatron_check(plan: Plan) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = to_megatron(plan)["args"]
    flag = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    # Megatron-LM's validate_args (arguments.py): "No more than one of" these three.
    assert sum(f in flag for f in MEGATRON_ONE_OF) <= 1, args
    config = TransformerConfig(
        num_layers=int(flag["--num-layers"]), hidden_size=32, num_attention_heads=4,
        pipeline_model_parallel_size=int(flag["--pipeline-model-parallel-size"]),
        pipeline_model_parallel_layout=flag["--pipeline-model-parallel-layout"],
        pipeline_dtype=torch.float32,
        recompute_granularity=flag.get("--recompute-granularity"),
        recompute_method=flag.get("--recompute-method"),
        recompute_num_layers=int(flag["--recompute-num-layers"])
        if "--recompute-num-layers" in flag else None,
    )  # fmt: skip
    layout = config.pipeline_model_parallel_layout
    k, v = plan.num_stages, plan.virtual_stages
    assert layout.virtual_pipeline_model_parallel_size == v
    layers = [sum(u.startswith(("model.layers.", "blocks.")) for u in s.units)
              for s in plan.stages]  # fmt: skip
    built = [layout.layout[c % k][c // k].count(LayerType.decoder) for c in range(k * v)]
    assert built == layers
    calc = ConstantNumMicroBatchesCalculator(
        int(flag["--global-batch-size"]), int(flag["--micro-batch-size"]), plan.replicas,
        None, 0,
    )  # fmt: skip
    assert calc.get() == plan.microbatches


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_megatron_builds_the_plans_stages_with_its_m(name: str, ranks: int, schedule: str) -> None:
    plan = _plan(name, ranks, schedule)
    units = [u for s in plan.stages for u in s.units]
    stack = layer_stack(units)
    assert stack is not None
    stage_of = {u: s.index for s in plan.stages for u in s.units}
    head = {stage_of[u] for u in units[: stack.start] if u != "model.rotary_emb"}
    tail = {stage_of[u] for u in units[stack.end :]}
    if len(head) > 1 or len(tail) > 1:
        # The planner cut the embedding (or the norm and head) apart; Megatron's E and L are
        # one stage's each: refused in one line.
        with pytest.raises(EmitError, match="Megatron keeps the embedding"):
            to_megatron(plan)
        pytest.skip(f"refused: the plan splits {'E' if len(head) > 1 else 'L'} over stages")
    _megatron_check(plan)


def test_megatron_recompute_flags() -> None:
    plan = _plan("gpt", 2, "1f1b", checkpoint="always")
    args = to_megatron(plan)["args"]
    if len({sum(u.startswith("blocks.") for u in s.units) for s in plan.stages}) == 1:
        _megatron_check(plan)
        assert args[args.index("--recompute-method") + 1] == "uniform"
    else:
        pytest.fail(f"expected an even 4-block split on 2 ranks, got {args}")


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
    looped = make_plan(measured, 2, schedule="interleaved-1f1b", virtual_stages=3,
                       microbatches=4, batch_size=4)  # fmt: skip
    assert set(FRAMEWORK_DEFAULTS) <= set(looped.baselines) and "torch-even" not in looped.baselines
    titan = _row(looped, "torchtitan-even")
    assert titan["schedule"] == "interleaved-1f1b" and titan["virtual_stages"] == 2
    assert len(titan["balance"]) == 4 and sum(titan["balance"]) == len(measured.units)
    if "torchtitan" in sys.modules or importlib.util.find_spec("torchtitan") is not None:
        own = _torchtitan().pp.generate_llm_fqn_per_model_part(4, 4)
        assert [sum(n.startswith("layers.") for n in part) for part in own] == [
            b - extra for b, extra in zip(titan["balance"], [3, 0, 0, 2], strict=True)
        ]  # examples/gpt.py: 3 units before its blocks, 2 after
    megatron = _row(looped, "megatron-uniform")
    assert megatron["iteration_time_s"] is None and "divisible by 6" in megatron["reason"]

    gpipe = make_plan(measured, 2, schedule="gpipe", microbatches=4, batch_size=4)
    assert "no gpipe schedule" in _row(gpipe, "megatron-uniform")["reason"]
    assert _row(gpipe, "torchtitan-even")["virtual_stages"] == 1
    deepspeed = _row(gpipe, "deepspeed-parameters")
    assert (deepspeed["schedule"], deepspeed["virtual_stages"]) == ("1f1b", 1)
    bounds = deepspeed_partition_balanced([u.parameter_count for u in measured.units], 2)
    assert deepspeed["balance"] == [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    table = "\n".join(framework_table(gpipe))
    assert "torch.distributed.pipelining" not in table and "[1f1b, V=1]" in table
