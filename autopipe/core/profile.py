"""The Profile: what each unit of a model costs, as plain data.

This module must not import torch: the planner reads Profiles without a model.
All times are seconds for one call at ``Profile.batch_size`` samples, all sizes
are bytes at ``Profile.batch_size`` samples unless a field says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopipe.core.datafile import atomic_write_json, check_version, known_fields, load_json_file
from autopipe.core.errors import UsageError
from autopipe.core.fields import LARGEST_PROFILE_VALUE, FieldError, check_dataclass
from autopipe.core.meta_fields import lift_meta
from autopipe.core.profile_records import CountedBlocks, Counting, Measurement

__all__ = [
    "PROFILE_VERSION",
    "Profile",
    "ProfileFormatError",
    "UnitProfile",
]

PROFILE_VERSION = 1

_META_FIELDS = {
    "loss_forward_s": "loss_forward_s",
    "loss_backward_s": "loss_backward_s",
    "counted_blocks": "counted_blocks",
    "optimizer_chosen": "optimizer_chosen",
    "state_bytes_per_parameter": "state_bytes_per_parameter",
}
"""``Profile.meta`` keys of earlier writers (schema v1) and the fields they are now."""
_MEASUREMENT_KEYS = tuple(f.name for f in dataclasses.fields(Measurement))
"""The flat ``Profile.meta`` keys that are now ``Profile.measurement``'s fields."""
_COUNTING_KEYS = {
    "device_spec": "device_spec",
    "analytic_units": "units",
    "analytic_smaller_sizes": "smaller_sizes",
    "analytic_loss": "loss",
    "analytic_seconds": "seconds",
}
"""The flat ``Profile.meta`` keys of the analytic profiler that are now
``Profile.counting``'s fields (``{meta key: field}``); ``analytic_batch_size`` was always
``Profile.batch_size`` and is dropped."""


class ProfileFormatError(UsageError, ValueError):
    """A profile file is not a valid autopipe profile (corrupt, foreign or too old)."""


