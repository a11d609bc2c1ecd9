"""The planning request: everything ``plan`` is asked besides the profile, as one typed value.

Torch-free. A :class:`PlanRequest` is what the CLI's flags, the Python API
(``autopipe.plan(profile, PlanRequest(gpus=4))``) and ``parallelize`` all build, what the planner reads, and what a Plan records in
``Plan.request``, so a plan can be made again with one thing changed::

    again = plan(profile, dataclasses.replace(old.request, microbatches=8))

It is frozen: a request is a value, not a bag of options that steps rewrite.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from autopipe.core.cluster import Cluster, Device
from autopipe.core.datafile import known_fields
from autopipe.core.errors import RuleViolation
from autopipe.core.optimizer import AUTO, OPTIMIZERS
from autopipe.core.schedule_rules import check_virtual_stages
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT

__all__ = [
    "Checkpoint", "GradClip", "OptimizerKernel", "PlanRequest", "Schedule", "Shard", "Strategy",
]  # fmt: skip

Schedule = Literal[
    "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev",
    "auto",
]  # fmt: skip
"""``PLAN_SCHEDULES`` or ``auto``."""
Checkpoint = Literal["never", "always", "except_last", "auto"]
"""``CHECKPOINT_MODES``."""
Strategy = Literal["dp", "ilp", "brute-force", "uniform", "parameters", "greedy-time"]
"""The planner's ``STRATEGIES``: the exact solvers and the baselines."""
Shard = Literal["none", "optimizer", "gradients", "parameters", "auto"]
"""``SHARD_MODES`` or ``auto``."""
ContextParallelMethod = Literal["ring", "ring_compiled", "all_gather"]
"""How CP's attention exchanges keys and values (``planner/context_expert.py``): ``ring``,
torch's ``context_parallel`` (what ``autopipe run`` runs); ``ring_compiled``, the same ring
traced into a ``torch.compile`` graph (torchtitan with ``compile``: every exchange waited at
once, the merges fused); ``all_gather``, K and V gathered once and attended in one call (the
Llama 3 paper's, Megatron's ``--cp-comm-type all_gather``)."""
OptimizerKernel = Literal["foreach", "fused"]
"""``optimizer.OPTIMIZER_KERNELS``."""
GradClip = Literal["none", "torch", "megatron"]
"""``optimizer.GRAD_CLIPS``."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. Units: bytes, seconds; ``None`` means "not limited" or "derive it".

    Devices: ``gpus`` equal devices named after the profile's device, each with
    ``memory_per_device`` bytes, or ``cluster`` (devices in pipeline order; then ``gpus``
    is ``None`` and ``memory_per_device`` fills in devices whose memory is unknown).
    """

    gpus: int | None = None
    """K, the number of pipeline stages on equal devices."""
    cluster: Cluster | None = None
    batch_size: int | None = None
    """The mini-batch B; ``None``: the profile's batch size."""
    microbatches: int | str | tuple[int, ...] = "auto"
    """M, a tuple of candidates, or ``"auto"`` (every divisor of B up to a bound)."""
    schedule: Schedule = "gpipe"
    """One of ``PLAN_SCHEDULES`` (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``looped-bfs``,
    ``interleaved-zb``, ``zbv``, ``dualpipev``) or ``"auto"`` (schedule, V, chunks, M and
    re-materialization chosen together)."""
    virtual_stages: int | str = "auto"
    """V, model chunks per rank, or ``"auto"``: 1 for GPipe and 1F1B, 2 for ZBV and
    DualPipeV, 1 to 4 for the looped schedules (``autopipe/core/schedules.py``)."""
    compile: bool = False
    """The stages will be ``torch.compile``'d: rules out the schedules that split backward
    (torch refuses compiled stages there)."""
    checkpoint: Checkpoint = DEFAULT_CHECKPOINT  # type: ignore[assignment]
    """Re-materialization: ``"never"``, ``"always"``, ``"except_last"`` or ``"auto"`` (the
    default, ``vocabulary.DEFAULT_CHECKPOINT``: only where the activations would not fit)."""
    strategy: Strategy = "dp"
    """How stages are cut: ``"dp"``, ``"ilp"``, ``"brute-force"`` or a baseline's name."""
    optimizer: str = "auto"
    """Whose training state each parameter carries (``autopipe/core/optimizer.py``)."""
    bytes_per_parameter: float | None = None
    """Training-state bytes per parameter; overrides ``optimizer``."""
    memory_per_device: int | None = None
    headroom: float = 0.10
    """Share of device memory kept free."""
    baselines: bool = True
    """Also evaluate the baseline partitions for comparison."""
    time_limit_s: float = 30.0
    """Per-solve limit of the ILP strategy."""
    tensor_parallel: int | str = 1
    """T, devices each stage's modules are split over by the model's TP plan, or ``"auto"``
    (every T dividing the heads and the node size). Any value but 1 (or a ``data_parallel``
    or ``shard`` other than the default) plans the whole mesh: ``gpus`` is then the number
    of devices N = PP x D x T (``planner/mesh.py``)."""
    data_parallel: int | str = 1
    """D, data-parallel replicas of the pipeline in a mesh plan, or ``"auto"``."""
    shard: Shard = "none"
    """How the training state is sharded over the D replicas (``SHARD_MODES``: ``none``,
    ``optimizer``, ``gradients``, ``parameters``) or ``"auto"``."""
    gpus_per_node: int | None = None
    """Devices per node in a mesh plan; None: all of them in one node."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Per-device bandwidth between nodes (per direction); None: the same as inside a node."""
    precision: str = "bf16"
    """Matmul precision: ``"bf16"`` (the profile's) or ``"fp8"``: the units' weight matmuls
    (``UnitProfile.linear_forward_flops``) priced at the GPU's FP8 peak (torchtitan's Float8
    linears, Megatron's ``--fp8-format``); weights, gradients and optimizer state as before
    (``planner/trainer.py``)."""
    selective_recompute: bool = False
    """Selective activation checkpointing: every unit with a selective recipe saves only
    ``selective_activation_bytes`` and re-computes ``selective_recompute_s`` in backward
    (Megatron's ``--recompute-granularity selective``, torchtitan's ``selective`` mode);
    ``checkpoint`` still chooses full re-computation per stage on top."""
    sequence_parallel: bool = True
    """With T > 1, shard the activations outside the TP regions over T too (Megatron's
    ``--sequence-parallel``); False: plain Megatron TP, those activations and their
    element-wise work replicated on every TP rank (all-reduces of the same volume)."""
    loss_parallel: bool = False
    """With T > 1, the LM head's logits stay sharded over the vocabulary on the TP ranks and
    the cross-entropy runs on the shards (torchtitan's loss parallel, on by default there;
    Megatron's vocab-parallel cross-entropy, its only mode): no all-gather of the logits, and
    each rank holds 1/T of them and of the loss's fp32 copies. False (the default): the
    logits are gathered to every TP rank, as ``autopipe run`` runs an LM head
    (``colwise_gather_output``), which refuses a plan priced with it (docs/cost-model.md)."""
    tp_comm_overlap: bool = False
    """TP collectives overlapped with the matmuls they feed (torchtitan's async TP,
    Megatron's ``--tp-comm-overlap``): only one of T chunks, and what outlasts the matmul,
    is exposed (docs/cost-model.md)."""
    tp_overlap_backward: bool = True
    """With ``tp_comm_overlap``: the backward's TP collectives overlap too, as Megatron's
    ``--tp-comm-overlap`` (Transformer Engine's userbuffers) runs them. False: torchtitan's
    async TP (inductor's micro-pipeline TP pass on torch's symmetric memory), which speeds up
    the forward only, as its authors measured it, and sums each fused reduce-scatter's
    partial outputs in a pass of its own (docs/cost-model.md)."""
    grad_reduce_overlap: bool = False
    """Data parallelism without sharded gradients (``shard`` none or optimizer): reduce the
    gradients bucket by bucket during the last micro-batch's backward (Megatron's
    ``--overlap-grad-reduce``), and with ``optimizer`` gather the updated parameters behind
    the first forward (``--overlap-param-gather``). With ``shard="parameters"`` and
    ``reshard_after_forward=False``: the reduce-scatters stream with the last micro-batch's
    backward; without it they start after it, as torch.distributed.pipelining runs FSDP2."""
    grad_reduce_fp32: bool = False
    """The data-parallel gradient reduction (all-reduce or reduce-scatter) carries fp32
    gradients, 4 bytes per element, whatever the parameters' dtype: Megatron-LM's
    ``--accumulate-allreduce-grads-in-fp32`` (which ``--bf16`` turns on), FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` (torchtitan's default
    ``mixed_precision_reduce = "float32"``). The parameter gathers keep the parameters'
    dtype (docs/cost-model.md)."""
    fp32_grad_buffer: bool = False
    """The trainer keeps an fp32 copy of every gradient beside the parameters'-dtype one, and
    sums the micro-batches' gradients into it (4 bytes per parameter more, unsharded with
    ``shard`` none or optimizer): DeepSpeed's ``BF16_Optimizer`` (``fp32_groups_gradients``;
    its pipeline engine keeps the bf16 gradients too, ``clear_lp_grads=False``). Priced: the
    sum after every micro-batch's backward (18 bytes per bf16 parameter), and with
    ``optimizer`` an all-reduce of the fp32 gradients before the parameter gather."""
    reshard_after_forward: bool = True
    """``shard="parameters"``: False keeps the gathered parameters and the unsharded
    gradients across the micro-batches of a step, as torchtitan runs FSDP2 under pipeline
    parallelism: one all-gather and one reduce-scatter per step instead of per micro-batch,
    for 2 bytes + 2 bytes per parameter more memory."""
    optimizer_kernel: OptimizerKernel = "foreach"
    """How the optimizer step runs: ``foreach`` (torch.optim's one kernel per operation,
    torch's default on CUDA and ``autopipe run``'s) or ``fused`` (one kernel: torch's
    ``fused=True``, Apex / Transformer Engine ``FusedAdam`` under Megatron). Prices the step's
    memory passes in a mesh plan (``optimizer.optimizer_step_bytes_per_parameter``)."""
    grad_clip: GradClip = "none"
    """Gradient clipping by global norm before the step: ``none`` (``autopipe run``),
    ``torch`` (``clip_grad_norm_``: a norm and a scale pass, torchtitan's), ``megatron`` (a
    norm pass; the scale only when over the limit)."""
    memory_reserve_bytes: int = 0
    """Device memory the plan may not use, besides ``headroom``: CUDA context, NCCL buffers
    and allocator fragmentation; added to the predicted peak so it compares with what the
    device reports in use (mesh plans)."""
    context_parallel: int | str = 1
    """C, ranks each sample's sequence is split over (torch's ``context_parallel``, ring
    attention), or ``"auto"``; any value but 1 plans the whole mesh, N = PP x D x C x T
    (``planner/context_expert.py``)."""
    expert_parallel: int | str = 1
    """E, ranks each MoE layer's routed experts are spread over (carved out of D x C x T, as
    torchtitan does), or ``"auto"``; any value but 1 plans the whole mesh."""
    context_parallel_method: ContextParallelMethod = "ring"
    """How CP's attention exchanges keys and values (:data:`ContextParallelMethod`)."""
    expert_load_imbalance: float = 1.25
    """Tokens the busiest expert-parallel rank receives over the average
    (``planner/context_expert.DEFAULT_EXPERT_LOAD_IMBALANCE``, its source there)."""

    @property
    def plans_mesh(self) -> bool:
        """Whether the request asks for a device mesh (T, D or sharding chosen or given)
        rather than one K-stage pipeline."""
        return (
            self.tensor_parallel,
            self.data_parallel,
            self.shard,
            self.context_parallel,
            self.expert_parallel,
        ) != (1, 1, "none", 1, 1)

    def __post_init__(self) -> None:
        # A list given for the candidates is kept as a tuple: requests are hashable values.
        if isinstance(self.microbatches, list):
            object.__setattr__(self, "microbatches", tuple(self.microbatches))
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the cluster as its devices' fields, candidates as a list."""
        data = dataclasses.asdict(self)
        if isinstance(self.microbatches, tuple):
            data["microbatches"] = list(self.microbatches)
        if self.cluster is not None:
            # strict JSON has no Infinity: an unlimited link is written as null
            for device in data["cluster"]["devices"]:
                if device["link_bandwidth_bytes_per_s"] == float("inf"):
                    device["link_bandwidth_bytes_per_s"] = None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanRequest:
        """The inverse of :meth:`to_dict`; unknown keys (a newer writer) are ignored."""
        values = known_fields(cls, data)
        cluster = values.get("cluster")
        if isinstance(cluster, Mapping):
            devices = []
            for d in cluster.get("devices", []):
                fields = dict(d)
                if fields.get("link_bandwidth_bytes_per_s") is None:
                    fields["link_bandwidth_bytes_per_s"] = float("inf")
                devices.append(Device(**fields))
            values["cluster"] = Cluster(devices, cluster.get("host_throughput"))
        microbatches = values.get("microbatches")
        if isinstance(microbatches, Sequence) and not isinstance(microbatches, str):
            values["microbatches"] = tuple(microbatches)
        return cls(**values)


