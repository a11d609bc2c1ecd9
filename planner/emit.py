"""Hand a plan to the trainer you already use, in its own words. Torch-free.

- :func:`to_torch`: ``torch.distributed.pipelining`` (``pipeline(model, mb_args,
  split_spec=...)``, a schedule class) and the ``DeviceMesh`` shape and dim names;
- :func:`to_torchtitan`: a torchtitan 0.2.2 job config (TOML), and
  :func:`to_torchtitan_python`: a torchtitan 0.3.0 config module
  (:mod:`autopipe.planner.emit_torchtitan`);
- :func:`to_megatron`: Megatron-LM's ``--pipeline-model-parallel-layout``, its tensor- and
  data-parallel flags, and batch and recompute flags (Megatron-Core 0.16).

Each refuses, with one line saying why (:class:`EmitError`), what its target cannot express
(per-stage re-materialization where the framework has one global switch, a unit that is
not a module, a schedule or a sharding it lacks), rather than emitting something else.
O(units).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from typing import Any

from autopipe.planner.emit_common import (
    EmitError,
    checkpointed,
    checkpointed_per_stage,
    require_schedule,
)
from autopipe.planner.emit_torchtitan import (
    STATELESS,
    TORCHTITAN_SCHEDULES,
    to_torchtitan,
    to_torchtitan_python,
    torchtitan_names,
)
from autopipe.planner.layers import layer_stack

from autopipe.core.mesh_rules import mesh_problems
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import preflight
from autopipe.core.vocabulary import (
    MESH_DIM_NAMES,
    REPLICATED_TP_STYLES,
    TORCH_CLASSES,
    TORCH_TP_STYLES,
)

__all__ = [
    "EMIT_ALIASES",
    "EMIT_FORMATS",
    "TORCHTITAN_SCHEDULES",
    "EmitError",
    "emit",
    "megatron_command_line",
    "megatron_stage_layers",
    "parse_megatron_layout",
    "to_megatron",
    "to_torch",
    "to_torchtitan",
    "to_torchtitan_python",
    "torch_tp_plan",
    "torchtitan_names",
]

EMIT_FORMATS = (
    "torch", "torchtitan", "torchtitan-python", "torchtitan-0.2", "torchtitan-0.3", "megatron",
)  # fmt: skip
"""``torchtitan`` is torchtitan 0.2.2's TOML, ``torchtitan-python`` torchtitan 0.3.0's
Python config (the current release: 0.3.0 is the newest on the package index, and it reads
no TOML); ``torchtitan-0.2`` and ``torchtitan-0.3`` name them by the release they are for
(:data:`EMIT_ALIASES`)."""
EMIT_ALIASES = {"torchtitan-0.2": "torchtitan", "torchtitan-0.3": "torchtitan-python"}
"""The version-named formats and the format each is."""

# Megatron-Core runs 1F1B, interleaved when there are virtual stages; it has none of the
# others (its schedule follows the layout's stages per rank, not a name).
MEGATRON_SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}


def _stage_to_rank(plan: Plan) -> list[int]:
    """The rank of each of the plan's ``K x V`` chunks (loop or V-shape placement, as the
    plan's schedule places them)."""
    return [s.rank if s.rank >= 0 else i for i, s in enumerate(plan.stages)]