@dataclass
class UnitProfile:
    """Cost of one unit: a contiguous run of graph nodes, usually one module.

    Times scale with micro-batch size ``b`` as ``t(b) = overhead + (t(B) - overhead) * b / B``
    where ``B`` is the profile's batch size: ``forward_overhead_s`` is the fixed per-call
    part (kernel launches, Python) that does not shrink with smaller micro-batches.
    """

    name: str
    """Unit name, a module path such as ``blocks.3`` (or a node name for glue); a module
    called several times is one unit per call, ``blocks.3#k`` for its ``k``-th further call
    (``autopipe.profiler.units``)."""
    kind: str = ""
    """Class name of the module, or ``"glue"`` for free functions between modules."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    parameter_count: int = 0
    parameter_bytes: int = 0
    activation_bytes: int = 0
    """Bytes saved for backward during this unit's forward (deduplicated by storage)."""
    output_bytes: int = 0
    forward_overhead_s: float = 0.0
    backward_overhead_s: float = 0.0
    peak_bytes: int = 0
    """Transient peak above the saved activations during forward+backward; 0 if unknown."""
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    shared_parameters: list[str] = field(default_factory=list)
    """Names of parameters this unit shares with another unit (tied weights)."""
    gradient_bytes: int = 0
    """Bytes of this unit's parameter gradients (= parameter bytes of trainable parameters)."""
    optimizer_bytes: int = 0
    """Bytes of optimizer state for this unit's parameters (``Profile.optimizer``)."""
    buffer_bytes: int = 0
    """Bytes of non-parameter buffers (e.g. BatchNorm running statistics)."""
    backward_input_s: float = 0.0
    """Seconds of the unit's backward computing the gradient of its inputs (the zero-bubble
    schedules' "B"), at ``Profile.batch_size``. Measured: ``autograd.grad`` with respect to
    the unit's inputs, keeping the graph (the last unit's includes the loss's backward);
    analytic: ``backward_s`` less W's FLOP share. Default 0 with ``backward_weight_s`` 0:
    "not split" (profiles written before the split, or measured with
    ``split_backward=False``), and such files load so; the planner then assumes a unit with
    parameters splits half and half and one without is all B."""
    backward_weight_s: float = 0.0
    """Seconds of the unit's backward computing the gradients of its parameters ("W"), at
    ``Profile.batch_size``. Measured: the gradients of the parameters from where their paths
    meet the inputs' (as the runtime's weight pass runs them; B + W is about ``backward_s``,
    a little more for small units, whose split pays Python overhead twice); analytic:
    ``backward_s`` times the forward FLOPs of the ops taking a parameter over the backward
    FLOPs (``dW = X^T dY`` redoes ``Y = X W``), so B + W = ``backward_s``."""
    backward_input_overhead_s: float = 0.0
    """The per-call part of ``backward_input_s`` (the ``a`` of ``t(b) = a + c b``, as
    ``forward_overhead_s``), fitted when the split was measured at several micro-batch sizes;
    0 (and ``backward_weight_overhead_s`` 0): B and W scale as the whole backward does."""
    backward_weight_overhead_s: float = 0.0
    """The per-call part of ``backward_weight_s`` (see ``backward_input_overhead_s``). The
    runtime's weight pass asks autograd once per parameter group, so this share is larger
    than the whole backward's at small micro-batches."""
    measured_as: str = ""
    """Name of the unit whose measurement (or count) this unit shares because it is the same
    computation (same graph, parameter and input shapes); ``""``: its own. Optional in
    schema v1: files without it load with ``""``."""
    backward_unsplit: str = ""
    """Why this unit's backward cannot run split into B and W, e.g. a parameter it uses more
    than once, which torch's split weight pass cannot take (``autopipe.profiler.weight_pass``);
    ``""``: it can (or the split was not tried). Such a unit has ``backward_input_s`` = its
    ``backward_s`` and ``backward_weight_s`` 0 (W folded into B), and the planner prices a
    chunk holding it unsplit, as the runtime runs it. Optional in schema v1."""

    tp_parameter_count: int = 0
    """Parameter elements of this unit that ``Profile.tp_plan`` splits over the
    tensor-parallel group (divided by T on each device); the rest are replicated. 0 when the
    profile has no TP plan. Optional in schema v1."""
    tp_compute_fraction: float = 0.0
    """Share (0..1) of this unit's forward and backward time spent in the ops the TP plan
    splits (their FLOP share): that part runs T times faster on T devices. Optional in v1."""
    tp_collective_bytes: int = 0
    """Bytes, at ``Profile.batch_size``, of the activations entering this unit's
    tensor-parallel regions (one per colwise ... rowwise run, e.g. attention and MLP of a
    transformer block): with sequence parallelism the forward all-gathers and
    reduce-scatters each over the T group, and so does the backward. Optional in v1."""
    tp_sequence_dim: int = 0
    """The dimension of this unit's activations that sequence parallelism shards: 0 (sequence
    first, Megatron's ``[s, b, h]``: each TP collective's buffer is the tensor itself) or 1
    (``[b, s, h]``, torch's ``Shard(1)`` as torchtitan lays it out: torch's functional
    all-gather and reduce-scatter rearrange every buffer with a ``chunk`` + ``cat`` copy).
    Optional in v1 (0)."""
    tp_rowwise_output_bytes: int = 0
    """Of ``tp_collective_bytes``, the outputs of the unit's row-wise modules at
    ``Profile.batch_size``: what its forward reduce-scatters straight from a matmul (one
    ``b x s x h`` output per row-wise module; an embedding's or an LM head's collectives are
    not), which async TP fuses with that matmul. Optional in v1."""
    tp_gathered_output_bytes: int = 0
    """Of ``tp_collective_bytes``'s traffic, the output (an LM head's logits, ``[tokens,
    vocab]``) that a gathered column-wise style (``colwise_gather_output``) all-gathers to
    every TP rank in forward, whole size at ``Profile.batch_size``: ``tp_collective_bytes``
    carries a quarter of it. Under loss parallelism (``PlanRequest.loss_parallel``) it stays
    sharded and is not gathered; without it every TP rank holds the whole logits and what the
    unit saves or peaks at is not split (docs/cost-model.md, "Loss parallelism"). 0: no
    gathered output. Optional in v1."""
    tp_gathered_input_bytes: int = 0
    """Of ``activation_bytes``, the inputs of column-wise modules that the unit saves for
    backward *gathered*, at ``Profile.batch_size``: torch's DTensor ``ColwiseParallel`` under
    sequence parallelism (``input_layouts=Shard(1)``, redistributed to ``Replicate()``) runs
    the matmul on the all-gathered input, and autograd saves that, so every TP rank keeps the
    whole ``[tokens, h]`` (Megatron's column-parallel linear saves its sequence shard and
    gathers it again in backward: 0). Whole on each TP rank, not divided by T
    (docs/cost-model.md, "The LM head's saved input, gathered"). Optional in v1 (0)."""
    linear_forward_flops: float = 0.0
    """FLOPs of this unit's weight matmuls (``nn.Linear``) in forward, at
    ``Profile.batch_size`` (their backward is twice as many): the share ``precision="fp8"``
    prices at the GPU's FP8 peak. 0: unknown (FP8 then changes nothing). Optional in v1."""
    fp8_cast_forward_bytes: int = 0
    """Bytes, at ``Profile.batch_size``, that a float8 trainer's memory-bound kernels move in
    this unit's forward beyond the profile dtype's: each weight matmul's input scaled by its
    ``max(abs)`` and cast to FP8 (torchao's tensorwise dynamic ``Float8Linear``, as compiled),
    what ``precision="fp8"`` prices at the GPU's memory bandwidth. Scales with the tokens;
    the weights' own casts are not in it (on the FSDP shard before a float8 all-gather:
    ``fp8_gather_cast_bytes``). 0: unknown (not priced). Optional in v1."""
    fp8_cast_backward_bytes: int = 0
    """Likewise for the backward (the output gradients' casts, and the inputs' casts again in
    the layouts the weight gradients' FP8 matmuls take), at ``Profile.batch_size``. Optional
    in v1 (0: unknown)."""
    fp8_cast_selective_bytes: int = 0
    """Bytes the FP8 casts move in this unit's forward and backward together under selective
    activation checkpointing (the trainer's recipe, ``selective_activation_bytes``; its
    re-computation included), at ``Profile.batch_size``: measured, since the re-computation's
    casts fuse with the backward's and the recipe may keep an amax (torchtitan's op policy
    on a Llama block: ``17 h + 3 ffn + 24`` forward, ``42.5 h + 7 kv + 22 ffn + 8`` backward per
    token, ``3 h - 2 ffn + 8`` beyond ``fp8_cast_forward_bytes + fp8_cast_backward_bytes``).
    Under ``precision="fp8"`` the difference goes to ``selective_recompute_s``. 0: unknown
    (priced as the two fields). Optional in v1."""
    fp8_cast_full_bytes: int = 0
    """Likewise under full activation checkpointing (the unit's forward re-run in its
    backward, fused with it): the forward's and the backward's casts together, at
    ``Profile.batch_size`` (torchtitan's Llama block: ``73.5 h + 7 kv + 25 ffn + 52`` per token,
    ``5 ffn - 12`` fewer than a forward re-run with its casts would add:
    ``2 fp8_cast_forward_bytes + fp8_cast_backward_bytes``). Under ``precision="fp8"`` the
    difference goes to ``full_recompute_extra_s``. 0: unknown (the re-run priced as a
    forward). Optional in v1."""
    fp8_gather_cast_bytes: int = 0
    """Bytes the casts of this unit's FP8 weights move before each float8 FSDP all-gather,
    over all of them (each rank moves its ``1 / (T x D)`` shard's): torchtitan's Float8
    recipe (``--float8.enable_fsdp_float8_all_gather
    --float8.precompute_float8_dynamic_scale_for_fsdp``) casts each rank's fp32 shard in
    torchao's ``fsdp_pre_all_gather``, eagerly, on FSDP2's copy-in stream: 21 bytes per weight
    element (the scale's ``mul`` 8, ``clamp`` 8, the FP8 copy 5; measured,
    ``benchmarks/eager_block_bytes.py --fsdp-float8``). Priced under ``precision="fp8"``
    with ``parameters`` sharding, with the all-gather it feeds. 0: no float8 all-gather.
    Optional in v1."""
    fp8_weight_amax_bytes: int = 0
    """Bytes the per-step ``max(abs)`` of this unit's FP8 weights reads, over all of them
    (each rank its shard's): torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after the
    optimizer step, one ``_foreach_norm(inf)`` of the fp32 shards, 4 bytes per element.
    Priced once per step with the optimizer's under ``precision="fp8"`` and ``parameters``
    sharding. 0: none. Optional in v1."""
    full_recompute_extra_s: float = 0.0
    """Seconds the re-computation of this unit under full checkpointing (a checkpointed
    stage's ``recompute_s``) takes beyond ``forward_s``, at ``Profile.batch_size``; negative
    where the re-run does less than the forward: a compiled block whose re-computation fuses
    with the backward (the published runs' torchtitan blocks: ``8 h + 4 ffn + 8`` bytes per
    token fewer, measured), and its FP8 casts fused with the backward's
    (``planner/trainer.py`` adds that difference from ``fp8_cast_full_bytes``). The cost
    model prices each unit's re-run at ``max(forward_s + this, 0)``. Scales with the samples and
    the TP share as the forward's compute does. 0: the re-run costs a forward. Optional in
    v1; the one field that may be negative."""
    selective_activation_bytes: int = 0
    """Bytes this unit saves for backward under selective activation checkpointing (the
    tensors the trainer's policy keeps: Megatron's ``--recompute-granularity selective``
    drops the attention core's, torchtitan's ``selective`` op policy keeps the outputs of
    attention and of every other matmul), at ``Profile.batch_size``. With
    ``selective_recompute_s`` 0 too: no selective recipe (the unit keeps its activations).
    Optional in v1."""
    selective_recompute_s: float = 0.0
    """Seconds the backward spends re-computing what selective checkpointing dropped, at
    ``Profile.batch_size``. Optional in v1."""
    selective_recompute_linear_flops: float = 0.0
    """Of ``selective_recompute_s``'s work, the weight matmuls' FLOPs the re-computation runs
    again, at ``Profile.batch_size``: ``precision="fp8"`` prices them at the GPU's FP8 peak
    as it does ``linear_forward_flops`` (torchtitan's op policy re-computes every other
    ``mm``, FP8 ones as well: wk, wo and w3 of a Llama block; Megatron's recipe re-computes
    the attention core only, 0). 0: none or unknown (the re-computation then keeps its
    profiled time under FP8). Optional in v1."""
    selective_recompute_gather_bytes: int = 0
    """Of ``tp_collective_bytes``, the TP regions' inputs that the selective recipe gathers
    again in backward, at ``Profile.batch_size``: torchtitan's op policy saves the outputs of
    the reduce-scatters but not of the all-gathers, so with sequence parallelism each region
    whose gathered input a kept matmul's weight gradient needs re-runs its all-gather over the
    T group (the whole block's ``tp_collective_bytes`` for a Llama block); Megatron's recipe
    re-gathers nothing (0). Only with ``selective_recompute`` and T > 1. Optional in v1."""
    tp_replicated_activation_bytes: int = 0
    """Of ``activation_bytes``, those outside the TP regions (norm inputs, residuals,
    dropout masks): sharded over T by sequence parallelism only, replicated on every TP rank
    without it (``PlanRequest.sequence_parallel=False``). Optional in v1."""
    tp_replicated_compute_fraction: float = 0.0
    """Of ``tp_compute_fraction``, the share of the unit's time outside the TP regions
    (norms, residual adds, dropout): split by sequence parallelism only. Optional in v1."""

    attention_layers: int = 0
    """Attention layers in this unit (modules whose class name ends in ``Attention``), what
    context parallelism exchanges keys and values for (``planner/context_expert.py``); 0:
    none, or not recorded (profiles written before it). Optional in schema v1."""
    attention_heads: int = 0
    """Query heads of each of the unit's attention layers (0 when it has none)."""
    attention_kv_heads: int = 0
    """Key/value heads of each attention layer (grouped-query attention: fewer than the query
    heads; multi-head latent attention, DeepSeek's MLA: the query heads, its keys and values
    as attention computes them, after the up-projection)."""
    attention_head_dim: int = 0
    """Query/key head size of each attention layer."""
    attention_value_head_dim: int = 0
    """Value head size of each attention layer (MLA's differs from the key's)."""
    moe_layers: int = 0
    """Mixture-of-experts layers in this unit (a module holding the routed experts, Hugging
    Face's ``*Experts``), what expert parallelism places over ranks. Optional in v1."""
    moe_experts: int = 0
    """Routed experts per MoE layer (shared experts are dense parameters, not counted)."""
    moe_top_k: int = 0
    """Experts each token is routed to (``num_experts_per_tok``)."""
    moe_expert_parameter_count: int = 0
    """Parameter elements of this unit's routed experts, all layers together: what expert
    parallelism divides over its E ranks."""
    moe_hidden_size: int = 0
    """Width of the tokens an MoE layer dispatches and combines (the model's hidden size)."""

    def forward_at(self, microbatch_size: float, batch_size: int) -> float:
        """Forward seconds for one micro-batch of ``microbatch_size`` samples."""
        return _scale(self.forward_s, self.forward_overhead_s, microbatch_size, batch_size)

    def backward_at(self, microbatch_size: float, batch_size: int) -> float:
        """Backward seconds for one micro-batch of ``microbatch_size`` samples."""
        return _scale(self.backward_s, self.backward_overhead_s, microbatch_size, batch_size)

    @property
    def split_fitted(self) -> bool:
        """B and W each have their own per-call part (measured at several sizes)."""
        return self.backward_input_overhead_s + self.backward_weight_overhead_s > 0