# -- validation: each field alone, at construction (RuleViolation, a ValueError, one line) --


def _refuse(name: str, message: str) -> RuleViolation:
    """The refusal of field ``name`` (kept as ``field``, for a file's reader to say where)."""
    exc = RuleViolation(message)
    exc.field = name  # type: ignore[attr-defined]
    return exc


def _is_positive_int(value: object) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 1  # type: ignore[arg-type]
    except TypeError:
        return False


def _positive_or_auto(name: str, value: object) -> None:
    if value != "auto" and not _is_positive_int(value):
        raise _refuse(name, f"{name}={value!r} must be 'auto' or a positive integer")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _refuse(
            name, f"{name}={value!r} is not valid; use one of {', '.join(map(repr, allowed))}"
        )


def _positive_number(name: str, value: object, what: str = "a positive number") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise _refuse(name, f"{name}={value!r} must be {what}")
    if not math.isfinite(float(value)):
        raise _refuse(name, f"{name}={value!r} must be {what}")


def _validate(r: PlanRequest) -> None:
    """Refuse the first field that no plan could honour, naming it: a choice outside its
    ``Literal``, a count below 1, a size or time that is not positive. What depends on the
    profile (units, batch divisors, heads) the planner checks."""
    for name in ("gpus", "batch_size", "gpus_per_node"):
        value = getattr(r, name)
        if value is not None and not _is_positive_int(value):
            raise _refuse(name, f"{name}={value!r} must be a positive integer")
    _check_microbatches(r.microbatches)
    _one_of("schedule", r.schedule, get_args(Schedule))
    _positive_or_auto("virtual_stages", r.virtual_stages)
    _one_of("checkpoint", r.checkpoint, get_args(Checkpoint))
    _one_of("strategy", r.strategy, get_args(Strategy))
    key = r.optimizer.lower().replace("_", "-") if isinstance(r.optimizer, str) else r.optimizer
    _one_of("optimizer", key, (AUTO, *OPTIMIZERS))
    if r.bytes_per_parameter is not None and not r.bytes_per_parameter > 0:
        raise _refuse(
            "bytes_per_parameter", f"bytes_per_parameter={r.bytes_per_parameter} must be positive"
        )
    _positive_number("memory_per_device", r.memory_per_device, "a positive number of bytes")
    if not isinstance(r.headroom, numbers.Real) or not (
        r.headroom >= 0 and math.isfinite(r.headroom)
    ):
        raise _refuse(
            "headroom", f"headroom={r.headroom} must be a fraction >= 0 (0.1 keeps 10% free)"
        )
    _positive_number("time_limit_s", r.time_limit_s, "a positive number of seconds")
    _positive_or_auto("tensor_parallel", r.tensor_parallel)
    _positive_or_auto("data_parallel", r.data_parallel)
    _one_of("shard", r.shard, get_args(Shard))
    _one_of("optimizer_kernel", r.optimizer_kernel, get_args(OptimizerKernel))
    _one_of("grad_clip", r.grad_clip, get_args(GradClip))
    _one_of("context_parallel_method", r.context_parallel_method, get_args(ContextParallelMethod))
    _positive_number(
        "inter_node_bandwidth_bytes_per_s", r.inter_node_bandwidth_bytes_per_s,
        "a positive number of bytes per second",
    )  # fmt: skip
    if r.schedule != "auto" and r.virtual_stages != "auto":
        why = check_virtual_stages(r.schedule, operator.index(r.virtual_stages))
        if why is not None:
            raise _refuse("virtual_stages", f"stages-per-rank: {why}")


def _check_microbatches(m: object) -> None:
    """``auto``, a positive integer (a string of digits too) or a tuple of them."""
    if isinstance(m, str):
        if m != "auto" and not (m.strip().isdigit() and int(m) >= 1):
            raise _refuse(
                "microbatches", f"microbatches={m!r}: give 'auto', an integer or a list of integers"
            )
        return
    if isinstance(m, tuple) and not m:
        raise _refuse(
            "microbatches", "microbatches is an empty list; give at least one candidate or 'auto'"
        )
    for value in m if isinstance(m, tuple) else (m,):
        if not _is_positive_int(value):
            raise _refuse("microbatches", f"microbatches={value!r} must be a positive integer")
