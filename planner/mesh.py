"""``plan_mesh``: choose the device mesh ``N = PP x D x T`` and the sharding of the training
state, with the pipeline, together. Torch-free.

For every factorization of the N devices into T (tensor-parallel degree: divides the model's
heads and the node size, so a TP group never leaves its node), D (data-parallel replicas:
divides the global batch) and PP = N / (T D) pipeline stages, and every sharding of the
training state over D (``SHARD_MODES``), the exact pipeline search (:func:`plan`) runs on
one device's share of the model (:func:`autopipe.planner.mesh_costs.device_profile`) at the
per-replica batch, with that device's memory less the gather buffers, and the mesh's step
time is that pipeline's iteration plus the data-parallel communication the step cannot hide
(:func:`dp_exposed_s`) plus the optimizer step (:func:`optimizer_exposed_s`). The fastest
mesh that fits wins.

Meshes are tried in order of a proven lower bound on their step (each device's share of the
work, :func:`mesh_lower_bound_s`); one whose bound is no better than the best step found is
not searched (its row says so), nor (GPipe, 1F1B) one whose every M is proven slower on the
units' own cuts, fill, drain and forced re-materialization included
(:func:`autopipe.planner.mesh_bound.fill_drain_within`, O(K N #M) against a search's
O(#M x probes x K N log N)): it would lose, so the best step found so far, and the winner,
are those of searching it. Cost: one pipeline search per searched mesh; the meshes are
searched one after another (docs/cost-model.md says why not in parallel).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
from autopipe.planner.context_expert import (
    context_expert_choices,
    context_expert_profile,
    context_parallel_degrees,
    expert_data_parallel,
    expert_device_bytes,
    with_expert_state,
)
from autopipe.planner.costs import backward_input_share
from autopipe.planner.errors import PlanningError, RuleViolation
from autopipe.planner.mesh_bound import (
    PipelineMemory,
    fill_drain_within,
    inflight_per_stage,
    unit_bytes,
)
from autopipe.planner.mesh_costs import (
    NCCL_NETWORK_EFFICIENCY,
    NCCL_NVLINK_EFFICIENCY,
    Topology,
    device_profile,
    fp8_gather_cast_s,
    fp8_weight_amax_s,
    gather_buffer_bytes,
    optimizer_step_s,
    reduce_copy_in_s,
    ring_collective_s,
    selective_regather_s,
    sharded_state_bytes_per_parameter,
    tp_collective_s,
    transient_bytes,
)
from autopipe.planner.search import (
    CannotBeat,
    _positive_int,
    divisors,
    microbatch_counts,
    plan_pipeline,
    training_state,
)

from autopipe.core.catalog import get_device, is_catalog_device
from autopipe.core.cluster import Cluster, Device
from autopipe.core.humanize import format_bytes, format_seconds
from autopipe.core.mesh_rules import mesh_schedule_problem, mesh_schedules, tied_chunks_problems
from autopipe.core.plan import Plan
from autopipe.core.plan_records import MeshReport, MeshRow
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest, Schedule
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.trainer_options import TrainerOptions
from autopipe.core.vocabulary import FRAMEWORK_DEFAULTS, SHARD_MODES

__all__ = [
    "MeshCandidate",
    "dp_exposed_s",
    "optimizer_exposed_s",
    "mesh_candidates",
    "mesh_lower_bound_s",
    "plan_mesh",
    "refuse_too_deep",
]

LOSS_REASONS = ("memory", "bubble", "TP comm", "DP comm", "compute", "recompute (memory)")


@dataclass
class MeshCandidate:
    """One mesh ``(pp, dp, tp)`` with one sharding, and what it costs; with context
    parallelism ``cp`` (C more devices per replica: N = PP x D x C x T) and expert
    parallelism ``ep`` (E ranks of ``dp x cp x tp`` sharing the experts, no more devices)."""

    pp: int
    dp: int
    tp: int
    shard: str
    cp: int = 1
    ep: int = 1
    lower_bound_s: float = 0.0
    plan: Plan | None = None
    step_s: float = math.inf
    """Pipeline iteration + exposed data-parallel communication + optimizer step (seconds per
    step)."""
    pipeline_s: float = math.inf
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    """The busiest pipeline rank's optimizer step, after its gradients are reduced
    (:func:`optimizer_exposed_s`)."""
    tp_comm_s: float = 0.0
    """The busiest rank's TP collectives per step (forward and backward, all micro-batches)."""
    compute_s: float = 0.0
    """Average rank's compute per step, TP collectives and bubble excluded."""
    recompute_s: float = 0.0
    """Average rank's re-materialization per step (the price of fitting in memory)."""
    gather_s: float = 0.0
    """Average rank's exposed parameter gathers per step (``parameters``; in the pipeline's
    unit times, so in ``pipeline_s`` too)."""
    peak_bytes: int = 0
    """Largest per-device peak (gather buffers included)."""
    reason: str = ""
    """Why it has no plan ("" if it has one), or why it loses (set by :func:`plan_mesh`)."""
    searched: bool = False
    min_memory_bytes: int | None = None
    run: tuple[Profile, PlanRequest] | None = None
    """The device profile and pipeline request ``plan`` was searched with."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    # The degrees under a Plan's names (core.mesh_rules.MeshDegrees): the mesh rules read them.
    @property
    def tensor_parallel(self) -> int:
        return self.tp

    @property
    def context_parallel(self) -> int:
        return self.cp

    @property
    def expert_parallel(self) -> int:
        return self.ep

    @property
    def fsdp(self) -> int:
        """The ranks that reduce (and shard) one parameter's gradients: ``dp x cp``
        (torchtitan's ``fsdp`` mesh dimension, ``dp_shard * cp``)."""
        return self.dp * self.cp

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """``(pp, dp, tp, cp, ep)``: the mesh, without its sharding."""
        return (self.pp, self.dp, self.tp, self.cp, self.ep)

    @property
    def bubble_s(self) -> float:
        busy = self.compute_s + self.tp_comm_s + self.gather_s + self.recompute_s
        return max(self.pipeline_s - busy, 0.0)

    def row(self) -> MeshRow:
        """The row kept in ``Plan.mesh.candidates``."""
        return MeshRow(
            pp=self.pp,
            dp=self.dp,
            tp=self.tp,
            shard=self.shard,
            cp=self.cp,
            ep=self.ep,
            step_s=self.step_s if math.isfinite(self.step_s) else None,
            pipeline_s=self.pipeline_s if math.isfinite(self.pipeline_s) else None,
            dp_comm_s=self.dp_comm_s,
            optimizer_s=self.optimizer_s,
            gather_s=self.gather_s,
            tp_comm_s=self.tp_comm_s,
            bubble_s=self.bubble_s if self.plan is not None else None,
            peak_bytes=self.peak_bytes or None,
            lower_bound_s=self.lower_bound_s,
            searched=self.searched,
            reason=self.reason,
        )


def _choices(name: str, value: int | str, allowed: list[int]) -> list[int]:
    if value == "auto":
        return allowed
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RuleViolation(f"mesh: {name}={value!r} must be 'auto' or a positive integer")
    return [value]


def mesh_candidates(
    profile: Profile,
    total_gpus: int,
    batch_size: int,
    *,
    tensor_parallel: int | str = "auto",
    data_parallel: int | str = "auto",
    shard: str = "auto",
    gpus_per_node: int | None = None,
    context_parallel: int | str = 1,
    expert_parallel: int | str = 1,
) -> list[MeshCandidate]:
    """Every ``(pp, dp, tp, shard)`` the request allows (with every C and E it allows,
    :func:`autopipe.planner.context_expert.context_expert_choices`: PP = N / (T C D), E
    dividing D C, as autopipe run lays EP out), in no particular order. Refuses
    (``RuleViolation``, one line) a fixed T that does not divide the node size, the devices or
    the model's heads, a T > 1 for a model without a TP plan, and a fixed D that does not
    divide the devices or the batch. O(sqrt(N) + divisors(N)^2 x shard modes)
    (:func:`search.divisors`, bounded as the pipeline search's)."""
    n = total_gpus
    node = gpus_per_node or n
    if shard != "auto" and shard not in SHARD_MODES:
        raise RuleViolation(f"mesh: shard={shard!r}; use auto or one of {', '.join(SHARD_MODES)}")
    allowed_t = [1] + [t for t in profile.tp_degrees if t > 1 and n % t == 0 and node % t == 0]
    if profile.tp_refusal:
        allowed_t = [1]  # the runtime cannot run this model's TP stages (found when profiling)
    ts = _choices("tensor_parallel", tensor_parallel, allowed_t)
    if tensor_parallel != "auto" and ts[0] > 1:
        t = ts[0]
        if not profile.tp_plan:
            why = profile.tp_note or "the model has no tensor-parallel plan"
            raise RuleViolation(f"tensor-parallel: T={t} needs a TP plan: {why}; use T=1")
        if profile.tp_refusal:
            raise RuleViolation(
                f"tensor-parallel: T={t} cannot run for this model: {profile.tp_refusal}; use T=1"
            )
        if node % t or n % t:
            raise RuleViolation(
                f"tensor-parallel: T={t} must divide the {node} GPUs per node and the {n} GPUs "
                "(a TP group never spans nodes)"
            )
        if t not in profile.tp_degrees:
            ok = ", ".join(map(str, [d for d in profile.tp_degrees if node % d == 0])) or "none"
            raise RuleViolation(
                f"tensor-parallel: T={t} does not divide the model's split dimensions "
                f"(heads, key/value heads); T > 1 it allows on this node: {ok}"
            )
    if data_parallel != "auto":
        d = _choices("data_parallel", data_parallel, [])[0]
        if n % d:
            raise RuleViolation(f"mesh: D={d} does not divide the {n} GPUs")
        if batch_size % d:
            raise RuleViolation(
                f"mesh: D={d} does not divide the global batch {batch_size}; each replica "
                "needs a whole share of it"
            )
    shards = list(SHARD_MODES) if shard == "auto" else [shard]
    cps, eps = context_expert_choices(profile, n, context_parallel, expert_parallel)
    out: list[MeshCandidate] = []
    for t in ts:
        for c in cps:
            if n % (t * c):
                continue
            for d in _choices("data_parallel", data_parallel, divisors(n // (t * c))):
                if (n // (t * c)) % d or batch_size % d:
                    continue
                pp = n // (t * c * d)
                for e in eps:
                    if (d * c) % e:
                        # As autopipe run lays EP out (torchtitan 0.2.2's ETP = TP): E ranks
                        # of dp x cp, each expert's FFN split over the TP ranks, as priced.
                        continue
                    for s in shards if d * c > 1 else ["none"]:
                        out.append(MeshCandidate(pp, d, t, s, cp=c, ep=e))
    return out


def _work_s(profile: Profile, batch: float) -> float:
    """Seconds of one forward + backward of ``batch`` samples over every unit of the device
    ``profile`` (one call each: per-call overheads once)."""
    return sum(
        u.forward_at(batch, profile.batch_size) + u.backward_at(batch, profile.batch_size)
        for u in profile.units
    )


def mesh_lower_bound_s(
    profile: Profile,
    device: Profile,
    cand: MeshCandidate,
    batch_size: int,
    topology: Topology,
    microbatches: list[int] | None = None,
    one_chunk_per_rank: bool = False,
    memory: PipelineMemory | None = None,
) -> float:
    """A proven lower bound on the candidate's step. The pipeline part is the smallest, over
    the micro-batch counts M the search may pick (:func:`search.microbatch_counts`: those of
    ``microbatches`` dividing the replica batch; default its divisors up to
    ``MAX_AUTO_MICROBATCHES``), of the bound every plan of that M obeys (``chunks.lower_bound_s``,
    docs/cost-model.md): some rank works ``M x`` the average micro-batch share of the whole
    model's forward and backward (``device``: one device's share, collectives included),
    ``M x`` the heaviest unit, and micro-batch 0 crosses every unit forward and back. With
    ``one_chunk_per_rank`` (GPipe, 1F1B) also the fill and drain: stage ``s`` cannot start
    before micro-batch 0's forward crossed the stages before it, works ``M`` micro-batches,
    and the last one's backward must cross them again, so ``T >= P_s + M t_s`` for every
    stage (``P_s`` = the stages before it, ``t_s`` = its time per micro-batch); over every
    split of the work ``W`` into K stages the smallest such maximum is
    ``W / (1 - (1 - 1/M)^K)`` (equalising the terms). Plus the data-parallel communication
    nothing hides (of the average rank's gradients). With ``memory`` (GPipe, 1F1B) the work
    includes the least re-materialization that memory forces
    (:mod:`autopipe.planner.mesh_bound`; infinite where not even the training state fits).
    O(N log N x #M).
    """
    replica = batch_size // cand.dp
    key = (id(device), replica, cand.pp, tuple(microbatches or ()), one_chunk_per_rank, memory)
    hit = _BOUNDS.get(key)
    if hit is not None and hit[0] is device:
        bound = hit[1]  # the same pipeline part as another sharding of this mesh
    else:
        bound = _pipeline_bound_s(
            device, replica, cand.pp, microbatches, one_chunk_per_rank, memory
        )
        if len(_BOUNDS) > 65536:
            _BOUNDS.clear()
        _BOUNDS[key] = (device, bound)
    return bound + _unhidden_dp_s(device, cand, topology)


def _unhidden_dp_s(device: Profile, cand: MeshCandidate, topology: Topology) -> float:
    """The data-parallel part of :func:`mesh_lower_bound_s`: the communication of the
    average rank's gradients nothing hides, seconds per step (no more than any cut's
    :func:`dp_exposed_s`). O(N)."""
    grads = sum(u.parameter_bytes for u in device.units) / cand.pp
    bw = topology.collective_bandwidth_bytes_per_s(cand.tp, cand.fsdp)
    size = max(int(device.bytes_per_parameter), 1)
    # fp32 gradient reduction: the gradients' collectives carry ``f`` times the parameters'
    # bytes (their latency unchanged), the parameter gathers their own
    f = topology.grad_bytes_factor(size)
    # expert shards are summed over fewer ranks (_dp_exposed_per_rank_s), at no more than the
    # gradient group's bandwidth; their latency left out: a rank without MoE units pays none
    expert, edp = 0.0, 1
    if cand.ep > 1:
        expert = sum(expert_device_bytes(u, cand.tp, size) for u in device.units) / cand.pp
        expert = min(expert, grads)
        edp = expert_data_parallel(cand.fsdp, cand.ep)

    def collective_s(scale: float, all_reduce: bool = False) -> float:
        """One all-gather or reduce-scatter (``all_reduce``: one all-reduce) of the average
        rank's parameters at ``scale`` bytes per byte."""
        price = topology.all_reduce_s if all_reduce else topology.ring_s
        expert_s = (2 if all_reduce else 1) * ring_collective_s(expert * scale, edp, bw)
        return price((grads - expert) * scale, cand.tp, cand.fsdp) + expert_s

    one = collective_s(1.0)
    one_grads = one if f == 1.0 else collective_s(f)
    all_reduce = collective_s(f, all_reduce=True)
    # DeepSpeed's BF16_Optimizer all-reduces its fp32 gradients before its ZeRO-1 step
    zero1 = (all_reduce if topology.fp32_grad_buffer else one_grads) + one
    unhidden = {"none": all_reduce, "optimizer": zero1, "gradients": one,
                "parameters": 0.0}  # fmt: skip
    if topology.grad_reduce_overlap:  # the reductions may all hide behind the backward
        unhidden["none"] = unhidden["optimizer"] = 0.0
    return unhidden[cand.shard]


_BOUNDS: dict[tuple[object, ...], tuple[Profile, float]] = {}


def _pipeline_bound_s(
    device: Profile,
    replica: int,
    pp: int,
    microbatches: list[int] | None,
    single: bool,
    memory: PipelineMemory | None = None,
) -> float:
    """The pipeline part of :func:`mesh_lower_bound_s` (every M at once, vectorised)."""
    ms = np.array(microbatch_counts(replica, microbatches), dtype=float)
    if ms.size == 0:
        bound = math.inf
    else:
        # every unit's forward and backward at every M at once: t(b) = o + (t - o) b / Bp
        fo, fs, bo, bs, share = _unit_arrays(device)
        b = (replica / ms)[None, :] / device.batch_size
        fwd = fo[:, None] + fs[:, None] * b
        bwd = bo[:, None] + bs[:, None] * b
        per_unit = fwd + bwd
        # micro-batch 0's path: every forward, then every input gradient (B of a split backward)
        path = fwd.sum(axis=0) + (bwd * share[:, None]).sum(axis=0)
        work = per_unit.sum(axis=0)
        if memory is not None:  # re-materialization the memory forces adds to the work
            work = work + memory.least_recompute_s(device, replica, pp, ms)
        terms = [ms * work / pp, ms * per_unit.max(axis=0), path]
        if single:
            terms.append(work / (1.0 - (1.0 - 1.0 / ms) ** pp))
        bound = float(np.max(terms, axis=0).min())
    return bound


def _fill_drain_beats(
    device: Profile,
    replica: int,
    pp: int,
    ms: list[int],
    speed: float,
    limit_s: float,
    memory: PipelineMemory | None = None,
) -> np.ndarray:
    """Per M of ``ms``: False where no GPipe or 1F1B plan of ``device``'s units (no gathers:
    faster than any sharding's) cut into ``pp`` stages on devices of ``speed`` runs its
    iteration within ``limit_s``, with ``memory`` (the pipeline search's limit and state)
    forcing re-materialization (:func:`autopipe.planner.mesh_bound.fill_drain_within`).
    O(K N #M)."""
    m = np.array(ms, dtype=float)
    fo, fs, bo, bs, _ = _unit_arrays(device)
    b = (replica / m)[None, :] / device.batch_size
    forward_s = (fo[:, None] + fs[:, None] * b) / speed
    unit_s = forward_s + (bo[:, None] + bs[:, None] * b) / speed
    held = None
    if memory is not None and memory.schedule in ("gpipe", "1f1b"):
        size = max(int(device.bytes_per_parameter), 1)
        params, unit_act, _, _ = unit_bytes(device)
        act = unit_act[:, None] * b
        state = params * (memory.state_bytes_per_parameter / size)
        inflight = inflight_per_stage(memory.schedule, pp, m)
        held = (state, act, inflight, memory.limit_bytes)
    # what re-materialization re-runs: the forward and its full_recompute_extra_s
    extra = np.array([u.full_recompute_extra_s for u in device.units])
    redo_s = np.maximum(forward_s + extra[:, None] * b / speed, 0.0)
    return fill_drain_within(unit_s, redo_s, m, pp, limit_s, held)


_ARRAYS: dict[int, tuple[Profile, tuple[np.ndarray, ...]]] = {}


def _unit_arrays(device: Profile) -> tuple[np.ndarray, ...]:
    """Per unit of ``device``: forward overhead, forward size-dependent part, the same for
    backward, and the backward's input-gradient share (cached per profile object)."""
    hit = _ARRAYS.get(id(device))
    if hit is not None and hit[0] is device:
        return hit[1]
    fo = np.array([min(max(u.forward_overhead_s, 0.0), u.forward_s) for u in device.units])
    bo = np.array([min(max(u.backward_overhead_s, 0.0), u.backward_s) for u in device.units])
    fs = np.array([u.forward_s for u in device.units]) - fo
    bs = np.array([u.backward_s for u in device.units]) - bo
    share = np.array([backward_input_share(u) for u in device.units])
    if len(_ARRAYS) > 4096:
        _ARRAYS.clear()
    _ARRAYS[id(device)] = (device, (fo, fs, bo, bs, share))
    return fo, fs, bo, bs, share


def dp_exposed_s(plan: Plan, device: Profile, cand: MeshCandidate, topology: Topology) -> float:
    """Seconds per step of data-parallel communication the step cannot hide, the largest over
    the pipeline ranks (docs/cost-model.md):

    - ``none``: the gradient all-reduce after the pipeline drains (ring: a reduce-scatter and
      an all-gather of the rank's gradients);
    - ``optimizer`` (ZeRO-1): a reduce-scatter of the gradients and an all-gather of the
      updated parameters, after the drain: the same volume (with ``fp32_grad_buffer``,
      DeepSpeed's BF16_Optimizer, an all-reduce of the gradients and the gather);
    - ``gradients`` (ZeRO-2) and ``parameters`` (ZeRO-3, FSDP2): the gradients are
      reduce-scattered unit by unit during the last micro-batch's backward, on one
      communication stream: a unit's reduction starts when its backward is done and the
      previous reduction has finished, so only what outlasts the rank's last backward is
      charged; ``gradients`` also all-gathers the updated parameters once per step (before
      the first forward, nothing to hide behind). ``parameters``' per-micro-batch gathers
      are in the unit times already (:func:`device_profile`); without
      ``reshard_after_forward`` (FSDP2 under PP) the parameters are gathered once, behind
      the first forward, and the reduce-scatters start after the last backward (all
      exposed) unless ``grad_reduce_overlap`` streams them with it.
    """
    return _dp_exposed_per_rank_s(
        _units_per_rank(plan), plan.microbatch_size, device, cand, topology
    )


def _units_per_rank(plan: Plan) -> dict[int, list[str]]:
    """Each pipeline rank's units, its chunks' in model order (a chunk without a rank: its
    index)."""
    per_rank: dict[int, list[str]] = {}
    for i, s in enumerate(plan.stages):
        per_rank.setdefault(s.rank if s.rank >= 0 else i, []).extend(s.units)
    return per_rank


def optimizer_exposed_s(
    plan: Plan, device: Profile, cand: MeshCandidate, topology: Topology
) -> float:
    """Seconds per step of the optimizer step, the largest over the pipeline ranks: it runs
    after the rank's last backward and its gradient reduction, on the compute stream, with
    nothing to hide behind (docs/cost-model.md, "The optimizer step")."""
    return _optimizer_per_rank_s(_units_per_rank(plan), device, cand, topology)


def _dense_and_expert_bytes(u: UnitProfile, cand: MeshCandidate, size: int) -> tuple[float, float]:
    """``u``'s parameter bytes per device split as (dense, expert): the expert share
    (``ep > 1``) is reduced and its state sharded only among the ranks holding the same
    experts (:func:`expert_data_parallel`)."""
    whole = float(u.parameter_bytes)
    expert = min(expert_device_bytes(u, cand.tp, size), whole) if cand.ep > 1 else 0.0
    return whole - expert, expert


def _optimizer_per_rank_s(
    per_rank: dict[int, list[str]], device: Profile, cand: MeshCandidate, topology: Topology
) -> float:
    """:func:`optimizer_exposed_s` of the cut that puts ``per_rank``'s units on each rank:
    each rank updates its device share of its units' parameters (``device``: per TP rank),
    divided over the ``fsdp`` ranks that shard the state (``shard`` other than ``none``;
    expert shards over the ranks holding the same experts)."""
    size = max(int(device.bytes_per_parameter), 1)
    sharded = cand.shard != "none" and cand.fsdp > 1
    edp = expert_data_parallel(cand.fsdp, cand.ep) if cand.ep > 1 else cand.fsdp
    units = {u.name: u for u in device.units}

    def elements(u: UnitProfile) -> float:
        if not sharded:
            return float(u.parameter_bytes) / size
        dense, expert = _dense_and_expert_bytes(u, cand, size)
        return (dense / cand.fsdp + expert / max(edp, 1)) / size

    fsdp = cand.shard == "parameters" and sharded  # its float8 weights' amax, once per step
    return max(
        (
            optimizer_step_s(sum(elements(units[x]) for x in names), cand.shard, size, topology)
            + (
                fp8_weight_amax_s([units[x] for x in names], cand.tp, cand.fsdp, topology)
                if fsdp
                else 0.0
            )
            for names in per_rank.values()
        ),
        default=0.0,
    )


def _dp_exposed_per_rank_s(
    per_rank: dict[int, list[str]],
    b: float,
    device: Profile,
    cand: MeshCandidate,
    topology: Topology,
) -> float:
    """:func:`dp_exposed_s` of the cut that puts ``per_rank``'s units (model order) on
    each pipeline rank, at micro-batches of ``b`` samples."""
    if cand.fsdp <= 1:
        return 0.0
    # expert shards are reduced (and ZeRO-1-gathered) only among the ranks holding the same
    # experts (context_expert.expert_data_parallel), none when E spans the group: the same
    # position in each EP group, E T ranks apart
    edp = expert_data_parallel(cand.fsdp, cand.ep) if cand.ep > 1 else cand.fsdp
    size = max(int(device.bytes_per_parameter), 1)

    def collective_s(dense: float, expert: float, all_reduce: bool) -> float:
        """One all-gather or reduce-scatter (``all_reduce``: one all-reduce) of ``dense``
        bytes over the gradient group and ``expert`` over the expert replicas' group."""
        price = topology.all_reduce_s if all_reduce else topology.ring_s
        return price(dense, cand.tp, cand.fsdp) + price(expert, cand.tp * cand.ep, edp)

    def bytes_of(mine: list[UnitProfile]) -> tuple[float, float]:
        """(dense, expert) parameter bytes of ``mine`` (expert 0 without expert replicas)."""
        total = sum(u.parameter_bytes for u in mine)
        if edp == cand.fsdp:
            return float(total), 0.0
        expert = sum(_dense_and_expert_bytes(u, cand, size)[1] for u in mine)
        return total - expert, expert

    def whole_s(mine: list[UnitProfile], scale: float, all_reduce: bool = False) -> float:
        """One collective of all of ``mine``'s parameters (``scale``: bytes per byte)."""
        dense, expert = bytes_of(mine)
        return collective_s(dense * scale, expert * scale, all_reduce)

    # the gradients' collectives in the reduce dtype (fp32 with grad_reduce_fp32), the
    # parameters' gathers in their own
    factor = topology.grad_bytes_factor(size)

    def unit_s(u: UnitProfile) -> float:
        """One gather of ``u``'s parameters over its group(s)."""
        return whole_s([u], 1.0)

    def grad_unit_s(u: UnitProfile) -> float:
        """The reduction of ``u``'s gradients: an all-reduce (``none``) or a reduce-scatter."""
        return whole_s([u], factor, cand.shard == "none")

    units = {u.name: u for u in device.units}
    worst = 0.0
    streamed = cand.shard in ("gradients", "parameters") or topology.grad_reduce_overlap
    once = cand.shard == "parameters" and not topology.reshard_after_forward
    for names in per_rank.values():
        mine = [units[x] for x in names]
        whole = whole_s(mine, 1.0)
        if not streamed:
            # ``none``: an all-reduce of the gradients (in the reduce dtype);
            # ``optimizer``: a reduce-scatter of them and a gather of the parameters
            if cand.shard == "none":
                worst = max(worst, whole_s(mine, factor, all_reduce=True))
            elif topology.fp32_grad_buffer:
                # DeepSpeed's BF16_Optimizer keeps its fp32 gradients whole on every replica:
                # its pipeline engine all-reduces them (``_bf16_reduce_grads``:
                # ``buffered_allreduce_fallback`` of ``get_grads_for_reduction()``), then the
                # step all-gathers the updated bf16 partitions (``all_gather_dp_groups``)
                worst = max(worst, whole_s(mine, factor, all_reduce=True) + whole)
            else:
                worst = max(worst, whole_s(mine, factor) + whole)
            continue
        if once and not topology.grad_reduce_overlap:
            # torch.distributed.pipelining keeps FSDP2's gradient sync off through every
            # micro-batch's backward, the last one's too, and then runs the post-backward of
            # all the stage's parameter groups (``perform_reduce_grad``; before 2025
            # ``backward_maybe_with_nosync``'s ``run_post_backward``): the reduce-scatters
            # start when the backward is over, none hidden behind it (a trainer that streams
            # them with the last backward says so: ``grad_reduce_overlap``)
            exposed = whole_s(mine, factor)
        else:
            exposed = _streamed_exposed_s(
                mine[::-1], b, device.batch_size, grad_unit_s, backward=True,
                loss=topology.overlap_compute_loss,
            )  # fmt: skip
        if cand.shard == "gradients" or (cand.shard == "optimizer" and not once):
            if cand.shard == "optimizer" and topology.grad_reduce_overlap:
                # --overlap-param-gather: the updated parameters gathered behind the forward
                exposed += _streamed_exposed_s(
                    mine, b, device.batch_size, unit_s, backward=False,
                    loss=topology.overlap_compute_loss,
                )  # fmt: skip
            else:
                exposed += whole
        if once:  # FSDP2 under PP: each unit gathered once, behind the first forward
            exposed += _streamed_exposed_s(
                mine, b, device.batch_size,
                # a float8 all-gather casts the shard first, on the same copy-in stream
                lambda u: fp8_gather_cast_s(u, cand.tp, cand.fsdp, topology) + unit_s(u),
                backward=False,
                loss=topology.overlap_compute_loss,
            )  # fmt: skip
        if cand.shard in ("gradients", "parameters"):
            # FSDP2 copies the gradients into its reduce-scatter input on the compute stream
            grads = sum(u.parameter_bytes for u in mine)
            exposed += reduce_copy_in_s(grads, factor, topology)
        worst = max(worst, exposed)
    return worst


def _streamed_exposed_s(
    units: list[UnitProfile],
    microbatch: float,
    batch: int,
    unit_s: Callable[[UnitProfile], float],
    *,
    backward: bool,
    loss: float = 0.0,
) -> float:
    """What outlasts one micro-batch's pass over ``units`` (in the order they run) of a
    collective per unit started when the unit's compute ends (backward: a reduction of its
    gradients) or needed when it starts (forward: a gather of its parameters, prefetched one
    unit ahead), on one communication stream: ``unit_s(unit)`` seconds each; plus ``loss`` of
    the communication seconds hidden behind compute (``Topology.overlap_compute_loss``).
    O(units)."""
    total = sum(unit_s(u) for u in units)
    exposed = _stream_s(units, microbatch, batch, unit_s, backward)
    return exposed + loss * max(total - exposed, 0.0)


def _stream_s(
    units: list[UnitProfile],
    microbatch: float,
    batch: int,
    unit_s: Callable[[UnitProfile], float],
    backward: bool,
) -> float:
    """The exposed part of :func:`_streamed_exposed_s` (overlap free)."""
    t = comm_end = 0.0
    if backward:
        for u in units:
            t += u.backward_at(microbatch, batch)
            start = max(t, comm_end)
            comm_end = start + unit_s(u)
        return max(comm_end - t, 0.0)
    # forward: unit i may start when its gather is done and unit i-1 has run
    for u in units:
        comm_end += unit_s(u)
        t = max(t, comm_end) + u.forward_at(microbatch, batch)
    compute = sum(u.forward_at(microbatch, batch) for u in units)
    return max(t - compute, 0.0)


def _tp_comm_s(plan: Plan, profile: Profile, cand: MeshCandidate, topology: Topology) -> float:
    """The busiest rank's TP collectives per step: forward and backward of every micro-batch."""
    if cand.tp <= 1:
        return 0.0
    original = {u.name: u for u in profile.units}
    ratio = plan.microbatch_size / profile.batch_size
    per_rank: dict[int, float] = {}
    for i, s in enumerate(plan.stages):
        r = s.rank if s.rank >= 0 else i
        per_rank[r] = per_rank.get(r, 0.0) + sum(
            (
                2 * tp_collective_s(original[x], cand.tp, topology)
                + selective_regather_s(original[x], cand.tp, topology)
            )
            * ratio
            for x in s.units
        )
    return max(per_rank.values(), default=0.0) * plan.microbatches


def plan_mesh(
    profile: Profile,
    request: PlanRequest,
) -> Plan:
    """The fastest mesh plan that fits for ``request.gpus`` devices (or ``request.cluster``'s,
    equal devices): see the module docstring. The returned Plan is the winning pipeline
    (per-device stage figures) with ``tensor_parallel``, ``replicas``, ``shard`` and
    ``tp_plan`` set, ``iteration_time_s`` the step (pipeline + exposed DP communication +
    optimizer step),
    ``throughput`` over the global batch, its peak memory per device in ``rank_peak_bytes``
    (gather buffers included), and every mesh tried in ``Plan.mesh.candidates`` (best
    first, each with why it loses).
    Raises ``RuleViolation`` for a bad request, ``PlanningError`` when no mesh fits.
    Steps: the devices, their nodes and links, the meshes to weigh, the search over them,
    the winner as a Plan."""
    n, template = _mesh_devices(profile, request)
    batch = _positive_int(
        "batch_size", profile.batch_size if request.batch_size is None else request.batch_size
    )
    topology = _topology(request, n, template)
    refuse_too_deep(
        profile, n, batch, tensor_parallel=request.tensor_parallel,
        data_parallel=request.data_parallel, gpus_per_node=topology.gpus_per_node,
        context_parallel=request.context_parallel,
    )  # fmt: skip
    cands = mesh_candidates(
        profile, n, batch,
        tensor_parallel=request.tensor_parallel, data_parallel=request.data_parallel,
        shard=request.shard, gpus_per_node=topology.gpus_per_node,
        context_parallel=request.context_parallel, expert_parallel=request.expert_parallel,
    )  # fmt: skip
    optimizer, state_bpp = training_state(profile, request.optimizer, request.bytes_per_parameter)
    topology = dataclasses.replace(topology, optimizer=optimizer)
    search = _MeshSearch(profile, request, template, topology, batch, state_bpp)
    best = search.best_of(cands)
    if best is None:
        raise _no_mesh_error(cands, n, template, request)
    _explain_losses(cands, best)
    out = _winning_plan(profile, request, best, template, batch, optimizer, state_bpp)
    out.mesh = _mesh_report(search.context_of(best), cands, best, topology, n, state_bpp)
    if request.baselines:
        out.baselines = _framework_rows(best, topology)
    searched = sum(c.searched for c in cands)
    out.notes.append(
        f"mesh pp {best.pp} x dp {best.dp} x tp {best.tp}{_cp_ep_words(best)} (shard "
        f"{best.shard}) of {n} GPUs: "
        f"pipeline {best.pipeline_s * 1e3:.4g} ms + exposed DP communication "
        f"{best.dp_comm_s * 1e3:.4g} ms + optimizer step {best.optimizer_s * 1e3:.4g} ms "
        f"per step; {searched} of {len(cands)} meshes searched, "
        "the rest could not win or fit"
    )
    if profile.tp_note and not profile.tp_plan:
        out.notes.append(f"tensor parallelism not considered: {profile.tp_note}")
    elif profile.tp_refusal:
        out.notes.append(f"tensor parallelism not considered: {profile.tp_refusal}")
    elif profile.tp_note and best.tp > 1:
        out.notes.append(profile.tp_note)  # what stays whole on every TP rank
    return out


def refuse_too_deep(
    profile: Profile,
    total_gpus: int,
    batch_size: int,
    *,
    tensor_parallel: int | str = "auto",
    data_parallel: int | str = "auto",
    gpus_per_node: int | None = None,
    context_parallel: int | str = 1,
) -> None:
    """``RuleViolation`` (bad input, one line) when every mesh of ``total_gpus`` the request
    allows has more pipeline stages than the model has units: no D (dividing the devices and
    the batch) and no T (the model's, dividing the devices and the node) bring N GPUs down to
    a pipeline the model can fill. Checked before any mesh is enumerated or any device list
    is built, so a huge N is refused at once: O(TP degrees) gcds. A fixed T or D that does
    not divide is left to :func:`mesh_candidates` to refuse by name."""
    n, units = total_gpus, len(profile.units)
    node = gpus_per_node or n
    if isinstance(tensor_parallel, int):
        ts = [tensor_parallel]
    else:
        ts = [1] + [t for t in profile.tp_degrees if t > 1 and node % t == 0]
        if profile.tp_refusal:
            ts = [1]  # as mesh_candidates: the runtime cannot run T > 1 for this model
    # C ranks split each sample's sequence: they take devices as T does (EP borrows its
    # ranks from D x C x T and takes none of its own).
    if isinstance(context_parallel, int):
        cs = [context_parallel]
    else:
        cs = [1, *context_parallel_degrees(profile)]
    fewest: tuple[int, int, int, int] | None = None
    for t in ts:
        for c in cs:
            if t < 1 or c < 1 or n % (t * c):
                continue
            rest = n // (t * c)
            d = data_parallel if isinstance(data_parallel, int) else math.gcd(rest, batch_size)
            if d < 1 or rest % d or batch_size % d:
                continue
            pp = rest // d
            if fewest is None or pp < fewest[0]:
                fewest = (pp, d, t, c)
    if fewest is None or fewest[0] <= units:
        return
    pp, d, t, c = fewest
    cp = f", C={c}" if c > 1 else ""
    raise RuleViolation(
        f"mesh: {n} GPUs make at least {pp} pipeline stages (D={d}, T={t}{cp}: the most the "
        f"batch, the nodes and the model allow) but the model has {units} units; use at most "
        f"{units * d * t * c} GPUs or a finer --granularity (module or node)"
    )


def _mesh_devices(profile: Profile, request: PlanRequest) -> tuple[int, Device]:
    """N and the one device every mesh position has (the request's equal cluster, or N of
    the profile's device), its memory filled from ``memory_per_device`` when unknown."""
    if request.cluster is not None:
        devices = request.cluster.devices
        first = devices[0]  # the dataclass's ==: astuple deep-copies, 30 s for 10^6 devices
        if any(d != first for d in devices):
            raise RuleViolation("mesh: a mesh plan needs equal devices; drop the device list")
        template = devices[0]
        if request.memory_per_device is not None and template.memory_bytes is None:
            template = dataclasses.replace(template, memory_bytes=request.memory_per_device)
        return len(devices), template
    return _positive_int("gpus", request.gpus), Device(profile.device, request.memory_per_device)


def _topology(request: PlanRequest, n: int, template: Device) -> Topology:
    """The nodes (``gpus_per_node``, default: all N in one) and their links: the device's
    link inside a node, ``inter_node_bandwidth_bytes_per_s`` between nodes (required when N
    spans nodes)."""
    node = request.gpus_per_node or n
    if node < 1:
        raise RuleViolation(f"mesh: gpus_per_node={node} must be a positive integer")
    if n > node and n % node:
        raise RuleViolation(f"mesh: {n} GPUs do not fill whole nodes of {node}")
    intra = template.link_bandwidth_bytes_per_s
    if n > node and request.inter_node_bandwidth_bytes_per_s is None:
        raise RuleViolation(
            f"mesh: {n} GPUs span nodes of {node}; give the inter-node bandwidth "
            "(inter_node_bandwidth_bytes_per_s, --inter-node-bandwidth)"
        )
    inter = request.inter_node_bandwidth_bytes_per_s or intra
    intra_lat = inter_lat = template.link_latency_s
    overlap_loss = memory_bw = base_lat = 0.0
    if is_catalog_device(template.name):  # per ring step of a collective (catalog.py)
        spec = get_device(template.name)
        if intra == spec.link_bandwidth_bytes_per_s:  # the datasheet's line rate: NCCL's share
            intra *= NCCL_NVLINK_EFFICIENCY.get(spec.name, (1.0, ""))[0]
            if request.inter_node_bandwidth_bytes_per_s is None:
                inter = intra
        given = request.inter_node_bandwidth_bytes_per_s
        if given is not None and given == spec.inter_node_bandwidth_bytes_per_s:
            inter *= NCCL_NETWORK_EFFICIENCY[0]  # the adapters' line rate: NCCL's share
        overlap_loss = spec.overlap_compute_loss
        memory_bw = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
        intra_lat = max(intra_lat, spec.collective_latency_s)
        inter_lat = max(inter_lat, spec.inter_node_collective_latency_s)
        base_lat = spec.collective_base_latency_s
    return Topology(
        node, intra, inter, intra_lat, inter_lat,
        sequence_parallel=request.sequence_parallel, tp_comm_overlap=request.tp_comm_overlap,
        loss_parallel=request.loss_parallel,
        tp_overlap_backward=request.tp_overlap_backward,
        grad_reduce_overlap=request.grad_reduce_overlap,
        reshard_after_forward=request.reshard_after_forward,
        grad_reduce_fp32=request.grad_reduce_fp32,
        fp32_grad_buffer=request.fp32_grad_buffer,
        optimizer_kernel=request.optimizer_kernel, grad_clip=request.grad_clip,
        selective_recompute=request.selective_recompute,
        memory_bytes_per_s=memory_bw,
        fp8_all_gather=request.precision == "fp8",
        overlap_compute_loss=overlap_loss, base_latency_s=base_lat,
    )  # fmt: skip


QUICK_STAGES = 4
"""Meshes of at most this many pipeline stages are searched first (see ``best_of``)."""


class _MeshSearch:
    """The pipeline search run mesh by mesh, cheapest lower bound first, skipping the meshes
    that cannot win (their bound is slower than the best step found, or ZeRO-2's twin
    already shows they cannot fit or cannot be faster)."""

    def __init__(
        self,
        profile: Profile,
        request: PlanRequest,
        template: Device,
        topology: Topology,
        batch: int,
        state_bpp: float,
    ) -> None:
        self.profile, self.request, self.template = profile, request, template
        self.topology, self.batch, self.state_bpp = topology, batch, state_bpp
        # every mesh searches its pipeline with the request's pipeline fields only
        self.base = dataclasses.replace(
            request, tensor_parallel=1, data_parallel=1, shard="none", gpus=None, cluster=None,
            context_parallel=1, expert_parallel=1,
            memory_per_device=None, gpus_per_node=None, inter_node_bandwidth_bytes_per_s=None,
            optimizer="auto",
        )  # fmt: skip
        self.microbatches = _microbatch_candidates(request.microbatches)
        self.shares: dict[tuple[int, int, int], Profile] = {}
        self.contexts: dict[tuple[bool | int, ...], Profile] = {}

    def device_of(self, c: MeshCandidate) -> Profile:
        """One device's share without the per-micro-batch gathers of ``parameters`` (they
        depend on the micro-batch size: :func:`_search` adds them per M); without them it
        bounds every sharding from below."""
        key = (c.tp, c.cp, c.ep)
        if key not in self.shares:
            self.shares[key] = device_profile(self.context_of(c), c.tp, self.topology)
        return self.shares[key]

    def memory_of(self, c: MeshCandidate) -> PipelineMemory | None:
        """What ``c``'s pipeline search may hold per device (as :func:`_search` sets it),
        for the lower bound's forced re-materialization; None for unlimited memory."""
        reserve, memory, state = _pipeline_memory(
            c, self.context_of(c), self.base, self.template, self.topology, self.state_bpp
        )
        if memory is None:
            return None
        limit = max(memory, 0) / (1.0 + self.base.headroom)
        return PipelineMemory(self.base.schedule, limit, state, self.template.speed)

    def context_of(self, c: MeshCandidate) -> Profile:
        """One rank's share of the model under ``c``'s context and expert parallelism,
        before TP (:func:`autopipe.planner.context_expert.context_expert_profile`)."""
        # what T decides: the links the CP and EP groups cross, and their ranks in each node
        t = self.topology
        key = (
            *(t.crosses_nodes(c.tp, g) for g in (c.cp, c.ep)),
            *(t.members_per_node(c.tp, g) for g in (c.cp, c.ep)),
            c.cp,
            c.ep,
        )
        if key not in self.contexts:
            self.contexts[key] = context_expert_profile(
                self.profile, c.cp, c.ep, c.tp, self.topology,
                self.request.expert_load_imbalance, self.request.context_parallel_method,
            )  # fmt: skip
        return self.contexts[key]

    def best_of(self, cands: list[MeshCandidate]) -> MeshCandidate | None:
        """The fastest mesh that fits (None if none does); every other candidate gets its
        ``reason`` when it was not searched."""
        profile = self.profile
        single = self.request.schedule in ("gpipe", "1f1b")  # one chunk per rank: fill, drain
        for c in cands:
            # a named schedule autopipe run does not run on this mesh (the rule its
            # check_mesh_plan applies): never searched, as the tied-chunks rule's meshes
            problem = mesh_schedule_problem(c, self.request.schedule)
            if problem is not None:
                c.reason = problem
                continue
            if c.pp > len(profile.units):  # never searched, so no bound priced (0: none): its
                # K x #M arrays took a minute for --gpus 10**6 --batch-size 10**12
                c.reason = f"{c.pp} stages need {c.pp} units; the model has {len(profile.units)}"
                continue
            c.lower_bound_s = mesh_lower_bound_s(
                profile, self.device_of(c), c, self.batch, self.topology, self.microbatches,
                single, self.memory_of(c),
            )  # fmt: skip
        zero2 = {c.key: c for c in cands if c.shard == "gradients"}
        best: MeshCandidate | None = None
        order = sorted(cands, key=lambda c: (c.lower_bound_s, c.tp, c.shard != "none"))
        rank = {id(c): i for i, c in enumerate(order)}  # ties: the first in bound order wins
        # Shallow pipelines first (their searches are cheapest: O(K M) simulations): the step
        # they find prunes the deep ones' searches; any order finds the same best.
        quick = [c for c in order if c.pp <= QUICK_STAGES]
        for c in quick + [c for c in order if c.pp > QUICK_STAGES]:
            if c.reason or self._ruled_out(c, best, zero2):
                continue
            if best is not None and single and self._fill_drain_rules_out(c, best.step_s):
                c.reason = "cannot beat the best (no cut's fill, work and drain is faster)"
                continue
            cutoff = best.step_s if best is not None else math.inf
            _search(
                c, plan_pipeline, self.context_of(c), self.device_of(c), self.base, self.template,
                self.topology, self.batch, self.state_bpp, self.microbatches, cutoff,
            )  # fmt: skip
            _refuse_tied_chunks(c, profile)
            if c.plan is not None and (
                best is None or (c.step_s, rank[id(c)]) < (best.step_s, rank[id(best)])
            ):
                best = c
        return best

    def _fill_drain_rules_out(self, c: MeshCandidate, step_s: float) -> bool:
        """Whether every M's GPipe / 1F1B pipeline of ``c`` is proven slower than
        ``step_s`` less the DP communication no cut hides (:func:`_unhidden_dp_s`), so its
        step cannot beat ``step_s``: :func:`_fill_drain_beats` on the device share without
        gathers. Checked before a mesh whose bound alone does not rule it out is searched:
        its search (device profiles per M, cost models, probes) costs ~10^3 x more. The
        mesh it skips would have lost (its step is above ``step_s``, not equal), so the
        best step found so far, hence the winner, is what the full search finds.
        O(K N #M)."""
        device = self.device_of(c)
        replica = self.batch // c.dp
        ms = microbatch_counts(replica, self.microbatches)
        if not ms:
            return False  # _search says why it has no plan
        limit_s = step_s - _unhidden_dp_s(device, c, self.topology)
        speed, memory = self.template.speed, self.memory_of(c)
        beats = _fill_drain_beats(device, replica, c.pp, ms, speed, limit_s, memory)
        return not bool(beats.any())

    def _ruled_out(
        self,
        c: MeshCandidate,
        best: MeshCandidate | None,
        zero2: dict[tuple[int, int, int, int, int], MeshCandidate],
    ) -> bool:
        """Whether ``c`` cannot win without being searched (its ``reason`` then says why)."""
        if best is not None and c.lower_bound_s >= best.step_s:
            c.reason = "cannot beat the best (its lower bound is slower)"
            if math.isinf(c.lower_bound_s):
                c.reason = "memory: its training state alone does not fit"
            return True
        twin = zero2.get(c.key) if c.shard in ("none", "optimizer") else None
        if twin is not None and self.topology.grad_reduce_overlap and twin.plan is not None:
            # overlapped reductions: ZeRO-1 / plain may expose less than ZeRO-2, no dominance
            twin = None
        if twin is not None and c.shard == "optimizer" and c.ep > 1:
            # FSDP2 leaves the expert shards whole, ZeRO-1 shards their optimizer state over
            # the ranks holding them (context_expert.with_expert_state): ZeRO-2 may hold more
            twin = None
        if twin is not None and twin.searched and twin.plan is None and twin.min_memory_bytes:
            # the same pipeline with more training state per device: no cut fits either
            c.reason = f"memory: needs more than ZeRO-2's {format_bytes(twin.min_memory_bytes)}"
            return True
        if twin is not None and twin.plan is not None and self.request.strategy == "dp":
            # ZeRO-2 runs the same device profile in less memory (the exact search's best
            # cut can only be as fast or faster) with no more DP communication
            c.lower_bound_s = max(c.lower_bound_s, twin.step_s)
            if best is not None and c.lower_bound_s >= best.step_s:
                c.reason = "dominated: gradients (ZeRO-2) is as fast in less memory"
                return True
        return False


def _refuse_tied_chunks(c: MeshCandidate, profile: Profile) -> None:
    """Drop ``c``'s plan, its ``reason`` the rule's line, when the runtime would refuse it for
    a parameter tied across its chunks (:func:`autopipe.core.mesh_rules.tied_chunks_problem`,
    the rule ``check_mesh_plan`` applies on every rank)."""
    if c.plan is None:
        return
    problems = tied_chunks_problems(profile.units, [s.units for s in c.plan.stages], c.tp, c.shard)
    if problems:
        c.plan, c.step_s, c.pipeline_s, c.reason = None, math.inf, math.inf, problems[0]


def _winning_plan(
    profile: Profile,
    request: PlanRequest,
    best: MeshCandidate,
    template: Device,
    batch: int,
    optimizer: str,
    state_bpp: float,
) -> Plan:
    """``best``'s pipeline plan as the mesh's plan: its mesh, step, throughput over the
    global batch, training state, request and speedup over one device."""
    out = best.plan
    assert out is not None
    out.data_parallel, out.tensor_parallel, out.shard = best.dp, best.tp, best.shard
    out.context_parallel, out.expert_parallel = best.cp, best.ep
    out.tp_plan = dict(profile.tp_plan) if best.tp > 1 else {}
    out.pipeline_iteration_s = best.pipeline_s
    out.allreduce_s = best.dp_comm_s
    out.report.optimizer_s = best.optimizer_s
    out.iteration_time_s = best.step_s
    out.throughput = batch / best.step_s if best.step_s > 0 else math.inf
    out.optimizer = optimizer
    out.state_bytes_per_parameter = state_bpp
    out.request = request
    out.trainer = TrainerOptions.from_request(request)
    out.memory_per_device = template.memory_bytes
    # one device would run the whole global batch, every unit unsplit
    one_device_s = _work_s(profile, batch) / template.speed
    out.speedup = one_device_s / best.step_s if best.step_s > 0 else 1.0
    return out


def _mesh_report(
    profile: Profile,
    cands: list[MeshCandidate],
    best: MeshCandidate,
    topology: Topology,
    n: int,
    state_bpp: float,
) -> MeshReport:
    """The chosen mesh's nodes, links and memory, and every mesh weighed, best first."""
    intra, inter = topology.intra_bandwidth_bytes_per_s, topology.inter_bandwidth_bytes_per_s
    size = max(int(profile.bytes_per_parameter), 1)
    return MeshReport(
        gpus=n,
        gpus_per_node=topology.gpus_per_node,
        intra_node_bandwidth_bytes_per_s=intra if math.isfinite(intra) else None,
        inter_node_bandwidth_bytes_per_s=inter if math.isfinite(inter) else None,
        peak_bytes=best.peak_bytes,
        gather_buffer_bytes=gather_buffer_bytes(
            profile, best.tp, best.shard, best.fsdp, topology.reshard_after_forward
        ),
        device_state_bytes_per_parameter=sharded_state_bytes_per_parameter(
            state_bpp,
            size,
            best.shard,
            best.fsdp,
            topology.reshard_after_forward,
            topology.fp32_grad_buffer,
        ),  # fmt: skip
        tp_comm_s=best.tp_comm_s,
        candidates=[c.row() for c in sorted(cands, key=_rank)],
    )


def _microbatch_candidates(value: int | str | tuple[int, ...]) -> list[int] | None:
    """The request's M candidates as a list, None for ``auto`` (every divisor)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, tuple) and all(isinstance(m, int) for m in value):
        return list(value)
    if isinstance(value, str) and value.strip().isdigit():
        return [int(value)]
    return None


def _rank(c: MeshCandidate) -> tuple[float, float]:
    return (c.step_s, c.lower_bound_s)


class PipelineSearch(Protocol):
    """The pipeline search one mesh runs (:func:`autopipe.planner.search.plan_pipeline`): the
    device profile, the request, the step time to beat, the schedules ``auto`` may pick."""

    def __call__(
        self, profile: Profile, req: PlanRequest, cutoff_s: float, *, schedules: tuple[str, ...]
    ) -> Plan: ...


def _search(
    c: MeshCandidate,
    inner: PipelineSearch,
    profile: Profile,
    device: Profile,
    base: PlanRequest,
    template: Device,
    topology: Topology,
    batch: int,
    state_bpp: float,
    microbatches: list[int] | None,
    cutoff_s: float = math.inf,
) -> None:
    """Run the pipeline search for one mesh and price its step (in place). ``parameters``
    sharding: the gathers each micro-batch exposes depend on its size, so each M is searched
    on the device profile priced at its micro-batch (those whose bound cannot beat the best M
    so far are skipped); the other shardings: one search over every M."""
    c.searched = True
    reserve, memory, state = _pipeline_memory(c, profile, base, template, topology, state_bpp)
    if memory is not None and memory <= 0:
        c.reason = f"memory: the gather buffers alone take {format_bytes(reserve)}"
        return
    replica = batch // c.dp
    req = dataclasses.replace(
        base, cluster=Cluster(_stage_devices(c, template, topology, memory)),
        batch_size=replica, bytes_per_parameter=state, baselines=False,
    )  # fmt: skip
    runs = _runs(c, profile, device, req, topology, microbatches, replica, state_bpp)
    single = base.schedule in ("gpipe", "1f1b")
    limit = None if memory is None else PipelineMemory(
        base.schedule, max(memory, 0) / (1.0 + base.headroom), state, template.speed
    )  # fmt: skip
    best, refused = _best_run(
        c, inner, profile, device, runs, topology, batch, single, cutoff_s, limit, template.speed
    )
    if best is None:
        reserved = reserve * (1 + base.headroom)
        c.reason = _no_plan_reason(
            c, refused, bool(runs), cutoff_s, microbatches, replica, reserved
        )
        return
    c.run = (best[1], best[2])
    _price(c, best[0], best[1], profile, device, topology, replica, reserve)
    device_bytes = template.memory_bytes
    if device_bytes is not None and c.peak_bytes * (1.0 + base.headroom) > device_bytes:
        # the transient peak (mesh_costs.transient_bytes) is checked after the search
        c.plan, c.run, c.step_s, c.pipeline_s = None, None, math.inf, math.inf
        c.reason = f"memory: needs {format_bytes(c.peak_bytes)} per device with its transient peak"


def _pipeline_memory(
    c: MeshCandidate,
    profile: Profile,
    base: PlanRequest,
    template: Device,
    topology: Topology,
    state_bpp: float,
) -> tuple[float, int | None, float]:
    """``c``'s reserved bytes per device (gather buffers and the request's reserve), the
    memory left to its pipeline (None: unlimited) and the training state per parameter its
    pipeline search charges (sharding applied)."""
    size = max(int(profile.bytes_per_parameter), 1)
    keep = topology.reshard_after_forward
    reserve = gather_buffer_bytes(profile, c.tp, c.shard, c.fsdp, keep) + base.memory_reserve_bytes
    memory = template.memory_bytes
    if memory is not None:
        memory = int(memory - reserve * (1.0 + base.headroom))
    state = sharded_state_bytes_per_parameter(
        state_bpp, size, c.shard, c.fsdp, keep, topology.fp32_grad_buffer
    )
    return reserve, memory, state


def _stage_devices(
    c: MeshCandidate, template: Device, topology: Topology, memory: int | None
) -> list[Device]:
    """The ``pp`` devices of one pipeline of the mesh, each with its memory left for the
    pipeline and the link its stage sends over."""
    stages = []
    for s in range(c.pp):
        bw, lat = topology.pp_link(c.tp * c.cp, c.dp, s)
        stages.append(
            dataclasses.replace(
                template, memory_bytes=memory, link_bandwidth_bytes_per_s=bw, link_latency_s=lat
            )
        )
    return stages


def _runs(
    c: MeshCandidate,
    profile: Profile,
    device: Profile,
    req: PlanRequest,
    topology: Topology,
    microbatches: list[int] | None,
    replica: int,
    state_bpp: float,
) -> list[tuple[Callable[[], Profile], PlanRequest]]:
    """The pipeline searches one mesh needs: one over every M, or with ``parameters``
    sharding over D > 1 one per M, on the device profile priced at its micro-batch (built
    only when that M's bound does not already rule it out: O(units) each); each with its
    expert shards' state as the runtime holds it
    (:func:`autopipe.planner.context_expert.with_expert_state`)."""
    keep = topology.reshard_after_forward

    def experts(share: Profile) -> Profile:
        return with_expert_state(share, c.tp, c.ep, c.shard, c.fsdp, state_bpp, keep)

    if c.shard != "parameters" or c.fsdp <= 1:
        own = experts(device)
        return [(lambda: own, req)]

    def at(m: int) -> Callable[[], Profile]:
        return lambda: experts(
            device_profile(
                profile,
                c.tp,
                topology,
                shard="parameters",
                dp=c.fsdp,
                microbatch_size=replica / m,
            )  # fmt: skip
        )

    return [
        (at(m), dataclasses.replace(req, microbatches=m))
        for m in microbatch_counts(replica, microbatches)
    ]


def _best_run(
    c: MeshCandidate,
    inner: PipelineSearch,
    profile: Profile,
    device: Profile,
    runs: list[tuple[Callable[[], Profile], PlanRequest]],
    topology: Topology,
    batch: int,
    single: bool,
    cutoff_s: float,
    memory: PipelineMemory | None = None,
    speed: float = 1.0,
) -> tuple[tuple[Plan, Profile, PlanRequest] | None, PlanningError | None]:
    """The fastest plan of ``runs`` with the device profile and request it was made on (None
    if none beats ``cutoff_s`` or fits), and the refusal needing the least memory. With one
    run per M, an M whose bound on ``device`` (no gathers, so below its own profile's)
    cannot beat ``cutoff_s`` or the best M so far is not searched, nor (GPipe, 1F1B) one
    whose pipeline is proven slower than that by :func:`_fill_drain_beats` (on devices of
    ``speed``): such an M's plan would not be taken (a pipeline above the best M's) or its
    mesh would lose (above ``cutoff_s``, the best step found) anyway."""
    best: tuple[Plan, Profile, PlanRequest] | None = None
    refused: PlanningError | None = None
    schedules = mesh_schedules(c)
    for make, one in runs:
        beat = min(cutoff_s, best[0].iteration_time_s if best is not None else math.inf)
        m = one.microbatches
        if len(runs) > 1 and isinstance(m, int) and math.isfinite(beat):
            bound = mesh_lower_bound_s(profile, device, c, batch, topology, [m], single, memory)
            if bound >= beat:
                continue
            replica = batch // c.dp
            if single and not _fill_drain_beats(device, replica, c.pp, [m], speed, beat, memory)[0]:
                continue
        share = make()
        if best is not None and len(runs) > 1:
            assert isinstance(m, int)
            bound = mesh_lower_bound_s(profile, share, c, batch, topology, [m], single)
            if bound >= best[0].iteration_time_s:
                continue
        try:
            # under schedule auto, only those autopipe run runs on this mesh (core.mesh_rules)
            p = inner(share, one, beat, schedules=schedules)
        except CannotBeat:
            continue
        except PlanningError as exc:  # rule violations (this M) and memory alike
            if refused is None or (exc.min_memory_bytes or math.inf) < (
                refused.min_memory_bytes or math.inf
            ):
                refused = exc
            continue
        if best is None or p.iteration_time_s < best[0].iteration_time_s:
            best = (p, share, one)
    return best, refused


def _no_plan_reason(
    c: MeshCandidate,
    refused: PlanningError | None,
    searched: bool,
    cutoff_s: float,
    microbatches: list[int] | None,
    replica: int,
    reserved_bytes: float,
) -> str:
    """Why a searched mesh has no plan, in one line; a memory refusal also records the
    least memory a cut needs (``c.min_memory_bytes``), said with the gather buffers'
    ``reserved_bytes`` added."""
    if refused is None and searched and math.isfinite(cutoff_s):
        return "cannot beat the best (no schedule's or M's bound is faster)"
    if refused is None:
        return f"microbatches: none of {microbatches} divides the replica batch {replica}"
    if isinstance(refused, RuleViolation) or not refused.min_memory_bytes:
        return str(refused).splitlines()[0]
    c.min_memory_bytes = refused.min_memory_bytes
    return f"memory: needs {format_bytes(refused.min_memory_bytes + reserved_bytes)} per device"


def _price(
    c: MeshCandidate,
    p: Plan,
    share: Profile,
    profile: Profile,
    device: Profile,
    topology: Topology,
    replica: int,
    reserve: float,
) -> None:
    """Record ``p`` (made on the device profile ``share``) as the mesh's plan and price its
    step: pipeline, exposed DP communication, TP collectives, gathers, compute, recompute,
    peak memory (in place)."""
    if c.shard == "parameters" and c.fsdp > 1:
        # the search charged each stage's whole state as parameter bytes x (s / D) / p: a
        # device keeps 1 / D of its parameters between uses, the rest is gradient + optimizer
        unsharded = 0.0 if topology.reshard_after_forward else 1.0  # FSDP2 under PP keeps them
        size = max(int(share.bytes_per_parameter), 1)
        units = {u.name: u for u in share.units}
        for st in p.stages:
            state = st.parameter_bytes + st.optimizer_bytes
            whole = st.parameter_bytes  # the stage's (per-TP) parameters
            # FSDP2 leaves the expert shards whole (runtime ignored_params)
            kept = sum(expert_device_bytes(units[x], c.tp, size) for x in st.units)
            kept = min(kept, whole) if c.ep > 1 else 0.0
            dense = whole - kept
            st.parameter_bytes = int(round(dense / c.fsdp + unsharded * dense + kept))
            st.optimizer_bytes = max(state - st.parameter_bytes, 0)
    c.plan = p
    c.pipeline_s = p.iteration_time_s
    c.dp_comm_s = dp_exposed_s(p, share, c, topology)
    c.optimizer_s = optimizer_exposed_s(p, share, c, topology)
    c.step_s = c.pipeline_s + c.dp_comm_s + c.optimizer_s
    c.tp_comm_s = _tp_comm_s(p, profile, c, topology)
    b = replica / p.microbatches
    work = _work_s(device, b) * p.microbatches
    c.gather_s = (_work_s(share, b) * p.microbatches - work) / c.pp
    c.compute_s = max(work / c.pp - c.tp_comm_s, 0.0)
    c.recompute_s = sum(st.recompute_s for st in p.stages) * p.microbatches / c.pp
    # the largest unit's transient working memory (the loss's logits) above the saved ones
    transient = transient_bytes(device, b)
    c.peak_bytes = int(max(p.rank_peak_bytes, default=0) + reserve + transient)


def _framework_rows(best: MeshCandidate, topology: Topology) -> dict[str, dict[str, Any]]:
    """Each framework default's split priced on ``best``'s mesh: the same device profile
    (TP collectives and ``parameters`` gathers in its unit times), pipeline request, M and
    schedule as ``best``'s plan, each framework's cut and schedule in place of autopipe's,
    plus the exposed DP communication of that cut (``dp_comm_s``), so its
    ``iteration_time_s`` is a step like the plan's. One more pipeline search (the winner's
    M, schedule and V fixed) yields the rows."""
    assert best.plan is not None and best.run is not None
    share, req = best.run
    p = best.plan
    fixed = dataclasses.replace(
        req, microbatches=p.microbatches, schedule=cast(Schedule, p.schedule),
        virtual_stages=p.virtual_stages, baselines=True,
    )  # fmt: skip
    try:
        again = plan_pipeline(share, fixed)
    except PlanningError:  # the same search found p: cannot happen; no rows rather than no plan
        return {}
    names = [u.name for u in share.units]
    rows: dict[str, dict[str, Any]] = {}
    for name in FRAMEWORK_DEFAULTS:
        row = again.baselines.get(name)
        if row is None:
            continue
        if row.get("iteration_time_s") is not None and row.get("balance"):
            ranks = chunk_ranks(row["schedule"], best.pp, row.get("virtual_stages", 1))
            per_rank: dict[int, list[str]] = {}
            start = 0
            for rank, count in zip(ranks, row["balance"], strict=True):
                per_rank.setdefault(rank, []).extend(names[start : start + count])
                start += count
            dp_s = _dp_exposed_per_rank_s(per_rank, p.microbatch_size, share, best, topology)
            opt_s = _optimizer_per_rank_s(per_rank, share, best, topology)
            row["pipeline_iteration_s"] = row["iteration_time_s"]
            row["dp_comm_s"] = dp_s
            row["optimizer_s"] = opt_s
            row["iteration_time_s"] += dp_s + opt_s
        rows[name] = row
    return rows


def _explain_losses(cands: list[MeshCandidate], best: MeshCandidate) -> None:
    """Each searched loser's reason: the part of its step that exceeds the winner's most."""
    best.reason = "chosen"
    for c in cands:
        if c is best or c.plan is None:
            continue
        parts = {
            "bubble": c.bubble_s - best.bubble_s,
            "TP comm": c.tp_comm_s - best.tp_comm_s,
            "DP comm": c.dp_comm_s + c.gather_s - best.dp_comm_s - best.gather_s,
            "compute": c.compute_s - best.compute_s,
            "recompute (memory)": c.recompute_s - best.recompute_s,
            "optimizer step": c.optimizer_s - best.optimizer_s,
        }
        what = max(parts, key=lambda k: parts[k])
        c.reason = f"{what} (+{format_seconds(parts[what])})"


def _cp_ep_words(c: MeshCandidate) -> str:
    """`` x cp C x ep E`` for the degrees above 1."""
    return (f" x cp {c.cp}" if c.cp > 1 else "") + (f" x ep {c.ep}" if c.ep > 1 else "")


def _no_mesh_error(
    cands: list[MeshCandidate], n: int, template: Device, request: PlanRequest
) -> PlanningError:
    rules = {c.reason for c in cands if c.reason.startswith(("tied-chunks:", "mesh-schedule:"))}
    if rules and all(c.reason in rules for c in cands):
        # every mesh the request allows breaks a mesh rule: bad input, said once
        return RuleViolation(min(rules))
    needs = [c.min_memory_bytes for c in cands if c.min_memory_bytes]
    have = format_bytes(template.memory_bytes) if template.memory_bytes else "unlimited memory"
    if needs:
        # Only what the request has not tried already (it searched shard and checkpoint
        # "auto" through every mode, M "auto" through every count).
        tries = ["more GPUs"]
        if request.shard not in ("auto", "parameters"):
            tries.append("--shard parameters")
        if request.checkpoint in ("never", "except_last"):
            tries.append("--checkpoint auto")
        if request.schedule == "gpipe":  # holds all M micro-batches' activations at once
            tries.append("--schedule 1f1b or auto")
        if request.microbatches != "auto":
            tries.append("--microbatches auto")
        exc = PlanningError(
            f"no mesh of {n} GPUs fits in {have} per device: the smallest need is "
            f"{format_bytes(min(needs))} per device; try {', '.join(tries)}"
        )
        exc.min_memory_bytes = min(needs)
        return exc
    reasons = "; ".join(f"{c.shape}{_cp_ep_words(c)} {c.shard}: {c.reason}" for c in cands[:4])
    return PlanningError(f"no mesh of {n} GPUs works: {reasons}")