def _scale(total_s: float, overhead_s: float, b: float, batch_size: int) -> float:
    overhead_s = min(max(overhead_s, 0.0), total_s)
    return overhead_s + (total_s - overhead_s) * b / batch_size


@dataclass
class Profile:
    """Per-unit costs of one model at one batch size on one device, in topological order.

    ``cut_bytes[i]`` is the size of every tensor live across the cut between
    ``units[i]`` and ``units[i + 1]`` (skip connections count), so ``len(cut_bytes)
    == len(units) - 1``.
    """

    units: list[UnitProfile]
    cut_bytes: list[int]
    batch_size: int
    device: str = "cpu"
    dtype: str = "float32"
    model: str = ""
    tracer: str = "fx"
    mode: str = "measured"
    """``"measured"`` (ran on the device) or ``"analytic"`` (counted from FLOPs and bytes)."""
    torch_version: str = ""
    autopipe_version: str = ""
    input_bytes: int = 0
    total_forward_s: float = 0.0
    """Whole-model forward seconds measured in one piece (for checking the per-unit sum)."""
    total_backward_s: float = 0.0
    total_activation_bytes: int = 0
    parameter_bytes_total: int = 0
    """Parameter bytes of the whole model counting tied weights once."""
    bytes_per_parameter: int = 4
    optimizer: str = "adam"
    """Optimizer whose state ``UnitProfile.optimizer_bytes`` counts."""
    granularity: str = "block"
    """How nodes were grouped into units: ``"block"``, ``"module"`` or ``"node"``."""
    unit_patterns: list[str] = field(default_factory=list)
    """The ``--units`` patterns (fnmatch over module paths) that named the units, if any."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """The model's tensor-parallel plan, module path pattern (fnmatch) to style
    (``colwise``, ``rowwise``, ...): Hugging Face's ``base_model_tp_plan`` (patterns under
    the base model, prefixed with its path) or the model file's ``tp_plan()``. Empty: the
    model cannot be tensor-parallel (``tp_note`` says why). Optional in schema v1."""
    tp_degrees: list[int] = field(default_factory=list)
    """The tensor-parallel degrees T > 1 the model allows (T divides every split dimension,
    e.g. the attention and key/value heads); empty without a TP plan."""
    tp_note: str = ""
    """Why the profile has no TP plan (one sentence), or ``""``."""
    tp_refusal: str | None = None
    """Why the runtime cannot run this model at T > 1 although it has a TP plan (one line:
    its stages traced at one TP rank's shapes fail to trace, or sequence parallelism
    refuses the graph), found when profiling by the runtime's own analysis
    (``autopipe.runtime.distributed.tp_check``); None: it can, or not checked (profiles
    written before this field, schema v1, load so). The planner then plans T = 1 only."""
    sequence_length: int = 0
    """Tokens per sample (the inputs' second dimension) that context parallelism splits; 0:
    not a sequence model, or not recorded (profiles written before it). Optional in v1."""
    loss_forward_s: float = 0.0
    """The loss's forward seconds at ``batch_size``, included in the last unit's
    ``forward_s`` (the loss runs on the last stage); 0 when not recorded."""
    loss_backward_s: float = 0.0
    """The loss's backward seconds, included in the last unit's ``backward_s``."""
    measurement: Measurement | None = None
    """How the measuring profiler ran (sizes, repeats, clock, threads, per-size figures);
    None for a counted (analytic) profile."""
    counted_blocks: CountedBlocks | None = None
    """How a long block stack was counted in part (``profiler/reduce.py``); None when every
    unit was counted."""
    counting: Counting | None = None
    """How the analytic profiler counted (the device spec and per-unit cost parts the times
    were priced from); None for a measured profile."""
    optimizer_chosen: bool = False
    """The optimizer (``optimizer``) or ``state_bytes_per_parameter`` was given explicitly
    when profiling, so the planner takes it instead of its default."""
    state_bytes_per_parameter: float = 0.0
    """Training-state bytes per parameter (parameter + gradient + optimizer state) given
    when profiling (``--bytes-per-parameter``); 0: not given, ``optimizer`` decides."""
    extra_state_bytes: list[float] = field(default_factory=list)
    """Per unit, training-state bytes a device holds beyond its parameter bytes x the
    request's state per parameter: the expert shards of an expert-parallel mesh, whose state
    is not sharded over the whole data-parallel group (set by the planner on a mesh's
    per-device profile, :func:`autopipe.planner.context_expert.with_expert_state`).
    Empty: none; not written to files then."""
    send_cut_bytes: list[int] = field(default_factory=list)
    """Per cut, the bytes a stage boundary there sends, where they differ from ``cut_bytes``
    (what the next units' inputs hold): a mesh's per-device profile under TP without sequence
    parallelism keeps the hidden state whole on every TP rank, while the trainers send 1/T
    of it and gather it behind the link (set by
    :func:`autopipe.planner.mesh_costs.device_profile`). Empty: ``cut_bytes``; not written to
    files then."""
    version: int = PROFILE_VERSION
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form notes; nothing reads them back."""

    def __post_init__(self) -> None:
        lift_meta(self, _META_FIELDS)
        if self.measurement is None and any(key in self.meta for key in _MEASUREMENT_KEYS):
            # an earlier writer's flat meta keys (schema v1), or one that still writes them
            found = {key: self.meta.pop(key) for key in _MEASUREMENT_KEYS if key in self.meta}
            self.measurement = Measurement.from_dict(found)
        elif isinstance(self.measurement, Mapping):  # a loaded file
            self.measurement = Measurement.from_dict(self.measurement)
        if self.counting is None and any(key in self.meta for key in _COUNTING_KEYS):
            # an earlier analytic writer's flat meta keys (schema v1)
            found = {f: self.meta.pop(key) for key, f in _COUNTING_KEYS.items() if key in self.meta}
            self.meta.pop("analytic_batch_size", None)
            self.counting = Counting.from_dict(found)
        elif isinstance(self.counting, Mapping):  # a loaded file
            self.counting = Counting.from_dict(self.counting)
        if isinstance(self.counted_blocks, Mapping):
            self.counted_blocks = CountedBlocks.from_dict(self.counted_blocks)
        if len(self.cut_bytes) != max(len(self.units) - 1, 0):
            raise ValueError(
                f"profile has {len(self.units)} units but {len(self.cut_bytes)} cut sizes; "
                "expected one fewer cut than units"
            )

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    def shared_groups(self) -> dict[str, list[str]]:
        """``{unit measured: [every unit using that measurement, itself first]}`` for the
        measurements shared by more than one unit, in unit order."""
        groups: dict[str, list[str]] = {}
        for u in self.units:
            if u.measured_as:
                groups.setdefault(u.measured_as, [u.measured_as]).append(u.name)
        order = {name: i for i, name in enumerate(self.unit_names)}
        return dict(sorted(groups.items(), key=lambda item: order.get(item[0], len(order))))

    def __len__(self) -> int:
        return len(self.units)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.extra_state_bytes:  # a planner's per-mesh figure; files never had it
            del out["extra_state_bytes"]
        if not self.send_cut_bytes:  # likewise
            del out["send_cut_bytes"]
        return out

    def validate(self) -> None:
        """Raise :class:`ProfileFormatError` naming the first field whose value cannot be
        right: a negative, NaN or infinite time or size, one above ``LARGEST_PROFILE_VALUE``
        (1e30, where the planner's arithmetic would overflow), a non-positive batch size or
        ``bytes_per_parameter``, duplicate unit names, or no time measured at all."""
        try:
            largest = LARGEST_PROFILE_VALUE
            at_least_one = (1, largest)
            check_dataclass(
                self,
                bounds={"batch_size": at_least_one, "bytes_per_parameter": at_least_one},
                maximum=largest,
            )
            if not self.units:
                raise FieldError("units", "is empty; a profile needs at least one unit")
            seen: dict[str, int] = {}
            for i, unit in enumerate(self.units):
                if not isinstance(unit, UnitProfile):
                    raise FieldError(f"units[{i}]", "is not a unit record")
                check_dataclass(
                    unit,
                    prefix=f"units[{i}].",
                    bounds={"full_recompute_extra_s": (-largest, largest)},
                    maximum=largest,
                )
                if not unit.name:
                    raise FieldError(f"units[{i}].name", "is empty; every unit needs a name")
                if unit.name in seen:
                    raise FieldError(
                        f"units[{i}].name",
                        f"{unit.name!r} repeats units[{seen[unit.name]}].name; unit names must be unique",
                    )
                seen[unit.name] = i
            if not any(u.forward_s + u.backward_s > 0 for u in self.units):
                raise FieldError(
                    "units[*].forward_s",
                    "and backward_s are 0 for every unit; nothing was measured",
                )
        except FieldError as exc:
            raise ProfileFormatError(str(exc)) from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile in ``data`` (a loaded JSON object), checked by :meth:`validate`."""
        check_version(
            data, "units", PROFILE_VERSION, "profile", ProfileFormatError,
            "re-run `autopipe profile` to regenerate it",
        )  # fmt: skip
        try:
            units = [UnitProfile(**known_fields(UnitProfile, u)) for u in data["units"]]
            kwargs = known_fields(cls, data, without=("units",))
            profile = cls(units=units, **kwargs)
        except (TypeError, AttributeError, ValueError) as exc:
            raise ProfileFormatError(f"malformed autopipe profile: {exc}") from exc
        profile.validate()
        return profile

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON atomically (a crash never leaves half a file)."""
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile written by :meth:`save` (``ProfileFormatError`` naming the file)."""
        return load_json_file(path, cls.from_dict, ProfileFormatError)
