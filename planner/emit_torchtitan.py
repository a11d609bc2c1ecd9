"""A plan in torchtitan's words, one form per torchtitan line. Torch-free.

- :func:`to_torchtitan`: torchtitan 0.2.2's TOML job config (``--job.config_file``);
- :func:`to_torchtitan_python`: torchtitan 0.3.0's Python config, a module for its
  ``ConfigManager`` (``--module MODULE --config autopipe_config``), which builds
  ``Trainer.Config`` objects in Python and reads no TOML.

Both carry the same fields, read from the named version's ``ParallelismConfig`` /
``TrainingConfig`` (:func:`torchtitan_fields`): the pipeline keys, the mesh degrees, the
batch that makes torchtitan's micro-batch count the plan's, and activation checkpointing.
O(units).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopipe.planner.emit_common import (
    EmitError,
    checkpointed,
    checkpointed_per_stage,
    require_schedule,
)

from autopipe.core.plan import Plan
from autopipe.core.vocabulary import TORCH_CLASSES

__all__ = [
    "TORCHTITAN_PYTHON_VERSION",
    "TORCHTITAN_SCHEDULES",
    "TORCHTITAN_VERSION",
    "TorchtitanFields",
    "to_torchtitan",
    "to_torchtitan_python",
    "torchtitan_fields",
    "torchtitan_names",
]

TORCHTITAN_VERSION = "0.2.2"
"""The torchtitan release the TOML form was read from (the 0.2 line's last format)."""
TORCHTITAN_PYTHON_VERSION = "0.3.0"
"""The torchtitan release the Python form was read from."""

# The names torchtitan's pipeline_parallel_schedule takes: torch's get_schedule_class keys,
# which are the class names without "Schedule".
TORCHTITAN_SCHEDULES = {k: v.removeprefix("Schedule") for k, v in TORCH_CLASSES.items()}

# torchtitan's Llama3 names its modules tok_embeddings, layers.N, norm and its head
# `output` (0.2.2) or `lm_head` (0.3.0); a Hugging Face LlamaForCausalLM-like model names
# them model.embed_tokens, model.layers.N, model.norm, lm_head. model.rotary_emb holds no
# parameters: torchtitan keeps RoPE in buffers every stage keeps.
_HEAD = {TORCHTITAN_VERSION: "output", TORCHTITAN_PYTHON_VERSION: "lm_head"}
STATELESS = ("model.rotary_emb",)


def torchtitan_names(
    units: Sequence[str], version: str = TORCHTITAN_VERSION
) -> tuple[list[str | None], str]:
    """Each unit's name in torchtitan ``version``'s terms (None: dropped, it holds nothing a
    torchtitan stage needs) and what was done (``""`` or one phrase), or :class:`EmitError`.

    torchtitan's ``pipeline_module_split`` (0.2.2; ``_pipeline_module_split`` in 0.3.0)
    keeps, per stage, the top-level modules named in its part and the named entries of
    top-level ``ModuleList``/``ModuleDict`` (``layers.3``); it sets every other top-level
    module to None. A deeper unit path would be dropped without a word, so a Hugging Face
    Llama-like model's names are mapped to torchtitan's own Llama's, and any other nested
    name is refused. O(units)."""
    head = _HEAD[version]
    table = (
        (re.compile(r"model\.embed_tokens"), "tok_embeddings"),
        (re.compile(r"model\.layers\.(\d+)"), r"layers.\1"),
        (re.compile(r"model\.norm"), "norm"),
        (re.compile(r"lm_head"), head),
    )
    mapped: list[str | None] = []
    if any(u.startswith("model.layers.") for u in units):
        for unit in units:
            if unit in STATELESS:
                mapped.append(None)
                continue
            for pattern, target in table:
                if pattern.fullmatch(unit):
                    mapped.append(pattern.sub(target, unit))
                    break
            else:
                raise EmitError(
                    f"unit {unit!r} has no counterpart in torchtitan's Llama-like models "
                    f"(tok_embeddings, layers.N, norm, {head}); torchtitan's "
                    "pipeline_module_split would drop it"
                )
        needed = {"tok_embeddings", "norm", head}
        if not needed <= set(mapped):
            raise EmitError(
                "the model's units lack "
                + ", ".join(sorted(needed - {m for m in mapped if m}))
                + " of torchtitan's Llama-like models; torchtitan could not build it"
            )
        return mapped, (
            f"Hugging Face Llama names mapped to torchtitan {version}'s Llama3 model "
            f"(tok_embeddings, layers.N, norm, {head}); a chunk that held only "
            "model.rotary_emb is empty (torchtitan keeps RoPE in buffers)"
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


@dataclass(frozen=True)
class TorchtitanFields:
    """What a plan sets in torchtitan's config: ``parallelism`` and ``training`` are
    ``ParallelismConfig`` / ``TrainingConfig`` field values by name; ``full_checkpoint``
    is activation checkpointing of every layer (else none), exactly the plan's per-unit
    re-materialization; ``note`` says what was renamed, and which stages the plan
    re-materializes whole (torchtitan has no per-stage mode)."""

    parallelism: dict[str, Any]
    training: dict[str, Any]
    full_checkpoint: bool
    note: str


def _data_parallel(plan: Plan, version: str) -> dict[str, Any]:
    """torchtitan's two data-parallel degrees (and FSDP's resharding) for the plan's D
    replicas and sharding: plain replicas are ``data_parallel_replicate_degree``;
    sharded ones are ``data_parallel_shard_degree`` (FSDP2's ``fully_shard``), resharding
    after forward for ZeRO-3 (``parameters``) and not for ZeRO-2 (``gradients``: the
    parameters stay gathered through forward and backward). torchtitan has no ZeRO-1: its
    sharding always shards gradients too. Both degrees are given, so torchtitan's default
    shard degree of -1 (every leftover rank) never applies.

    torchtitan 0.2.2 runs plain replicas as DDP, which its models' ``parallelize`` refuse
    beside PP or TP ("DDP has not supported > 1D parallelism"): such a plan is refused for
    the TOML; 0.3.0 replicates with ``fully_shard`` over its ``dp_replicate`` mesh (HSDP
    with shard degree 1) and takes it."""
    d = plan.data_parallel
    if d == 1 or plan.shard == "none":
        if d > 1 and version == TORCHTITAN_VERSION and plan.world_size != d:
            raise EmitError(
                f"torchtitan {TORCHTITAN_VERSION} runs the plan's {d} plain replicas as DDP, "
                'which it refuses beside pipeline or tensor parallelism ("DDP has not '
                'supported > 1D parallelism"): emit torchtitan-python (0.3.0 replicates '
                "them with FSDP2), or re-plan with --shard gradients or parameters"
            )
        return {"data_parallel_replicate_degree": d, "data_parallel_shard_degree": 1}
    if plan.shard == "optimizer":
        raise EmitError(
            "the plan shards only the optimizer state (ZeRO-1); torchtitan shards with "
            "FSDP2, which shards the gradients too: re-plan with --shard gradients, "
            "parameters or none"
        )
    return {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": d,
        "fsdp_reshard_after_forward": "always" if plan.shard == "parameters" else "never",
    }


def torchtitan_fields(plan: Plan, version: str = TORCHTITAN_VERSION) -> TorchtitanFields:
    """The plan as torchtitan ``version``'s config fields, or :class:`EmitError` for what
    torchtitan cannot say (graph-node units, per-stage re-materialization, a batch that is
    not M micro-batches, ZeRO-1, a module name its split would drop).

    ``training.local_batch_size`` is the plan's batch per replica, so torchtitan's
    ``local_batch_size // pipeline_parallel_microbatch_size`` is the plan's M (it defaults
    to 8); ``global_batch_size`` is set with data parallelism (one gradient-accumulation
    step). ``module_fqns_per_model_part`` lists the plan's ``K x V`` chunks in model order;
    torchtitan places them loop or V-shape by the schedule, as the plan does."""
    schedule = require_schedule(plan, TORCHTITAN_SCHEDULES, "torchtitan")
    stages_checkpointed = checkpointed(plan)
    _check_sayable(plan, stages_checkpointed)
    units = [u for stage in plan.stages for u in stage.units]
    names, note = torchtitan_names(units, version)
    whole = checkpointed_per_stage(plan)
    if stages_checkpointed and whole:
        # torchtitan's "full" wraps every transformer block: per unit, not per stage.
        note = "; ".join(
            n
            for n in (
                note,
                f"the plan re-materializes stages {whole} whole (input kept, one "
                're-computation of the stage); torchtitan\'s mode "full" re-computes one '
                "block at a time, keeping each block's input, so those stages hold memory "
                "other than planned",
            )
            if n
        )
    if plan.context_parallel > 1 and plan.shard == "none":
        # ParallelDims' fsdp mesh is dp_shard x cp: torchtitan shards over the CP ranks always.
        note = "; ".join(
            n
            for n in (
                note,
                f"torchtitan applies FSDP over its {plan.context_parallel} context-parallel "
                "ranks (its fsdp mesh is dp_shard x cp) though the plan shards nothing, so "
                "each rank holds 1/C of the parameters, gathered per layer",
            )
            if n
        )
    if plan.expert_parallel > 1 and plan.tensor_parallel > 1:
        # Its experts stay whole on EP ranks that span TP (expert TP 1, 0.3.0's only layout).
        note = "; ".join(
            n
            for n in (
                note,
                f"torchtitan keeps each expert whole on its {plan.expert_parallel} "
                "expert-parallel ranks, which span the TP ranks (expert TP 1), while the "
                f"plan (and autopipe run) splits each expert over the {plan.tensor_parallel} "
                "TP ranks: its expert memory per rank is not the plan's",
            )
            if n
        )
    # False, not None: a plan without recorded options keeps torchtitan's own default
    gathered = plan.trainer.loss_parallel is False
    if version != TORCHTITAN_VERSION and plan.tensor_parallel > 1 and gathered:
        # 0.3.0's decoder_sharding.py shards lm_head's output over the vocabulary
        # (out_dst_shardings S(-1)) and its loss runs vocab-parallel: no switch off
        note = "; ".join(
            n
            for n in (
                note,
                f"torchtitan {version} always runs loss parallel (the logits sharded over the "
                f"{plan.tensor_parallel} TP ranks) while the plan gathers them to every TP rank "
                "as autopipe run does: its head needs less memory and communication than "
                "planned (re-plan with --loss-parallel to price what it runs)",
            )
            if n
        )
    rename = dict(zip(units, names, strict=True))
    parts = [[n for u in stage.units if (n := rename[u]) is not None] for stage in plan.stages]
    return TorchtitanFields(
        _parallelism(plan, version, schedule, parts),
        _training(plan, version),
        bool(stages_checkpointed),
        note,
    )


def _check_sayable(plan: Plan, stages_checkpointed: list[int]) -> None:
    """EmitError for a plan torchtitan cannot say: graph-node units, re-materialization of
    only some stages (``stages_checkpointed``), a batch that is not M micro-batches."""
    if plan.granularity == "node":
        raise EmitError(
            "the plan's units are graph nodes, not modules; torchtitan's "
            "module_fqns_per_model_part names modules: re-plan with --granularity block"
        )
    if stages_checkpointed and len(stages_checkpointed) != len(plan.stages):
        raise EmitError(
            f"the plan re-materializes only stages {stages_checkpointed}; torchtitan's "
            "activation checkpointing applies to every layer: re-plan with "
            "--checkpoint never or --checkpoint always"
        )
    if plan.microbatch_size * plan.microbatches != plan.batch_size:
        raise EmitError(
            f"the batch of {plan.batch_size} is not M={plan.microbatches} micro-batches of "
            f"{plan.microbatch_size}; torchtitan would run a different M"
        )


def _parallelism(plan: Plan, version: str, schedule: str, parts: list[list[str]]) -> dict[str, Any]:
    """The ``[parallelism]`` fields: the mesh degrees, the schedule, M's size, the chunks."""
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": plan.num_stages,
        **_data_parallel(plan, version),
        "tensor_parallel_degree": plan.tensor_parallel,
    }
    # [parallelism] context_parallel_degree and expert_parallel_degree (0.2.2's
    # config/job_config.py, 0.3.0's config/configs.py), given only when the plan uses them
    if plan.context_parallel > 1:
        parallelism["context_parallel_degree"] = plan.context_parallel
    if plan.expert_parallel > 1:
        parallelism |= _expert_parallel(plan, version, parallelism["data_parallel_shard_degree"])
    if version != TORCHTITAN_VERSION and plan.tensor_parallel > 1:
        # 0.3.0 has the switch (default on); 0.2.2 always runs TP with sequence parallelism.
        parallelism["enable_sequence_parallel"] = True
    parallelism |= {
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
        "module_fqns_per_model_part": parts,
    }
    return parallelism


def _expert_parallel(plan: Plan, version: str, dp_shard: int) -> dict[str, Any]:
    """The expert-parallel keys, or :class:`EmitError` where torchtitan cannot lay them out.

    Both versions' ``ParallelDims`` carve the E expert ranks out of ``dp_shard x cp x tp``
    (their sparse mesh ``pp, dp_replicate, efsdp, ep``, ``efsdp = dp_shard cp tp / E``): E
    consecutive ranks, the layout the planner prices (planner/context_expert.py). Plain
    replicas are ``dp_replicate``, which EP never borrows from, so E must divide
    ``dp_shard x cp x tp``. 0.2.2 also has ``expert_tensor_parallel_degree``: 1 (its default)
    is that layout, the experts whole on each rank and EP spanning the TP ranks; it is
    written so that the file says so."""
    e, c, t = plan.expert_parallel, plan.context_parallel, plan.tensor_parallel
    if (dp_shard * c * t) % e:
        raise EmitError(
            f"torchtitan carves its {e} expert-parallel ranks out of dp_shard x cp x tp = "
            f"{dp_shard} x {c} x {t} (plain replicas are dp_replicate, which it never "
            "borrows from): re-plan with --shard gradients or parameters, or an "
            "--expert-parallel that divides that product"
        )
    keys: dict[str, Any] = {"expert_parallel_degree": e}
    if version == TORCHTITAN_VERSION:
        keys["expert_tensor_parallel_degree"] = 1
    return keys


def _training(plan: Plan, version: str) -> dict[str, Any]:
    """The ``[training]`` fields: the batch per replica (and global, with replicas)."""
    training: dict[str, Any] = {"local_batch_size": plan.batch_size}
    if plan.data_parallel > 1:
        training["global_batch_size"] = plan.batch_size * plan.data_parallel
    if version != TORCHTITAN_VERSION and (plan.num_stages > 1 or plan.expert_parallel > 1):
        # 0.3.0's Trainer.Config refuses CUDA graphs (its default) with pipeline parallelism,
        # and with expert parallelism for its MoE models' synchronous token dispatchers.
        training["disable_cuda_graphs"] = True
    return training


def _header(plan: Plan) -> list[str]:
    mesh = (
        f"mesh pp={plan.num_stages} x dp={plan.data_parallel} x tp={plan.tensor_parallel} = "
        f"{plan.world_size} ranks" + (f", {plan.shard} sharded" if plan.data_parallel > 1 else "")
    )
    return [
        f"autopipe plan: {plan.num_stages} pipeline ranks x {plan.virtual_stages} chunks, "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size} ({plan.schedule}), "
        f"predicted {plan.iteration_time_s * 1e3:.4g} ms",
        mesh + (
            "; torchtitan applies its own model's tensor-parallel plan"
            if plan.tensor_parallel > 1 else ""
        ),
    ]  # fmt: skip


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


