"""The emitted configs fed to the frameworks' own code: what tests/test_emit_frameworks.py
asserts and benchmarks/emit_frameworks.py tabulates. Each ``run_*`` returns what the
framework built from the emitted text, or raises what the framework raised.

- torchtitan 0.2.2 (:func:`run_torchtitan_toml`): its ``ConfigManager`` parses the TOML
  into a ``JobConfig``; its ``pipeline_module_split`` cuts a meta model on every pipeline
  rank of torch's in-process ``fake`` process group, and ``build_pipeline_schedule`` builds
  the schedule from those stages and the ``JobConfig``. torchtitan 0.2.2's package
  ``__init__`` files import triton kernels, tensorboard and datasets (CUDA-only or heavy,
  none on this path): its packages are registered without running those ``__init__``
  files, with a stand-in for the one triton kernel module and for
  ``protocols.train_spec`` (a registry of trainers), so only the config, model and
  pipeline modules run, unchanged.
- torchtitan 0.3.0 (:func:`run_torchtitan_python`): when ``torchtitan.trainer`` imports,
  its ``ConfigManager`` loads the emitted module (``--module M --config autopipe_config``)
  into a ``Trainer.Config``, whose ``__post_init__`` checks run; otherwise the module's
  fields go through ``ParallelismConfig`` / ``TrainingConfig`` alone (the light install).
  Then ``ParallelDims.from_config`` validates the degrees and builds torchtitan's mesh on
  every rank of a ``fake`` process group, ``_pipeline_module_split`` cuts the meta model and
  ``_build_pipeline_schedule`` gives M. Nothing is stubbed: 0.3.0 imports whole once its
  pinned ``spmd_types==0.2.3`` and ``torch_checkpointing`` are there (docs/frameworks.md).
- Megatron-Core 0.16.1 (:func:`run_megatron`): ``TransformerConfig`` validates the
  layout, tensor/sequence parallelism and recompute flags; ``PipelineParallelLayerLayout``
  says which layers each (rank, virtual stage) builds; ``RankGenerator`` (parallel_state's
  rank arithmetic) gives the tensor, data and pipeline groups of the world size; its
  ``ConstantNumMicroBatchesCalculator`` turns the batch flags into M. Megatron-LM's
  ``validate_args`` is not a registry package: its documented rules on these flags are
  checked as written (see :data:`MEGATRON_ONE_OF`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import os
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import tomllib
import torch
from autopipe.planner import plan as make_plan
from autopipe.planner.emit import to_megatron, to_torchtitan, to_torchtitan_python
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from distributed_cases import tiny_gpt

from autopipe.core.plan import Plan
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import MESH_DIM_NAMES

FAST = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())
LLAMA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "use_cache": False,
}  # fmt: skip
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv",
                   "dualpipev")  # fmt: skip
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


class Unavailable(Exception):
    """The framework (or the part a check needs) is not installed here."""


@cache
def model(name: str) -> tuple[torch.nn.Module, Any]:
    """(model, profile) of examples/gpt.py (4 blocks) or the tiny Hugging Face Llama,
    timed (the cut may differ between runs; every check holds for any cut)."""
    torch.manual_seed(0)
    if name == "gpt":
        gpt, inputs, loss_fn = tiny_gpt()
        return gpt, profile(gpt, inputs, FAST, loss_fn=loss_fn, progress=False)
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    ids = torch.randint(0, 64, (8, 16))
    return llama, profile(llama, {"input_ids": ids, "labels": ids}, FAST, progress=False)


def make(name: str, ranks: int, schedule: str, *, count: bool = False, **request: Any) -> Plan:
    """The plan of ``name`` on ``ranks`` pipeline ranks under ``schedule``: V = 2 for the
    multi-stage schedules, M = 2 x stages (enough for 1F1B and DualPipeV, a multiple of K
    for the rounds rule); from the counted profile with ``count``, else the timed one."""
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    m = 2 * ranks * v
    return make_plan(
        counted(name) if count else model(name)[1],
        PlanRequest(
            gpus=ranks, schedule=schedule, microbatches=m, batch_size=m, virtual_stages=v, **request
        ),
    )


@cache
def counted(name: str) -> Any:
    """The profile of ``name`` counted for an A100, not timed: the same cut on every run
    (for examples/gpt.py one that keeps the embedding units together, which Megatron's
    layout needs)."""
    from autopipe.profiler.analytic import profile_analytic

    torch.manual_seed(0)
    if name == "gpt":
        gpt, inputs, loss_fn = tiny_gpt()
        return profile_analytic(gpt, inputs, "a100", loss_fn=loss_fn)
    ids = torch.randint(0, 64, (8, 16))
    return profile_analytic(fresh(name), {"input_ids": ids, "labels": ids}, "a100")


def fresh(name: str) -> torch.nn.Module:
    """A new ``name`` model (torch's pipeline() annotates the one it splits in place)."""
    torch.manual_seed(0)
    if name == "gpt":
        return tiny_gpt()[0]
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tag(module: torch.nn.Module) -> torch.nn.Module:
    """Name every top-level module and entry of a top-level ModuleList/ModuleDict in an
    attribute (torchtitan renumbers the ModuleList it keeps; deepcopy keeps the tag)."""
    for child_name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for key, entry in child.named_children():
                entry.autopipe_fqn = f"{child_name}.{key}"
        else:
            child.autopipe_fqn = child_name
    return module


def _kept(chunk: torch.nn.Module) -> list[str]:
    """The modules a torchtitan stage kept (their names in the whole model)."""
    out = []
    for child in chunk.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += [entry.autopipe_fqn for entry in child.children()]
        elif child is not None:
            out.append(child.autopipe_fqn)
    return out


def _fake_ranks(world: int) -> Any:
    """Each rank of a ``world``-rank in-process ``fake`` process group, in turn."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            yield rank
        finally:
            dist.destroy_process_group()


def in_torchtitan(unit: str, head: str) -> str | None:
    """A plan unit's name in torchtitan's Llama (None: a unit torchtitan has no module for)."""
    names = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": head}
    if unit.startswith("model.layers."):
        return unit.removeprefix("model.")
    return names.get(unit, None if unit == "model.rotary_emb" else unit)


def expected_stages(plan: Plan, head: str) -> list[tuple[int, list[str], int]]:
    """(chunk, the modules torchtitan should keep, M) of each of the plan's chunks."""
    return [
        (i, [n for u in s.units if (n := in_torchtitan(u, head)) is not None], plan.microbatches)
        for i, s in enumerate(plan.stages)
    ]


# ---------------------------------------------------------------- torchtitan 0.2.2


@cache
def _torchtitan_022() -> types.SimpleNamespace:
    """torchtitan 0.2.2's config, pipeline and Llama3 modules, imported without the package
    ``__init__`` files that pull triton/tensorboard/datasets (see the module docstring)."""
    if version("torchtitan") != "0.2.2":
        raise Unavailable(
            f"torchtitan 0.2.2 is not first on PYTHONPATH (found {version('torchtitan')}; "
            "docs/frameworks.md)"
        )
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    root = list(spec.submodule_search_locations)[0]
    for name in ("torchtitan", "torchtitan.protocols", "torchtitan.models",
                 "torchtitan.models.llama3"):  # fmt: skip
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = package
    kernels = types.ModuleType("torchtitan.models.moe.kernels")

    def generate_permute_indices(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the triton MoE kernel is not loaded in this check")

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
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    return types.SimpleNamespace(
        pp=pipeline_parallel, ConfigManager=ConfigManager, ParallelDims=ParallelDims,
        Transformer=Transformer, TransformerModelArgs=TransformerModelArgs,
    )  # fmt: skip


def torchtitan_022_default_split(stages: int, layers: int) -> list[list[str]]:
    """torchtitan 0.2.2's own ``generate_llm_fqn_per_model_part`` (the framework row)."""
    return _torchtitan_022().pp.generate_llm_fqn_per_model_part(stages, layers)  # type: ignore[no-any-return]


def run_torchtitan_toml(plan: Plan, name: str, tmp_path: Path) -> list[tuple[int, list[str], int]]:
    """Per chunk torchtitan 0.2.2 builds from the emitted TOML: (stage index, modules kept,
    its schedule's M). On every rank of the world its ParallelDims builds torchtitan's mesh,
    whose pp/batch/tp coordinates must be the plan's (pp outermost, tp innermost)."""
    tt = _torchtitan_022()
    path = tmp_path / "pp.toml"
    path.write_text(to_torchtitan(plan))
    job = tt.ConfigManager().parse_args(["--job.config_file", str(path)])
    # Every emitted key is a JobConfig field holding the emitted value (a TOML key torchtitan
    # does not know would otherwise pass unnoticed).
    for section, values in tomllib.loads(path.read_text()).items():
        for key, value in values.items():
            assert getattr(getattr(job, section), key) == value, (section, key)
    p = job.parallelism
    with torch.device("meta"):
        if name == "gpt":
            whole = tiny_gpt()[0]
        else:
            args = tt.TransformerModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                           vocab_size=64, max_seq_len=32)  # fmt: skip
            whole = tt.Transformer(args)
    _tag(whole)
    _, d, t = plan.mesh_shape
    c, e = plan.context_parallel, plan.expert_parallel
    built = []
    for rank in _fake_ranks(plan.world_size):
        dims = tt.ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
            etp=getattr(p, "expert_tensor_parallel_degree", 1), world_size=plan.world_size,
        )  # fmt: skip
        dims.build_mesh()
        coords = tuple(_local_rank(dims, axis) for axis in ("pp", "batch", "cp", "tp"))
        ours = (rank // (d * c * t), rank // (c * t) % d, rank // t % c, rank % t)
        assert coords == ours, (rank, coords)
        # EP: E consecutive ranks of dp_shard x cp x tp, as the planner prices it
        assert _local_rank(dims, "ep") == (rank % e if e > 1 else 0), rank
        if coords[1:] != (0, 0, 0):
            continue  # the split depends on the pipeline rank only
        stages, chunks = tt.pp.pipeline_module_split(
            whole, dims.get_mesh("pp"), p.pipeline_parallel_schedule, torch.device("cpu"),
            p.module_fqns_per_model_part,
        )  # fmt: skip
        schedule = tt.pp.build_pipeline_schedule(job, stages, lambda out, target: out.sum())
        built += [(s.stage_index, _kept(c), schedule._n_microbatches)
                  for s, c in zip(stages, chunks, strict=True)]  # fmt: skip
    return sorted(built)


def parallelize_torchtitan_toml(toml_text: str, tmp_path: Path) -> int:
    """torchtitan 0.2.2's own ``parallelize_llama`` (TP, FSDP/HSDP or DDP, as its trainer
    applies them to each pipeline stage's model) on its meta Llama3 under the TOML's
    degrees, on rank 0 of a ``fake`` process group of the TOML's world size. Returns that
    world size; raises what torchtitan raises (e.g. its DDP refusal beside PP or TP)."""
    tt = _torchtitan_022()
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize

    path = tmp_path / "parallelize.toml"
    path.write_text(toml_text)
    job = tt.ConfigManager().parse_args(["--job.config_file", str(path)])
    p = job.parallelism
    world = (p.pipeline_parallel_degree * p.data_parallel_replicate_degree
             * p.data_parallel_shard_degree * p.tensor_parallel_degree)  # fmt: skip
    with torch.device("meta"):
        args = tt.TransformerModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                       vocab_size=64, max_seq_len=32)  # fmt: skip
        whole = tt.Transformer(args)
    import torchtitan.distributed.parallel_dims as parallel_dims

    # torchtitan falls back to "cuda" when it finds no accelerator: the mesh on the CPU here.
    device = parallel_dims.device_type
    parallel_dims.device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = _fake_ranks(world)
    next(ranks)  # rank 0: every rank applies the same styles to its share
    try:
        dims = tt.ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
            etp=getattr(p, "expert_tensor_parallel_degree", 1), world_size=world,
        )  # fmt: skip
        dims.build_mesh()
        llama3_parallelize.parallelize_llama(whole, dims, job)
    finally:
        ranks.close()
        parallel_dims.device_type = device
    return world


