"""Hand a plan to the trainer you already use, in its own words. Torch-free.

- :func:`to_torch`: ``torch.distributed.pipelining`` (``pipeline(model, mb_args,
  split_spec=...)`` and a schedule class);
- :func:`to_torchtitan`: the ``[parallelism]`` keys of a torchtitan job config (TOML);
- :func:`to_megatron`: Megatron-Core's ``--pipeline-model-parallel-layout`` and friends.

Each refuses, with one line saying why (:class:`EmitError`), what its target cannot express
(per-stage re-materialization where the framework has one global switch, a unit that is
not a module, a schedule it lacks), rather than emitting something else. O(units).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from autopipe.planner.layers import layer_stack
from autopipe.planner.plan_data import Plan
from autopipe.planner.schedules import TORCH_CLASSES

__all__ = [
    "EMIT_FORMATS",
    "EmitError",
    "emit",
    "megatron_stage_layers",
    "parse_megatron_layout",
    "to_megatron",
    "to_torch",
    "to_torchtitan",
]

EMIT_FORMATS = ("torch", "torchtitan", "megatron")

# torch.distributed.pipelining's class for each schedule autopipe plans.
TORCH_SCHEDULES = dict(TORCH_CLASSES)
# The names torchtitan's pipeline_parallel_schedule takes: torch's get_schedule_class keys,
# which are the class names without "Schedule".
TORCHTITAN_SCHEDULES = {k: v.removeprefix("Schedule") for k, v in TORCH_CLASSES.items()}
# Megatron-Core runs 1F1B, interleaved when there are virtual stages; it has none of the
# others (its schedule follows --num-virtual-stages-per-pipeline-rank, not a name).
MEGATRON_SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}


class EmitError(ValueError):
    """The plan uses something the target framework cannot express."""


def _stage_to_rank(plan: Plan) -> list[int]:
    """The rank of each of the plan's ``K x V`` chunks (loop or V-shape placement, as the
    plan's schedule places them)."""
    return [s.rank if s.rank >= 0 else i for i, s in enumerate(plan.stages)]


def _require(plan: Plan, table: dict[str, str], target: str) -> str:
    name = table.get(plan.schedule)
    if name is None:
        raise EmitError(f"{target} has no schedule for autopipe's {plan.schedule!r}")
    return name


def _checkpointed(plan: Plan) -> list[int]:
    return [s.index for s in plan.stages if s.checkpoint]