def to_torch(plan: Plan) -> dict[str, Any]:
    """``split_spec`` (module path -> ``"BEGINNING"``, one per stage boundary), ``schedule``
    (the torch class name), ``n_microbatches``, ``stages_per_rank`` and ``stage_to_rank``,
    for ``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING ...})``; beside
    them the mesh: ``mesh_shape`` ``[pp, dp, tp]`` and ``mesh_dim_names`` for
    ``init_device_mesh(device, mesh_shape, mesh_dim_names=...)``, ``shard`` (how the
    training state is sharded over ``dp``) and, with ``tp`` > 1, ``tp_plan`` (module
    pattern -> the ``parallelize_module`` style as its constructor call,
    :func:`torch_tp_plan`).

    ``pipeline()`` has no per-stage re-materialization: a plan that checkpoints a stage is
    refused (re-plan with ``--checkpoint never``, or wrap those modules yourself)."""
    schedule = require_schedule(plan, TORCH_CLASSES, "torch.distributed.pipelining")
    if checkpointed(plan):
        raise EmitError(
            f"the plan re-materializes stages {checkpointed(plan)} and torch's pipeline() "
            "split_spec cannot say so; re-plan with --checkpoint never or wrap those stages "
            "in torch.utils.checkpoint yourself"
        )
    if plan.granularity == "node":
        raise EmitError(
            "the plan's units are graph nodes, not modules; split_spec names modules: "
            "re-plan with --granularity block or module"
        )
    # modules TP leaves whole: the trainer sums their gradients over the TP group itself
    replicated = sorted(p for p, style in plan.tp_plan.items() if style in REPLICATED_TP_STYLES)
    return {
        "split_spec": {stage.units[0]: "BEGINNING" for stage in plan.stages[1:]},
        "schedule": schedule,
        "n_microbatches": plan.microbatches,
        "stages_per_rank": plan.virtual_stages,
        "stage_to_rank": _stage_to_rank(plan),
        "mesh_shape": list(plan.mesh_shape),
        "mesh_dim_names": list(MESH_DIM_NAMES),
        "shard": plan.shard,
        **({"tp_plan": torch_tp_plan(plan)} if plan.tensor_parallel > 1 else {}),
        **({"tp_grad_allreduce": replicated} if replicated else {}),
    }


def torch_tp_plan(plan: Plan) -> dict[str, str]:
    """The plan's ``tp_plan`` (module pattern -> Hugging Face style word) as torch's
    ``ParallelStyle`` constructor calls (:data:`TORCH_TP_STYLES`), which ``parallelize_module``
    takes (it refuses the words); EmitError for a word with no torch style."""
    out = {}
    for pattern, style in plan.tp_plan.items():
        if style in REPLICATED_TP_STYLES:
            continue  # whole on every TP rank: no style, listed in ``tp_grad_allreduce``
        if style not in TORCH_TP_STYLES:
            raise EmitError(
                f"the plan's tp_plan splits {pattern} {style!r}, which has no torch "
                f"ParallelStyle here (known: {', '.join(TORCH_TP_STYLES)})"
            )
        out[pattern] = TORCH_TP_STYLES[style]
    return out


def _layer_count(plan: Plan) -> int:
    stack = layer_stack([u for stage in plan.stages for u in stage.units])
    assert stack is not None  # _layout_symbols refused the plan otherwise
    return stack.num_layers


def _layout_symbols(plan: Plan) -> list[str]:
    """Per stage, its Megatron symbols in order: ``E`` for the units before the layer stack
    (once, where the first of them is), ``t`` per layer, ``L`` for the units after it."""
    units = [u for stage in plan.stages for u in stage.units]
    stack = layer_stack(units)
    if stack is None:
        raise EmitError(
            "Megatron's layout describes one stack of decoder layers between an embedding and "
            "a head; this model's units have "
            + ("no such stack" if not units else "none or several (e.g. an encoder-decoder)")
        )
    stage_of = [s.index for s in plan.stages for _ in s.units]
    # Megatron computes rotary embeddings on every stage: a unit holding only them is no E.
    head_stages = {stage_of[i] for i in range(stack.start) if units[i] not in STATELESS}
    tail_stages = {stage_of[i] for i in range(stack.end, len(units))}
    if len(head_stages) > 1 or len(tail_stages) > 1:
        raise EmitError(
            "the plan splits the units before or after the layer stack over several stages; "
            "Megatron keeps the embedding (E) and the head (L) in one stage each"
        )
    symbols: list[str] = []
    for stage in plan.stages:
        text = ""
        for name in stage.units:
            i = units.index(name)
            if name in STATELESS:
                continue
            if i < stack.start:
                text += "" if "E" in text else "E"
            elif i < stack.end:
                text += "t"
            elif "L" not in text:
                text += "L"
        symbols.append(text)
    return symbols


def _compress(stage: str) -> str:
    """``Ettt`` -> ``Et*3``: runs of one symbol as ``x*N`` (the layout's repeat)."""
    return re.sub(r"(t)\1{2,}", lambda m: f"t*{len(m.group(0))}", stage)