def _local_rank(dims: Any, axis: str) -> int:
    """This rank's coordinate on torchtitan's ``axis`` (0 where the axis has size 1, which
    torchtitan does not build)."""
    mesh = dims.get_optional_mesh(axis)
    return 0 if mesh is None else int(mesh.get_local_rank())


# ---------------------------------------------------------------- torchtitan 0.3.0


@cache
def _torchtitan_030() -> types.SimpleNamespace:
    found = version("torchtitan")
    if found is None or not found.startswith("0.3."):
        raise Unavailable(
            f"torchtitan 0.3 is not importable (found {found}); `make install` installs it "
            "(docs/frameworks.md)"
        )
    try:
        import torchtitan.distributed.pipeline_parallel as pipeline_parallel
        from torchtitan.config import ParallelismConfig, TrainingConfig
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as exc:
        raise Unavailable(f"torchtitan {found} does not import here: {exc}") from exc
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.trainer import Trainer
    except ImportError:  # the light install: config classes and pipeline code only
        ConfigManager = Trainer = None  # noqa: N806
    return types.SimpleNamespace(
        pp=pipeline_parallel, ParallelismConfig=ParallelismConfig,
        TrainingConfig=TrainingConfig, ParallelDims=ParallelDims,
        ConfigManager=ConfigManager, Trainer=Trainer,
    )  # fmt: skip