def to_torch(plan: Plan) -> dict[str, Any]:
    """``split_spec`` (module path -> ``"BEGINNING"``, one per stage boundary), ``schedule``
    (the torch class name), ``n_microbatches``, ``stages_per_rank`` and ``stage_to_rank``,
    for ``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING ...})``.

    ``pipeline()`` has no per-stage re-materialization: a plan that checkpoints a stage is
    refused (re-plan with ``--checkpoint never``, or wrap those modules yourself)."""
    schedule = _require(plan, TORCH_SCHEDULES, "torch.distributed.pipelining")
    if _checkpointed(plan):
        raise EmitError(
            f"the plan re-materializes stages {_checkpointed(plan)} and torch's pipeline() "
            "split_spec cannot say so; re-plan with --checkpoint never or wrap those stages "
            "in torch.utils.checkpoint yourself"
        )
    if plan.granularity == "node":
        raise EmitError(
            "the plan's units are graph nodes, not modules; split_spec names modules: "
            "re-plan with --granularity block or module"
        )
    return {
        "split_spec": {stage.units[0]: "BEGINNING" for stage in plan.stages[1:]},
        "schedule": schedule,
        "n_microbatches": plan.microbatches,
        "stages_per_rank": plan.virtual_stages,
        "stage_to_rank": _stage_to_rank(plan),
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string for these names
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_torchtitan(plan: Plan) -> str:
    """A TOML snippet of torchtitan's ``[parallelism]`` keys: ``pipeline_parallel_degree``,
    ``pipeline_parallel_schedule``, ``pipeline_parallel_microbatch_size`` and
    ``module_fqns_per_model_part`` (one list of module paths per model chunk, in order).

    The key names follow torchtitan's ``JobConfig`` ``[parallelism]`` section as of
    torchtitan 0.2 (2025; later versions renamed ``module_fqns_per_model_part`` to
    ``pipeline_parallel_module_fqns_per_model_part`` and count micro-batches with
    ``num_pp_microbatches``). torchtitan's activation checkpointing is one setting for the
    whole model, so per-stage re-materialization is refused; all or none is emitted as
    ``[activation_checkpoint] mode``."""
    schedule = _require(plan, TORCHTITAN_SCHEDULES, "torchtitan")
    if plan.granularity == "node":
        raise EmitError(
            "the plan's units are graph nodes, not modules; torchtitan's "
            "module_fqns_per_model_part names modules: re-plan with --granularity block"
        )
    checkpointed = _checkpointed(plan)
    if checkpointed and len(checkpointed) != len(plan.stages):
        raise EmitError(
            f"the plan re-materializes only stages {checkpointed}; torchtitan's "
            "[activation_checkpoint] mode applies to every stage: re-plan with "
            "--checkpoint never or --checkpoint always"
        )
    parts = [list(stage.units) for stage in plan.stages]
    lines = [
        f"# autopipe plan: {plan.num_stages} ranks x {plan.virtual_stages} chunks, "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size} ({plan.schedule}), "
        f"predicted {plan.iteration_time_s * 1e3:.4g} ms",
        "# keys of torchtitan's [parallelism] section as of torchtitan 0.2",
        "[parallelism]",
        f"pipeline_parallel_degree = {plan.num_stages}",
        f"pipeline_parallel_schedule = {_toml_value(schedule)}",
        f"pipeline_parallel_microbatch_size = {plan.microbatch_size}",
        "module_fqns_per_model_part = [",
        *(f"    {_toml_value(part)}," for part in parts),
        "]",
        "",
        "[activation_checkpoint]",
        f"mode = {_toml_value('full' if checkpointed else 'none')}",
    ]
    return "\n".join(lines) + "\n"


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
    head_stages = {stage_of[i] for i in range(stack.start)}
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
    """Megatron-Core's arguments for the plan's split: ``--pipeline-model-parallel-layout``
    (``E`` embedding, ``t`` decoder layer, ``L`` loss/head, ``|`` between stages, ``x*N``
    repeats), ``--pipeline-model-parallel-size``, ``--num-virtual-stages-per-pipeline-rank``
    and the recompute flags. Only for GPT-like models (one layer stack), and only the
    schedules Megatron-Core runs (1F1B; interleaved 1F1B, whose layout lists the ``K x V``
    chunks in model order and places chunk ``c`` on rank ``c mod K``, as the plan does).
    Megatron recomputes the same number of layers on every stage, so per-stage
    re-materialization is refused."""
    if plan.schedule not in MEGATRON_SCHEDULES:
        raise EmitError(
            f"Megatron-Core has no {plan.schedule!r} schedule (it runs 1F1B, interleaved with "
            "virtual stages): re-plan with --schedule 1f1b or interleaved-1f1b"
        )
    layout = "|".join(_compress(s) for s in _layout_symbols(plan))
    checkpointed = _checkpointed(plan)
    if checkpointed and len(checkpointed) != len(plan.stages):
        raise EmitError(
            f"the plan re-materializes only stages {checkpointed}; Megatron's recompute "
            "flags apply to every stage: re-plan with --checkpoint never or --checkpoint always"
        )
    args = [
        "--num-layers", str(_layer_count(plan)),
        "--pipeline-model-parallel-size", str(plan.num_stages),
        "--num-virtual-stages-per-pipeline-rank", str(plan.virtual_stages),
        "--pipeline-model-parallel-layout", layout,
        "--micro-batch-size", str(plan.microbatch_size),
    ]  # fmt: skip
    if checkpointed:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        args += ["--recompute-num-layers", "1"]
    return {"layout": layout, "args": args}


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


def emit(plan: Plan, fmt: str) -> str:
    """The plan in ``fmt`` (one of :data:`EMIT_FORMATS`) as text: JSON for torch and
    Megatron (its ``args`` also as one shell line), TOML for torchtitan."""
    if fmt == "torch":
        return json.dumps(to_torch(plan), indent=2) + "\n"
    if fmt == "torchtitan":
        return to_torchtitan(plan)
    if fmt == "megatron":
        out = to_megatron(plan)
        return json.dumps({**out, "command_line": _shell(out["args"])}, indent=2) + "\n"
    raise EmitError(f"unknown format {fmt!r}; use one of {', '.join(EMIT_FORMATS)}")


def _shell(args: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in args)