def to_megatron(plan: Plan) -> dict[str, Any]:
    """Megatron-LM's arguments for the plan (Megatron-Core 0.16): ``--num-layers``,
    ``--pipeline-model-parallel-size``, ``--pipeline-model-parallel-layout`` (``E``
    embedding, ``t`` decoder layer, ``L`` loss/head, ``|`` between stages, ``x*N`` repeats;
    the layout's ``K x V`` stages already fix the virtual stages, and Megatron-LM's
    ``validate_args`` refuses ``--num-virtual-stages-per-pipeline-rank`` next to it),
    ``--micro-batch-size`` and ``--global-batch-size`` (``M x micro-batch x replicas``:
    Megatron derives M as ``global / (micro x data-parallel size)``, and without it runs one
    micro-batch), and the recompute flags. Only for GPT-like models (one layer stack), and
    only the schedules Megatron-Core runs (1F1B; interleaved 1F1B, whose layout lists the
    ``K x V`` chunks in model order and places chunk ``c`` on rank ``c mod K``, as the plan
    does). A plan that re-materializes every chunk is ``--recompute-granularity full
    --recompute-method uniform --recompute-num-layers N``: N = 1 for chunks re-materialized
    per unit (one checkpoint per layer, as the plan does), N = the chunk's layers for chunks
    re-materialized whole (one checkpoint per chunk), so every chunk with layers must need
    the same N; re-materializing only some stages is refused.

    The mesh: ``--tensor-model-parallel-size T`` (with ``--sequence-parallel`` when T > 1:
    the plan's TP is Megatron-style with sequence parallelism) and, for a plan whose
    replicas shard the optimizer state (ZeRO-1), ``--use-distributed-optimizer``. Megatron
    has no data-parallel flag: its data-parallel size is ``world size / (T x K)``, so the
    output's ``world_size`` (``K x D x T``, torchrun's process count) fixes D. Megatron-LM's
    distributed optimizer keeps a full gradient buffer on every rank, so a plan sharding
    gradients or parameters (ZeRO-2/3) is refused. With T > 1 or C > 1, ``env`` holds
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron-LM's ``validate_args`` asserts with
    tensor or context parallelism (:func:`megatron_command_line` sets it).

    Context and expert parallelism: ``--context-parallel-size C`` (``world_size`` is then
    ``K x D x C x T``) and ``--expert-model-parallel-size E`` with
    ``--expert-tensor-parallel-size 1`` (E consecutive ranks of ``D x C x T``, the layout the
    planner prices) and the all-to-all dispatcher; ``needs`` names ``--num-experts``, the
    model's, which ``validate_args`` wants a multiple of E. EP with TP requires sequence
    parallelism (Megatron-Core's ``ModelParallelConfig``)."""
    if plan.schedule not in MEGATRON_SCHEDULES:
        raise EmitError(
            f"Megatron-Core has no {plan.schedule!r} schedule (it runs 1F1B, interleaved with "
            "virtual stages): re-plan with --schedule 1f1b or interleaved-1f1b"
        )
    symbols = _layout_symbols(plan)
    layout = "|".join(_compress(s) for s in symbols)
    recomputed = checkpointed(plan)
    if recomputed and len(recomputed) != len(plan.stages):
        raise EmitError(
            f"the plan re-materializes only stages {recomputed}; Megatron's recompute "
            "flags apply to every stage: re-plan with --checkpoint never or --checkpoint always"
        )
    args = [
        "--num-layers", str(_layer_count(plan)),
        "--pipeline-model-parallel-size", str(plan.num_stages),
        "--pipeline-model-parallel-layout", layout,
        "--micro-batch-size", str(plan.microbatch_size),
        "--global-batch-size", str(plan.microbatches * plan.microbatch_size * plan.data_parallel),
        "--tensor-model-parallel-size", str(plan.tensor_parallel),
    ]  # fmt: skip
    args += _megatron_group_args(plan)
    args += _megatron_mesh_args(plan)
    if recomputed:
        args += _megatron_recompute_args(plan, symbols, recomputed)
    args += _megatron_trainer_args(plan, bool(recomputed))
    out: dict[str, Any] = {"layout": layout, "args": args, "world_size": plan.world_size}
    if plan.tensor_parallel > 1 or plan.context_parallel > 1:
        # Megatron-LM's validate_args asserts it with tensor or context parallelism (before
        # Blackwell), so that their communication kernels are queued before the compute
        # they overlap.
        out["env"] = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    if plan.expert_parallel > 1:
        out["needs"] = [
            f"--num-experts N with N a multiple of {plan.expert_parallel} (validate_args "
            "asserts it with --expert-model-parallel-size; the model's, like its sizes)"
        ]
    return out


