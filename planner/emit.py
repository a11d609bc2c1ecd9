"""Hand a plan to the trainer you already use, in its own words. Torch-free.

- :func:`to_torch`: ``torch.distributed.pipelining`` (``pipeline(model, mb_args,
  split_spec=...)`` and a schedule class);
- :func:`to_torchtitan`: a torchtitan 0.2.2 job config (TOML: ``[training]`` batch,
  ``[parallelism]`` keys);
- :func:`to_megatron`: Megatron-LM's ``--pipeline-model-parallel-layout`` and batch and
  recompute flags (Megatron-Core 0.16).

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
from autopipe.planner.schedules import TORCH_CLASSES

from autopipe.core.errors import AutopipeError
from autopipe.core.plan import Plan

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
# others (its schedule follows the layout's stages per rank, not a name).
MEGATRON_SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}


class EmitError(AutopipeError, ValueError):
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


_TOML_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                       "\f": "\\f", "\r": "\\r"}  # fmt: skip


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quote and backslash escaped, control characters as
    ``\\uXXXX``, everything else (astral characters too) as itself. JSON's escaping would
    not do: it writes an astral character as a surrogate pair, which TOML refuses."""
    out = []
    for ch in text:
        if ch in _TOML_SHORT_ESCAPES:
            out.append(_TOML_SHORT_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:  # a lone surrogate has no UTF-8 form at all
            raise EmitError(f"no TOML form for {text!r} (a lone surrogate)")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


# torchtitan's own Llama-like models (llama3, qwen3, ...) name their modules
# tok_embeddings, layers.N, norm, output; a Hugging Face LlamaForCausalLM-like model names
# them model.embed_tokens, model.layers.N, model.norm, lm_head (model.rotary_emb holds no
# parameters: torchtitan keeps RoPE in its root's freqs_cis buffer, which every stage keeps).
_HF_LLAMA_TO_TORCHTITAN = (
    (re.compile(r"model\.embed_tokens"), "tok_embeddings"),
    (re.compile(r"model\.layers\.(\d+)"), r"layers.\1"),
    (re.compile(r"model\.norm"), "norm"),
    (re.compile(r"lm_head"), "output"),
)
_STATELESS = ("model.rotary_emb",)

TORCHTITAN_VERSION = "0.2.2"


def torchtitan_names(units: Sequence[str]) -> tuple[list[str | None], str]:
    """Each unit's name in torchtitan's terms (None: dropped because it holds nothing a
    torchtitan stage needs) and what was done (``""`` or one phrase), or :class:`EmitError`.

    torchtitan's ``pipeline_module_split`` (0.2.2) keeps, per stage, the top-level modules
    named in its part and the named entries of top-level ``ModuleList``/``ModuleDict``
    (``layers.3``); it sets every other top-level module to None. A unit path deeper than
    that would be dropped without a word, so: a Hugging Face Llama-like model's names are
    mapped to torchtitan's own model's (``model.embed_tokens`` -> ``tok_embeddings``,
    ``model.layers.N`` -> ``layers.N``, ``model.norm`` -> ``norm``, ``lm_head`` ->
    ``output``), and any other nested name is refused. O(units)."""
    mapped: list[str | None] = []
    if any(u.startswith("model.layers.") for u in units):
        for unit in units:
            if unit in _STATELESS:
                mapped.append(None)
                continue
            for pattern, target in _HF_LLAMA_TO_TORCHTITAN:
                if pattern.fullmatch(unit):
                    mapped.append(pattern.sub(target, unit))
                    break
            else:
                raise EmitError(
                    f"unit {unit!r} has no counterpart in torchtitan's Llama-like models "
                    "(tok_embeddings, layers.N, norm, output); torchtitan's "
                    "pipeline_module_split would drop it"
                )
        needed = {"tok_embeddings", "norm", "output"}
        if not needed <= set(mapped):
            raise EmitError(
                "the model's units lack "
                + ", ".join(sorted(needed - {m for m in mapped if m}))
                + " of torchtitan's Llama-like models; torchtitan could not build it"
            )
        return mapped, (
            "Hugging Face Llama names mapped to torchtitan's Llama model (tok_embeddings, "
            "layers.N, norm, output); a chunk that held only model.rotary_emb is empty, which "
            "torchtitan's Llama runs as identity (RoPE is its root's freqs_cis buffer)"
        )
    for unit in units:
        parts = unit.split(".")
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise EmitError(
                f"unit {unit!r} is not a top-level module or an entry of a top-level "
                "ModuleList; torchtitan's pipeline_module_split only keeps those and would "
                "drop it: re-plan with --granularity module, or use a model torchtitan names"
            )
        mapped.append(unit)
    return mapped, ""


def to_torchtitan(plan: Plan) -> str:
    """A TOML snippet for torchtitan 0.2.2's job config (``--job.config_file``), the 0.2
    line's format: ``[parallelism]`` ``pipeline_parallel_degree``,
    ``pipeline_parallel_schedule``, ``pipeline_parallel_microbatch_size`` and
    ``module_fqns_per_model_part`` (one list of module paths per model chunk, in order, in
    torchtitan's names: :func:`torchtitan_names`), and ``[training] local_batch_size`` (the
    plan's per-replica batch, so that torchtitan's ``local_batch_size //
    pipeline_parallel_microbatch_size`` is the plan's M), with ``global_batch_size`` when
    the plan has data-parallel replicas. torchtitan 0.3 no longer reads TOML (its config is
    Python) and is not emitted. torchtitan's activation checkpointing is one setting for the
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
    if plan.microbatch_size * plan.microbatches != plan.batch_size:
        raise EmitError(
            f"the batch of {plan.batch_size} is not M={plan.microbatches} micro-batches of "
            f"{plan.microbatch_size}; torchtitan would run a different M"
        )
    units = [u for stage in plan.stages for u in stage.units]
    names, how = torchtitan_names(units)
    rename = dict(zip(units, names, strict=True))
    parts = [[n for u in stage.units if (n := rename[u]) is not None] for stage in plan.stages]
    if not how and not all(parts):  # cannot happen: every unit keeps its name
        raise EmitError("a chunk holds no module torchtitan would keep")
    lines = [
        f"# autopipe plan: {plan.num_stages} ranks x {plan.virtual_stages} chunks, "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size} ({plan.schedule}), "
        f"predicted {plan.iteration_time_s * 1e3:.4g} ms",
        f"# torchtitan {TORCHTITAN_VERSION} job config (the 0.2 line's TOML; torchtitan 0.3 "
        "reads Python configs, not this)",
        *([f"# {how}"] if how else []),
        "[training]",
        f"local_batch_size = {plan.batch_size}",
        *([f"global_batch_size = {plan.batch_size * plan.replicas}"] if plan.replicas > 1 else []),
        "",
        "[parallelism]",
        f"pipeline_parallel_degree = {plan.num_stages}",
        *([f"data_parallel_replicate_degree = {plan.replicas}"] if plan.replicas > 1 else []),
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
    # Megatron computes rotary embeddings on every stage: a unit holding only them is no E.
    head_stages = {stage_of[i] for i in range(stack.start) if units[i] not in _STATELESS}
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
            if name in _STATELESS:
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
    --recompute-method uniform --recompute-num-layers N`` with N the layers of each chunk
    (one checkpoint per chunk, as the plan does), so the chunks with layers must hold equal
    layer counts; per-stage re-materialization is refused."""
    if plan.schedule not in MEGATRON_SCHEDULES:
        raise EmitError(
            f"Megatron-Core has no {plan.schedule!r} schedule (it runs 1F1B, interleaved with "
            "virtual stages): re-plan with --schedule 1f1b or interleaved-1f1b"
        )
    symbols = _layout_symbols(plan)
    layout = "|".join(_compress(s) for s in symbols)
    checkpointed = _checkpointed(plan)
    if checkpointed and len(checkpointed) != len(plan.stages):
        raise EmitError(
            f"the plan re-materializes only stages {checkpointed}; Megatron's recompute "
            "flags apply to every stage: re-plan with --checkpoint never or --checkpoint always"
        )
    args = [
        "--num-layers", str(_layer_count(plan)),
        "--pipeline-model-parallel-size", str(plan.num_stages),
        "--pipeline-model-parallel-layout", layout,
        "--micro-batch-size", str(plan.microbatch_size),
        "--global-batch-size", str(plan.microbatches * plan.microbatch_size * plan.replicas),
    ]  # fmt: skip
    if checkpointed:
        # A chunk without layers (only E or L) recomputes nothing whatever the count.
        layers = sorted({s.count("t") for s in symbols} - {0})
        if len(layers) != 1:
            raise EmitError(
                f"the plan re-materializes chunks of {'/'.join(str(s.count('t')) for s in symbols)} "
                "layers; Megatron's --recompute-num-layers is one count for every chunk: "
                "re-plan with --checkpoint never, or with a layer count the chunks share"
            )
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        args += ["--recompute-num-layers", str(layers[0])]
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
    Megatron (its ``args`` also as one shell line), TOML for torchtitan. A plan that breaks
    a pre-flight rule (:mod:`autopipe.planner.preflight`: a hand-edited schedule, V, M or
    placement torch would refuse) is refused first, naming the rule."""
    from autopipe.planner.preflight import preflight

    problems = preflight(plan)
    if problems:
        raise EmitError(f"pre-flight: {problems[0]}")
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