def to_torchtitan(plan: Plan) -> str:
    """A TOML job config for torchtitan 0.2.2 (``--job.config_file``; the 0.2 line's
    format): ``[training]`` and ``[parallelism]`` as :func:`torchtitan_fields`, and
    ``[activation_checkpoint] mode`` (``full`` or ``none``)."""
    fields = torchtitan_fields(plan, TORCHTITAN_VERSION)
    p = dict(fields.parallelism)
    trainer = _trainer_keys(plan)
    p.update(trainer["parallelism"])
    mode = "full" if fields.full_checkpoint else trainer["ac_mode"]
    lines = [
        *(f"# {line}" for line in _header(plan)),
        f"# torchtitan {TORCHTITAN_VERSION} job config (the 0.2 line's TOML; torchtitan "
        f"{TORCHTITAN_PYTHON_VERSION} reads Python configs: emit torchtitan-python)",
        *([f"# {fields.note}"] if fields.note else []),
        *([f"# {_compile_note(plan)}"] if _compile_note(plan) else []),
        "[training]",
        *(f"{k} = {_toml_value(v)}" for k, v in fields.training.items()),
        "",
        "[parallelism]",
        *(f"{k} = {_toml_value(v)}" for k, v in p.items() if k != "module_fqns_per_model_part"),
        "module_fqns_per_model_part = [",
        *(f"    {_toml_value(part)}," for part in p["module_fqns_per_model_part"]),
        "]",
        "",
        "[activation_checkpoint]",
        f"mode = {_toml_value(mode)}",
        *(['selective_ac_option = "op"'] if mode == "selective" else []),
        *(["", "[model]", f"converters = {_toml_value(trainer['converters'])}"]
          if trainer["converters"] else []),
        *(["", "[compile]", "enable = true"] if trainer["compile"] else []),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _compiles(plan: Plan) -> bool:
    """Whether torchtitan must compile the model: the plan was made for compiled stages
    (``--compile``), or it asks for async TP, which torchtitan runs only compiled (0.2.2's
    ``maybe_enable_async_tp`` raises "Async TP requires 'model' in --compile.components and
    --compile.enable"; 0.3.0's ``CompileConfig`` refuses it likewise)."""
    r = plan.trainer
    return r.compile or (r.tp_comm_overlap and plan.tensor_parallel > 1)


def _compile_note(plan: Plan) -> str:
    """What the emitted config runs beyond the plan: compiled blocks the plan priced eager."""
    if plan.trainer.compile or not _compiles(plan):
        return ""
    return (
        "torchtitan runs async TP only with torch.compile, so the config compiles the model; "
        "the plan priced its units uncompiled (re-plan with --compile to price what runs)"
    )


def _trainer_keys(plan: Plan) -> dict[str, Any]:
    """torchtitan 0.2.2's keys for the plan's trainer options (``plan.trainer``, priced by
    planner/trainer.py):
    ``[model] converters = ["quantize.linear.float8"]`` for FP8, ``[activation_checkpoint]
    mode = "selective"`` (``selective_ac_option = "op"``) for selective re-computation,
    ``[parallelism] enable_async_tensor_parallel`` for TP comm overlap,
    ``disable_loss_parallel`` with T > 1 (true unless the plan was priced with loss parallel;
    absent where the plan does not say, ``loss_parallel`` None),
    ``fsdp_reshard_after_forward = "never"`` for FSDP2 kept unsharded across micro-batches,
    ``[compile] enable`` where the model must be compiled (:func:`_compiles`)."""
    r = plan.trainer
    par: dict[str, Any] = {}
    if r.loss_parallel is not None and plan.tensor_parallel > 1:
        # 0.2.2's [parallelism] disable_loss_parallel (default false: the logits sharded)
        par["disable_loss_parallel"] = not r.loss_parallel
    if r.tp_comm_overlap and plan.tensor_parallel > 1:
        par["enable_async_tensor_parallel"] = True
    if not r.reshard_after_forward and plan.shard == "parameters":
        par["fsdp_reshard_after_forward"] = "never"
    return {
        "parallelism": par,
        "compile": _compiles(plan),
        "ac_mode": "selective" if r.selective_recompute else "none",
        "converters": ["quantize.linear.float8"] if r.precision == "fp8" else [],
    }


def _py(value: Any) -> str:
    """A Python literal of ``value`` (str, int, bool, nested lists): ``repr`` is exact for
    these and escapes every string."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "[\n" + "".join(f"        {v!r},\n" for v in value) + "    ]"
    return repr(value)


# The generated module's functions: the same for every plan (they read its constants).
_PYTHON_FUNCTIONS = (
    "def apply_plan(config):",
    '    """config (a Trainer.Config) with the plan\'s fields; the others kept."""',
    "    return dataclasses.replace(",
    "        config,",
    "        parallelism=dataclasses.replace(config.parallelism, **PARALLELISM),",
    "        training=dataclasses.replace(config.training, **TRAINING),",
    "        activation_checkpoint=FullAC.Config() if FULL_ACTIVATION_CHECKPOINT else None,",
    "        compile=dataclasses.replace(config.compile, **COMPILE),",
    "    )",
    "",
    "",
    "def autopipe_config():",
    '    """The Trainer.Config of BASE with the plan applied (for --config)."""',
    "    if not BASE:",
    "        raise ValueError(",
    '            "set BASE to the config function of the model the plan was made for, "',
    "            \"as 'module:function', e.g. \"",
    "            \"'torchtitan.models.llama3.config_registry:llama3_8b'\"",
    "        )",
    '    module, name = BASE.split(":")',
    "    return apply_plan(getattr(importlib.import_module(module), name)())",
)