def _megatron_group_args(plan: Plan) -> list[str]:
    """``--microbatch-group-size-per-virtual-pipeline-stage G`` for an interleaved plan whose
    M is not a multiple of K: the plan's order is torch's, ``max(1, M // K)`` rounds of
    ``G = M // rounds`` micro-batches per chunk (autopipe/core/schedules.py), which is
    Megatron-Core's schedule table with that G (tests/test_megatron_interleaved_order.py).
    Megatron's default G = K would run another order, and its interleaved schedule refuses
    it when ``0 < M % G < K`` (megatron/core/pipeline_parallel/schedules.py:
    ``forward_backward_pipelining_with_interleaving``, which wants ``K <= G <= M`` and a
    last group of 0 or at least K). Nothing when M is a multiple of K (the default is the
    plan's order) or the plan has one chunk per rank."""
    if plan.schedule != "interleaved-1f1b" or plan.virtual_stages <= 1:
        return []
    rounds = max(1, plan.microbatches // plan.num_stages)
    group = plan.microbatches // rounds
    if group == plan.num_stages:
        return []
    return ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)]


def _megatron_trainer_args(plan: Plan, full_recompute: bool) -> list[str]:
    """Megatron's flags for the plan's trainer options (``plan.trainer``, priced by
    planner/trainer.py):
    ``--fp8-format hybrid`` (FP8), ``--recompute-granularity selective`` (unless every chunk is
    fully re-computed), ``--tp-comm-overlap``, ``--overlap-grad-reduce`` (and
    ``--overlap-param-gather`` with the distributed optimizer),
    ``--accumulate-allreduce-grads-in-fp32`` (fp32 gradient reduction)."""
    r = plan.trainer
    args = []
    if r.precision == "fp8":
        args += ["--fp8-format", "hybrid"]
    if r.selective_recompute and not full_recompute:
        args += ["--recompute-granularity", "selective"]
    if r.tp_comm_overlap and plan.tensor_parallel > 1:
        args.append("--tp-comm-overlap")
    if r.grad_reduce_overlap and plan.data_parallel > 1:
        args.append("--overlap-grad-reduce")
        if plan.shard == "optimizer":
            args.append("--overlap-param-gather")
    if r.grad_reduce_fp32 and plan.data_parallel > 1:
        args.append("--accumulate-allreduce-grads-in-fp32")
    return args