def trainer_base() -> Any:
    """A default ``Trainer.Config`` (torchtitan 0.3): the BASE the checks apply plans to."""
    return _torchtitan_030().Trainer.Config()


def _llama3_030() -> torch.nn.Module:
    """torchtitan 0.3.0's own Llama3 model at the tiny Llama's sizes, on the meta device."""
    try:
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    except ImportError as exc:  # its MoE kernels import triton
        raise Unavailable(f"torchtitan 0.3's Llama3 does not import here: {exc}") from exc
    config = Llama3Model.Config(
        dim=32, vocab_size=64,
        tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=32),
        norm=RMSNorm.Config(normalized_shape=32),
        lm_head=Linear.Config(in_features=32, out_features=64),
        layers=_build_llama3_layers(
            n_layers=4, dim=32, n_heads=4, n_kv_heads=2, hidden_dim=64,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=32, theta=10000.0),
            attn_backend="flex",
        ),
    )  # fmt: skip
    with torch.device("meta"):
        return config.build()  # type: ignore[no-any-return]


_loaded = itertools.count()


def load_torchtitan_python(plan: Plan, tmp_path: Path) -> tuple[Any, Any, str]:
    """(ParallelismConfig, TrainingConfig, how) from the emitted module: through
    ``ConfigManager --module --config autopipe_config`` into a ``Trainer.Config`` when the
    trainer imports, else through the two config classes alone."""
    tt = _torchtitan_030()
    module = f"autopipe_plan_{next(_loaded)}"
    base = "framework_checks:trainer_base" if tt.Trainer is not None else ""
    (tmp_path / f"{module}.py").write_text(to_torchtitan_python(plan, base))
    sys.path.insert(0, str(tmp_path))
    try:
        if tt.Trainer is not None:
            config = tt.ConfigManager().parse_args(["--module", module, "--config",
                                                    "autopipe_config"])  # fmt: skip
            assert config.activation_checkpoint is None or plan.stages[0].checkpoint
            return config.parallelism, config.training, "ConfigManager -> Trainer.Config"
        emitted = importlib.import_module(module)
        return (
            tt.ParallelismConfig(**emitted.PARALLELISM),
            tt.TrainingConfig(**emitted.TRAINING),
            "ParallelismConfig / TrainingConfig",
        )
    finally:
        sys.path.remove(str(tmp_path))