def _compile_fields(plan: Plan) -> dict[str, bool]:
    """torchtitan 0.3.0's ``CompileConfig`` fields: ``enable`` where the model must be
    compiled (:func:`_compiles`), and ``enable_async_tensor_parallel`` (0.3.0 moved async TP
    there from ``[parallelism]``) for TP comm overlap; empty: the base config's kept."""
    if not _compiles(plan):
        return {}
    out = {"enable": True}
    if plan.trainer.tp_comm_overlap and plan.tensor_parallel > 1:
        out["enable_async_tensor_parallel"] = True
    return out


def to_torchtitan_python(plan: Plan, base: str = "") -> str:
    """A Python module for torchtitan 0.3.0's ``ConfigManager``, which loads a config as
    ``--module MODULE --config FUNCTION`` (a function returning a ``Trainer.Config``) and
    reads no TOML. The module holds ``PARALLELISM`` and ``TRAINING`` (``ParallelismConfig``
    / ``TrainingConfig`` fields, :func:`torchtitan_fields`), ``apply_plan(config)`` (a
    ``Trainer.Config`` with those fields replaced, every other field kept, and
    ``activation_checkpoint`` set to ``FullAC.Config()`` or None, ``compile`` with
    ``COMPILE``'s fields (:func:`_compile_fields`); torchtitan's own
    ``__post_init__`` checks run again), and ``autopipe_config()`` for ``--config``, which
    applies the plan to ``BASE``: ``"module:function"``, the ``config_registry`` function of
    the model the plan was made for (``base``; empty: ``autopipe_config`` says to set it)."""
    fields = torchtitan_fields(plan, TORCHTITAN_PYTHON_VERSION)
    if base and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", base):
        raise EmitError(f"--base {base!r} is not MODULE:FUNCTION (e.g. "
                        "torchtitan.models.llama3.config_registry:llama3_8b)")  # fmt: skip
    note = _compile_note(plan)
    header = [*_header(plan), *([fields.note] if fields.note else []), *([note] if note else [])]
    lines = [
        f'"""torchtitan {TORCHTITAN_PYTHON_VERSION} config from an autopipe plan.',
        "",
        *header,
        "",
        "Run: torchrun --nproc-per-node N -m torchtitan.train --module THIS_MODULE "
        "--config autopipe_config",
        f"(N processes per node, {plan.world_size} in all), with BASE the config function of "
        "the model the plan was made for;",
        "or, in your own config_registry: return apply_plan(your_config()).",
        '"""',
        "",
        "import dataclasses",
        "import importlib",
        "",
        "from torchtitan.distributed.activation_checkpoint import FullAC",
        "",
        f"BASE = {base!r}",
        "",
        "PARALLELISM = {",
        *(f"    {k!r}: {_py(v)}," for k, v in fields.parallelism.items()),
        "}",
        "TRAINING = {",
        *(f"    {k!r}: {_py(v)}," for k, v in fields.training.items()),
        "}",
        f"FULL_ACTIVATION_CHECKPOINT = {fields.full_checkpoint!r}",
        f"COMPILE = {_compile_fields(plan)!r}",
        "",
        "",
        *_PYTHON_FUNCTIONS,
    ]
    return "\n".join(lines) + "\n"