def _megatron_mesh_args(plan: Plan) -> list[str]:
    """Megatron's flags for the plan's TP (with sequence parallelism) and ZeRO-1 sharding;
    EmitError for a sharding Megatron-LM does not run (gradients, parameters)."""
    args = []
    sp = plan.trainer.sequence_parallel
    if plan.tensor_parallel > 1 and plan.expert_parallel > 1 and not sp:
        raise EmitError(
            "Megatron-Core requires sequence parallelism with expert and tensor parallelism "
            "together (ModelParallelConfig); the plan turns it off: re-plan without "
            "--no-sequence-parallel"
        )
    if plan.tensor_parallel > 1 and sp:
        args.append("--sequence-parallel")
    if plan.context_parallel > 1:
        args += ["--context-parallel-size", str(plan.context_parallel)]
    if plan.expert_parallel > 1:
        # Expert TP 1 (Megatron's default is T): E consecutive ranks of D x C x T hold the
        # experts whole, the layout the planner prices, as torchtitan lays EP out.
        # The all-to-all dispatch the planner prices (Megatron's default is all-gather).
        args += ["--expert-model-parallel-size", str(plan.expert_parallel),
                 "--expert-tensor-parallel-size", "1",
                 "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip
    if plan.data_parallel > 1 and plan.shard == "optimizer":
        args.append("--use-distributed-optimizer")
    elif plan.data_parallel > 1 and plan.shard != "none":
        raise EmitError(
            f"the plan shards the {plan.shard} over its {plan.data_parallel} replicas; "
            "Megatron-LM's --use-distributed-optimizer shards the optimizer state only "
            "(ZeRO-1): re-plan with --shard optimizer or none"
        )
    return args


def _megatron_recompute_args(plan: Plan, symbols: list[str], recomputed: list[int]) -> list[str]:
    """The recompute flags of a plan that re-materializes every chunk (``recomputed``);
    EmitError unless every chunk with layers needs the same ``--recompute-num-layers``."""
    # Per unit: one layer per checkpoint; per stage: the chunk's layers in one. A chunk
    # without layers (only E or L) recomputes nothing whatever the count.
    whole = set(checkpointed_per_stage(plan))
    counts = {1 if c not in whole else symbols[c].count("t") for c in recomputed}
    layers = sorted(counts - {0}) or [1]
    if len(layers) != 1:
        what = "/".join(
            f"{s.count('t')} {'whole' if c in whole else 'per layer'}"
            for c, s in enumerate(symbols)
        )
        raise EmitError(
            f"the plan re-materializes chunks of {what} layers; Megatron's "
            "--recompute-num-layers is one count for every chunk (1: per layer, the "
            "chunk's layers: whole): re-plan with --checkpoint never, or with a layer "
            "count the chunks share"
        )
    return [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", str(layers[0]),
    ]  # fmt: skip


def parse_megatron_layout(layout: str) -> list[str]:
    """The stages of a layout string, each expanded to its symbols (``Et*3|(tt|)*2,L`` ->
    ``["Ettt", "tt", "tt", "L"]``), from the documented grammar: ``|`` splits stages,
    ``x*N`` repeats a symbol, ``(pattern)*N`` a pattern, commas are cosmetic, empty stages
    are allowed. ``ValueError`` for anything else."""
    text = layout.replace(",", "")
    pattern = re.compile(r"\(([^()]*)\)\*(\d+)")
    while "(" in text:
        expanded = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            raise ValueError(f"unbalanced parentheses in layout {layout!r}")
        text = expanded
    text = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        if not set(stage) <= set("EtmL"):
            raise ValueError(f"layout {layout!r} has symbols other than E, t, m, L, |, *, ()")
    return stages


def megatron_stage_layers(layout: str) -> list[int]:
    """Decoder layers per stage of a layout string."""
    return [stage.count("t") for stage in parse_megatron_layout(layout)]


def emit(plan: Plan, fmt: str, base: str = "") -> str:
    """The plan in ``fmt`` (one of :data:`EMIT_FORMATS`) as text: JSON for torch and
    Megatron (its ``args`` also as one shell line), TOML for torchtitan, a Python module for
    torchtitan-python (``base``: its ``BASE``, :func:`to_torchtitan_python`). A plan that breaks
    a pre-flight rule (:mod:`autopipe.core.schedule_rules`: a hand-edited schedule, V, M or
    placement torch would refuse) is refused first, naming the rule, and so is a mesh no rank
    could build (:func:`autopipe.core.mesh_rules.mesh_problems`, the checks ``autopipe run``
    makes: a hand-edited ``tensor_parallel`` the model's heads or the plan's devices refuse)."""
    problems = preflight(plan) + mesh_problems(plan)
    if problems:
        raise EmitError(f"pre-flight: {problems[0]}")
    fmt = EMIT_ALIASES.get(fmt, fmt)
    if fmt == "torch":
        return json.dumps(to_torch(plan), indent=2) + "\n"
    if fmt == "torchtitan":
        return to_torchtitan(plan)
    if fmt == "torchtitan-python":
        return to_torchtitan_python(plan, base)
    if fmt == "megatron":
        out = to_megatron(plan)
        return json.dumps({**out, "command_line": megatron_command_line(out)}, indent=2) + "\n"
    raise EmitError(f"unknown format {fmt!r}; use one of {', '.join(EMIT_FORMATS)}")


def _shell(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def megatron_command_line(out: dict[str, Any]) -> str:
    """:func:`to_megatron`'s output as one shell line launching Megatron-LM's
    ``pretrain_gpt.py`` on one node with the plan's world size: the environment it needs
    (``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP), ``torchrun --nproc-per-node W``, the args
    (add the model's sizes, data and tokenizer flags; across nodes, torchrun's own)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in out.get("env", {}).items()]
    launch = ["torchrun", "--nproc-per-node", str(out["world_size"]), "pretrain_gpt.py"]
    return " ".join([*env, _shell([*launch, *out["args"]])])