def run_torchtitan_python(
    plan: Plan, name: str, tmp_path: Path
) -> list[tuple[int, list[str], int]]:
    """Per chunk torchtitan 0.3.0 builds from the emitted module: (stage index, modules
    kept, its schedule's M). On every rank of the world, ParallelDims builds torchtitan's
    mesh, whose pp/batch/tp coordinates must be the plan's (pp outermost, tp innermost;
    ``batch`` is torchtitan's data-parallel axis, replicated and sharded together)."""
    tt = _torchtitan_030()
    parallelism, training, _ = load_torchtitan_python(plan, tmp_path)
    whole = _llama3_030() if name == "llama" else None
    if whole is None:
        with torch.device("meta"):
            whole = tiny_gpt()[0]
    _tag(whole)
    _, d, t = plan.mesh_shape
    c, e = plan.context_parallel, plan.expert_parallel
    built = []
    for rank in _fake_ranks(plan.world_size):
        dims = tt.ParallelDims.from_config(parallelism, plan.world_size)
        dims.build_mesh()
        coords = tuple(_local_rank(dims, axis) for axis in ("pp", "batch", "cp", "tp"))
        ours = (rank // (d * c * t), rank // (c * t) % d, rank // t % c, rank % t)
        assert coords == ours, (rank, coords)
        # EP: E consecutive ranks of dp_shard x cp x tp, as the planner prices it
        assert _local_rank(dims, "ep") == (rank % e if e > 1 else 0), rank
        if coords[1:] != (0, 0, 0):
            continue  # the split depends on the pipeline rank only
        stages, chunks = tt.pp._pipeline_module_split(
            whole, dims.get_mesh("pp"), parallelism.pipeline_parallel_schedule,
            torch.device("cpu"), parallelism.module_fqns_per_model_part,
        )  # fmt: skip
        schedule = tt.pp._build_pipeline_schedule(
            parallelism=parallelism, local_batch_size=training.local_batch_size,
            stages=stages, loss_fn=lambda out, target: (out.sum(), None),
        )  # fmt: skip
        built += [(s.stage_index, _kept(c), schedule._n_microbatches)
                  for s, c in zip(stages, chunks, strict=True)]  # fmt: skip
    return sorted(built)


# ---------------------------------------------------------------- Megatron-Core 0.16

MEGATRON_ONE_OF = (
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--pipeline-model-parallel-layout",
)
"""Megatron-LM's validate_args (arguments.py, 0.16 and 0.19): "No more than one of" these."""


def run_megatron(plan: Plan) -> list[tuple[int, int, int]]:
    """Per chunk Megatron-Core builds from the emitted flags: (chunk, decoder layers, M);
    asserts that its rank arithmetic gives the plan's mesh and that the documented
    validate_args rules hold."""
    if version("megatron-core") is None:
        raise Unavailable("megatron-core is not installed (pip install -e '.[emit]')")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = to_megatron(plan)
    args = out["args"]
    flag: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            flag[arg] = args[i + 1] if has_value else None
    assert sum(f in flag for f in MEGATRON_ONE_OF) <= 1, args
    tp, pp = int(flag["--tensor-model-parallel-size"] or 0), int(flag["--pipeline-model-parallel-size"] or 0)  # fmt: skip
    # Megatron-LM's validate_args (documented, not a registry package): the world size is
    # divisible by TP x PP (x CP) and the rest is the data-parallel size; without
    # --global-batch-size it takes micro x data-parallel size (M = 1); sequence parallelism
    # is dropped with TP = 1 (TransformerConfig below refuses it outright).
    world = out["world_size"]
    cp = int(flag.get("--context-parallel-size") or 1)
    ep = int(flag.get("--expert-model-parallel-size") or 1)
    etp = int(flag.get("--expert-tensor-parallel-size") or tp)
    assert world % (tp * pp * cp) == 0
    # validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS == "1" with TP or CP > 1.
    if tp > 1 or cp > 1:
        assert out["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1", out
    # validate_args: --num-experts (the model's, which the output asks for) is a multiple
    # of the EP size; the check gives 2 experts per EP rank.
    experts = 2 * ep if ep > 1 else None
    if ep > 1:
        assert f"a multiple of {ep}" in out["needs"][0], out
        assert experts is not None and experts % ep == 0
    dp = world // (tp * pp * cp)
    recompute = flag.get("--recompute-num-layers")
    moe: dict[str, Any] = {}
    if ep > 1:  # what TransformerConfig checks of the EP flags (it needs the experts too)
        moe = dict(
            num_moe_experts=experts, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            moe_token_dispatcher_type=flag["--moe-token-dispatcher-type"],
        )  # fmt: skip
    config = TransformerConfig(
        num_layers=int(flag["--num-layers"] or 0), hidden_size=32, num_attention_heads=4,
        tensor_model_parallel_size=tp, sequence_parallel="--sequence-parallel" in flag,
        pipeline_model_parallel_size=pp,
        pipeline_model_parallel_layout=flag["--pipeline-model-parallel-layout"],
        pipeline_dtype=torch.float32,
        recompute_granularity=flag.get("--recompute-granularity"),
        recompute_method=flag.get("--recompute-method"),
        recompute_num_layers=int(recompute) if recompute else None,
        context_parallel_size=cp, **moe,
    )  # fmt: skip
    assert (config.context_parallel_size, config.expert_model_parallel_size) == (
        plan.context_parallel, plan.expert_parallel)  # fmt: skip
    # parallel_state.initialize_model_parallel's rank arithmetic (order tp-cp-ep-dp-pp)
    # against the plan's mesh (pp, dp, cp, tp: runtime/distributed/mesh.py).
    ranks = torch.arange(world).reshape(pp, dp, cp, tp)
    groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for axis, dim in zip((*MESH_DIM_NAMES[:2], "cp", "tp"), range(4), strict=True):
        ours = sorted(ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist())
        assert sorted(groups.get_ranks(axis)) == ours, axis
    if ep > 1:
        # Its expert groups (initialize_model_parallel's second RankGenerator): E consecutive
        # ranks of each pipeline stage's D x C x T, the EP group the planner prices
        # (planner/context_expert.py).
        experts_at = RankGenerator(
            tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
        )
        ours = sorted(torch.arange(world).reshape(-1, ep).tolist())
        assert sorted(experts_at.get_ranks("ep")) == ours
    calc = ConstantNumMicroBatchesCalculator(
        int(flag["--global-batch-size"] or 0), int(flag["--micro-batch-size"] or 0), dp, None, 0
    )
    layout = config.pipeline_model_parallel_layout
    v = layout.virtual_pipeline_model_parallel_size
    return [
        (c, layout.layout[c % pp][c // pp].count(LayerType.decoder), calc.get())
        for c in range(pp * v)
    ]


def plan_layers(plan: Plan) -> list[int]:
    """Decoder layers in each of the plan's chunks."""
    return [sum(u.startswith(("model.layers.", "blocks.")) for u in s.units) for s in plan.stages]
