"""The device mesh's cost and memory model: what one device of a ``PP x DP x TP`` mesh holds and
spends, per unit, for tensor-parallel degree T and data-parallel degree D with the training
state sharded over D. Torch-free; every formula is in docs/cost-model.md ("The device mesh").

The pipeline search itself is unchanged: :func:`device_profile` turns the model's Profile into
the Profile of *one device* of the mesh (its share of every unit's time, parameters and
activations, tensor-parallel collectives included), and :func:`sharded_state_bytes_per_parameter`
says how many training-state bytes each of that device's parameters carries. The exact
pipeline search then runs on them as on any profile.

Links (:class:`Topology`): the mesh is laid out as torchtitan lays it out, ``(pp, dp, tp)``
outermost first, so rank ``r`` has ``tp = r mod T``, ``dp = (r // T) mod D``,
``pp = r // (T D)``; nodes hold ``gpus_per_node`` consecutive ranks. A TP group (T adjacent
ranks, T dividing the node size) never leaves its node; a DP group spans ``T D`` consecutive
ranks and crosses nodes when ``T D > gpus_per_node``; stage ``s`` sends to stage ``s + 1``,
``T D`` ranks further, across nodes when the two fall in different nodes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from autopipe.planner import nccl

from autopipe.core.optimizer import optimizer_step_bytes_per_parameter
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.vocabulary import SHARD_MODES

__all__ = [
    "NCCL_NETWORK_EFFICIENCY",
    "NCCL_NVLINK_EFFICIENCY",
    "REDUCE_BYTES",
    "Topology",
    "device_profile",
    "fp8_gather_cast_s",
    "fp8_weight_amax_s",
    "fused_reduce_scatter_sum_s",
    "gather_buffer_bytes",
    "gather_copy_out_s",
    "grad_accumulation_bytes_per_parameter",
    "grad_accumulation_s",
    "optimizer_step_s",
    "reduce_copy_in_s",
    "ring_collective_s",
    "selective_regather_s",
    "sequence_relayout_s",
    "sharded_state_bytes_per_parameter",
    "tp_collective_s",
    "tp_overlap_exposed_s",
    "tp_share",
    "transient_bytes",
    "unit_device_parameter_bytes",
]


_NCCL_212 = (
    "https://github.com/NVIDIA/nccl-tests/issues/212 (NCCL's maintainer: '450GB/s is the line "
    "rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of "
    "370GB/s, which you can observe as BusBw when running non-allreduce operations')"
)
_NCCL_SM80 = (
    "NVIDIA/nccl src/graph/topo.h at 5067397c (SM80_NVLINK_BW 20.0 GB/s per NVLink 3 link, of "
    "its 25 GB/s line rate); https://github.com/NVIDIA/nccl/issues/1054 (NCCL's maintainer, on "
    "an 8-A100 server's 240 GB/s: 'there is an overhead for NVLink packets. Roughly, the "
    "app-level bandwidth is 80% of the peak bandwidth')"
)
NCCL_NVLINK_EFFICIENCY: dict[str, tuple[float, str]] = {
    # NVLink 3 (A100): NCCL's own per-link figure on the 25 GB/s line rate of each of 12 links
    "A100-40GB": (20 / 25, _NCCL_SM80),
    "A100-80GB": (20 / 25, _NCCL_SM80),
    # NVLink 4 (Hopper): NCCL's protocol overhead on the 450 GB/s line rate; the H800's and the
    # 500 W H100's NVLink 4 take the same overhead on their own line rate
    "H100-SXM-80GB": (370 / 450, _NCCL_212),
    "H800-SXM-80GB": (370 / 450, _NCCL_212),
    "H200-141GB": (370 / 450, _NCCL_212),
    "H100-96GB-HBM2e-500W": (370 / 450, _NCCL_212),
}
"""Per catalog GPU: (share of the NVLink line rate NCCL's collectives and sends reach, source).
The catalog's link figure is the datasheet's line rate; NCCL moves data in its own protocol
(headers, flags), so a ring all-gather or reduce-scatter's bus bandwidth stays below it. A GPU
without a row (PCIe parts: no such statement found) is priced at the line rate."""

NCCL_NETWORK_EFFICIENCY = (
    24 / 25,
    "https://github.com/NVIDIA/nccl-tests/issues/119 (NCCL's maintainer: 'We usually consider "
    "24GB/s is the peak performance per 200G NIC (12 GB/s for 100G NICs)'); NVIDIA/nccl "
    "src/graph/topo.h (NET_BW 12.0 for 100 Gbit)",
)
"""(Share of a network adapter's line rate NCCL's transfers reach, source): 24 of a 200 Gb/s
adapter's 25 GB/s, 12 of a 100 Gb/s one's 12.5; applied to the catalog's inter-node line rates
(200 Gb/s HDR, 400 Gb/s NDR), and to a figure the user gave only where it is that line rate
(any other is taken as measured)."""


@dataclass(frozen=True)
class Topology:
    """Nodes of ``gpus_per_node`` devices: ``intra_bandwidth_bytes_per_s`` between two devices
    of one node (NVLink, per direction), ``inter_bandwidth_bytes_per_s`` per device between
    nodes (its network adapter, per direction). ``intra_latency_s`` and ``inter_latency_s``
    are one ring step's (a hop over NVLink, a hop over the network) and ``base_latency_s``
    every collective's once, as NCCL's tuning model has them (:mod:`autopipe.planner.nccl`)."""

    gpus_per_node: int
    intra_bandwidth_bytes_per_s: float
    inter_bandwidth_bytes_per_s: float
    intra_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    sequence_parallel: bool = True
    """TP shards the activations outside its regions too (``PlanRequest.sequence_parallel``)."""
    loss_parallel: bool = False
    """An LM head's logits stay sharded over TP (``PlanRequest.loss_parallel``): no gather of
    ``tp_gathered_output_bytes``, its bytes split; False: gathered, whole on every TP rank."""
    tp_comm_overlap: bool = False
    """TP collectives overlap the matmuls they feed (``PlanRequest.tp_comm_overlap``)."""
    tp_overlap_backward: bool = True
    """The backward's TP collectives overlap too (``PlanRequest.tp_overlap_backward``); False:
    torchtitan's async TP (torch's symmetric-memory micro-pipeline TP), which overlaps the
    forward only and sums its fused reduce-scatters' partials on the compute stream."""
    grad_reduce_overlap: bool = False
    """Unsharded gradients are reduced during the backward (``PlanRequest.grad_reduce_overlap``)."""
    reshard_after_forward: bool = True
    """``parameters`` sharding gathers per micro-batch (True) or once per step (False)."""
    grad_reduce_fp32: bool = False
    """Gradients are reduced in fp32 (``PlanRequest.grad_reduce_fp32``)."""
    fp32_grad_buffer: bool = False
    """An fp32 gradient beside the 16-bit one, summed every micro-batch
    (``PlanRequest.fp32_grad_buffer``, :func:`grad_accumulation_bytes_per_parameter`)."""
    memory_bytes_per_s: float = 0.0
    """Sustained memory bandwidth of one device (the catalog's peak times its memory
    efficiency): prices the memory-bound copies a collective's implementation runs on the
    compute stream (FSDP2's all-gather copy-out, :func:`gather_copy_out_s`); 0: not priced
    (no catalog figure)."""
    selective_recompute: bool = False
    """Selective checkpointing is on (``PlanRequest.selective_recompute``): a unit's backward
    re-runs the TP all-gathers its recipe does not save (``selective_recompute_gather_bytes``)."""
    optimizer: str = "none"
    """The resolved optimizer (``autopipe/core/optimizer.py``) whose step
    :func:`optimizer_step_s` prices; ``none``: not priced."""
    optimizer_kernel: str = "foreach"
    """How the step runs (``PlanRequest.optimizer_kernel``)."""
    grad_clip: str = "none"
    """Gradient clipping before the step (``PlanRequest.grad_clip``)."""
    fp8_all_gather: bool = False
    """Precision fp8 (``PlanRequest.precision``): ``parameters`` sharding gathers FP8
    weights, cast on each rank's shard first (``UnitProfile.fp8_gather_cast_bytes``, and
    their amax once per step, ``fp8_weight_amax_bytes``), where the profile says so."""
    base_latency_s: float = 0.0
    """Latency every collective pays once, whatever its size and group (NCCL's base latency,
    :data:`autopipe.planner.nccl.BASE_LATENCY_S` on catalog GPUs); 0: not priced."""
    overlap_compute_loss: float = 0.0
    """Share of a hidden collective's seconds that the compute it overlaps loses (NCCL's
    kernels occupy SMs and memory bandwidth): a collective hidden behind compute is not
    free. 0: overlap is free."""

    def hidden_cost_s(self, comm_s: float, compute_s: float) -> float:
        """Seconds a collective of ``comm_s`` overlapping ``compute_s`` of compute adds: what
        outlasts the compute, plus ``overlap_compute_loss`` of the part hidden behind it."""
        hidden = min(comm_s, compute_s)
        return max(0.0, comm_s - compute_s) + self.overlap_compute_loss * hidden

    def grad_bytes_factor(self, parameter_size_bytes: int) -> float:
        """Bytes a gradient reduction moves per byte of the parameters it reduces: with
        ``grad_reduce_fp32`` the gradients travel in fp32 (:data:`REDUCE_BYTES` per element),
        else in the parameters' own dtype (1)."""
        if not self.grad_reduce_fp32 or parameter_size_bytes >= REDUCE_BYTES:
            return 1.0
        return REDUCE_BYTES / max(parameter_size_bytes, 1)

    def crosses_nodes(self, tp: int, size: int) -> bool:
        """Whether a group of ``size`` ranks ``tp`` apart (a DP, CP or EP group: torchtitan's
        layout puts TP innermost) spans more than one node."""
        return tp * size > self.gpus_per_node

    def members_per_node(self, tp: int, size: int) -> int:
        """Ranks of one group (``size`` ranks ``tp`` apart) in each node it spans:
        ``gpus_per_node / tp`` when it crosses nodes (TP stays in the node), 1 when TP fills
        the node, ``size`` inside one node."""
        return max(1, min(size, self.gpus_per_node // max(tp, 1)))

    def nodes_spanned(self, tp: int, size: int) -> int:
        """Nodes a group of ``size`` ranks ``tp`` apart spans (1 inside a node)."""
        if not self.crosses_nodes(tp, size):
            return 1
        return -(-size // self.members_per_node(tp, size))

    def collective_bandwidth_bytes_per_s(self, tp: int, size: int) -> float:
        """Bus bandwidth at which a ring collective (all-gather, reduce-scatter, all-reduce)
        of a group of ``size`` ranks ``tp`` apart runs: inside a node, NVLink; across nodes,
        the network adapters of the group's devices in each node together
        (:meth:`members_per_node` of them, one each), up to NVLink's rate. NCCL runs a ring
        per channel and spreads the channels over those adapters, each ring leaving a node
        once, so every adapter carries ``1 / k`` of what a rank sends over NVLink
        (docs/cost-model.md, "Collectives across nodes")."""
        if self.crosses_nodes(tp, size):
            adapters = self.members_per_node(tp, size) * self.inter_bandwidth_bytes_per_s
            return min(adapters, self.intra_bandwidth_bytes_per_s)
        return self.intra_bandwidth_bytes_per_s

    def ring_latency_s(self, tp: int, size: int, *, all_reduce: bool = False) -> float:
        """Latency of one ring collective of a group of ``size`` ranks ``tp`` apart, as NCCL's
        tuning model prices it (:func:`autopipe.planner.nccl.ring_latency_s`): the base
        latency, the steps inside nodes at the NVLink hop's and the ``N - 1`` across at the
        network hop's."""
        return nccl.ring_latency_s(
            size, self.nodes_spanned(tp, size), self.intra_latency_s, self.inter_latency_s,
            self.base_latency_s, all_reduce=all_reduce,
        )  # fmt: skip

    def ring_s(self, nbytes: float, tp: int, size: int) -> float:
        """Seconds of one ring all-gather or reduce-scatter of ``nbytes`` (the whole, gathered
        size) in a group of ``size`` ranks ``tp`` apart: :func:`ring_collective_s` at
        :meth:`collective_bandwidth_bytes_per_s`, plus :meth:`ring_latency_s`. 0 for one rank
        or no bytes. O(1)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bandwidth = self.collective_bandwidth_bytes_per_s(tp, size)
        return ring_collective_s(nbytes, size, bandwidth) + self.ring_latency_s(tp, size)

    def all_reduce_s(self, nbytes: float, tp: int, size: int) -> float:
        """Seconds of one all-reduce of ``nbytes`` in a group of ``size`` ranks ``tp`` apart:
        the faster of NCCL's ring and, across nodes, its tree
        (:func:`autopipe.planner.nccl.all_reduce_s`). O(1)."""
        return nccl.all_reduce_s(
            nbytes, size, self.nodes_spanned(tp, size),
            self.collective_bandwidth_bytes_per_s(tp, size),
            self.intra_latency_s, self.inter_latency_s, self.base_latency_s,
        )  # fmt: skip

    def step_link(self, tp: int, size: int) -> tuple[float, float]:
        """(bandwidth, latency) of one step of a ring of point-to-point sends (every rank of a
        group of ``size`` ranks ``tp`` apart sends to the next at once): across nodes the
        ranks at a node's edge each send over their own adapter, one adapter's rate, which
        the step waits for; inside a node, NVLink."""
        if self.crosses_nodes(tp, size):
            return self.inter_bandwidth_bytes_per_s, self.inter_latency_s
        return self.intra_bandwidth_bytes_per_s, self.intra_latency_s

    def all_to_all_s(self, sent_bytes: float, tp: int, size: int) -> float:
        """Seconds of one all-to-all in which every rank of a group of ``size`` ranks ``tp``
        apart sends ``sent_bytes`` spread evenly over the other ``size - 1``: the share for
        the ``k - 1`` peers in its node goes over NVLink while the share for the ``size - k``
        peers in other nodes goes over the rank's own network adapter (every rank of the node
        sends at once, so each has one adapter's rate), the two at once; one latency of the
        farthest link. O(1)."""
        if size <= 1 or sent_bytes <= 0:
            return 0.0
        k = self.members_per_node(tp, size)
        intra = sent_bytes * (k - 1) / (size - 1) / self.intra_bandwidth_bytes_per_s
        if not self.crosses_nodes(tp, size):
            return intra + self.intra_latency_s
        inter = sent_bytes * (size - k) / (size - 1) / self.inter_bandwidth_bytes_per_s
        return max(intra, inter) + self.inter_latency_s

    def pp_link(self, tp: int, dp: int, stage: int) -> tuple[float, float]:
        """(bandwidth, latency) of the send from pipeline stage ``stage`` to ``stage + 1``
        (the first ranks of the two stages; every rank of a stage sends to the rank ``T D``
        further, and they all cross alike when ``T D`` is a multiple or divisor of the node)."""
        here = stage * tp * dp // self.gpus_per_node
        there = (stage + 1) * tp * dp // self.gpus_per_node
        if here == there:
            return self.intra_bandwidth_bytes_per_s, self.intra_latency_s
        return self.inter_bandwidth_bytes_per_s, self.inter_latency_s


def ring_collective_s(
    nbytes: float, group: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Seconds of one ring all-gather or reduce-scatter of a ``nbytes`` buffer (the whole,
    gathered size) among ``group`` ranks: each sends ``(group - 1) / group`` of it, in
    ``group - 1`` steps. 0 for a group of one; an all-reduce is two of these."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) / group * nbytes / bandwidth_bytes_per_s + (group - 1) * latency_s


def fp8_gather_cast_s(unit: UnitProfile, tp: int, fsdp: int, topology: Topology) -> float:
    """Seconds one rank spends casting its shard of ``unit``'s FP8 weights before one float8
    FSDP all-gather: ``fp8_gather_cast_bytes / (tp x fsdp)`` at ``topology.memory_bytes_per_s``
    (the FP8 weights are the TP-split linears). 0 unless ``topology.fp8_all_gather``."""
    if not topology.fp8_all_gather or topology.memory_bytes_per_s <= 0:
        return 0.0
    share = unit.fp8_gather_cast_bytes / (max(tp, 1) * max(fsdp, 1))
    return share / topology.memory_bytes_per_s


def fp8_weight_amax_s(units: list[UnitProfile], tp: int, fsdp: int, topology: Topology) -> float:
    """Seconds of one rank's per-step amax of its shard of ``units``' FP8 weights
    (``fp8_weight_amax_bytes / (tp x fsdp)`` summed, at ``topology.memory_bytes_per_s``).
    0 unless ``topology.fp8_all_gather``."""
    if not topology.fp8_all_gather or topology.memory_bytes_per_s <= 0:
        return 0.0
    share = sum(u.fp8_weight_amax_bytes for u in units) / (max(tp, 1) * max(fsdp, 1))
    return share / topology.memory_bytes_per_s


def tp_share(unit: UnitProfile, tp: int) -> float:
    """The factor on ``unit``'s compute time on one of ``tp`` devices: its split share
    (``tp_compute_fraction``) runs ``tp`` times faster, the rest as before."""
    phi = min(max(unit.tp_compute_fraction, 0.0), 1.0) if tp > 1 else 0.0
    return 1.0 - phi + phi / tp


def tp_collective_s(unit: UnitProfile, tp: int, topology: Topology) -> float:
    """Seconds, at the profile's batch size, of the unit's tensor-parallel collectives in one
    pass (forward, and again in backward): an all-gather and a reduce-scatter of each TP
    region's input (``tp_collective_bytes``) over the node's link (Megatron-style sequence
    parallelism)."""
    if tp <= 1 or unit.tp_collective_bytes <= 0:
        return 0.0
    nbytes = float(unit.tp_collective_bytes)
    if topology.loss_parallel:
        # loss parallelism: the logits are not gathered (C carries a quarter of them); the
        # vocab-parallel cross-entropy's three all-reduces of one fp32 per token (max, sum
        # of exponentials, target logit) are 6 / V of the logits' bytes: not priced
        nbytes = max(nbytes - unit.tp_gathered_output_bytes / 4, 0.0)
    return 2 * topology.ring_s(nbytes, 1, tp)


def selective_regather_s(unit: UnitProfile, tp: int, topology: Topology) -> float:
    """Seconds the backward spends all-gathering again, over the T group, the TP regions'
    inputs the selective recipe does not save (``selective_recompute_gather_bytes``; one ring
    all-gather each, at the profile's batch): torchtitan's op policy keeps the reduce-scatters'
    outputs and re-runs the all-gathers with the re-computation. 0 without
    ``topology.selective_recompute`` or with ``tp`` 1."""
    if tp <= 1 or not topology.selective_recompute or unit.selective_recompute_gather_bytes <= 0:
        return 0.0
    return topology.ring_s(unit.selective_recompute_gather_bytes, 1, tp)


def sequence_relayout_s(nbytes: float, unit: UnitProfile, tp: int, topology: Topology) -> float:
    """Seconds the compute stream spends rearranging ``nbytes`` of TP collectives (their
    gathered size) when sequence parallelism shards a non-leading dimension
    (``unit.tp_sequence_dim`` > 0): torch's functional collectives
    (torch/distributed/_functional_collectives.py) gather along dim 0 and then
    ``torch.cat(torch.chunk(res, group_size, dim=0), dim=gather_dim)``, and before a
    reduce-scatter ``torch.cat(torch.chunk(self, group_size, dim=scatter_dim))``: each
    collective's whole buffer read and written once more, ``2 x nbytes`` at
    ``topology.memory_bytes_per_s`` (torchtitan's ``apply_tp`` notes that folding the batch and
    sequence dimensions would avoid it). 0 with the sequence first (Megatron's layout), for
    ``tp`` 1 or an unknown bandwidth."""
    if tp <= 1 or unit.tp_sequence_dim <= 0 or topology.memory_bytes_per_s <= 0 or nbytes <= 0:
        return 0.0
    return 2.0 * nbytes / topology.memory_bytes_per_s


def fused_reduce_scatter_sum_s(unit: UnitProfile, tp: int, topology: Topology) -> float:
    """Seconds of the summing pass torch's fused matmul-reduce-scatter runs on the compute
    stream, per forward, for the unit's row-wise outputs (``tp_rowwise_output_bytes``, each
    the whole ``b x s x h`` output of its matmul): ``_fused_matmul_reduce_scatter_impl``
    (torch/distributed/_symmetric_memory/__init__.py) computes the matmul in ``tp`` row chunks,
    sends each rank its chunk of the partial sums into a ``stacked_partials`` buffer of the
    whole output's size, then adds the ``tp`` partials up (``torch.sum``): every byte of the
    output read once, a ``1/tp`` share written, at ``topology.memory_bytes_per_s``. NCCL's reduce-scatter
    sums inside the collective instead, which the collective's time already carries. 0 for
    ``tp`` 1 or an unknown bandwidth."""
    if tp <= 1 or topology.memory_bytes_per_s <= 0 or unit.tp_rowwise_output_bytes <= 0:
        return 0.0
    return unit.tp_rowwise_output_bytes * (1.0 + 1.0 / tp) / topology.memory_bytes_per_s


def tp_overlap_exposed_s(
    comm_s: float, compute_s: float, tp: int, overlap_compute_loss: float = 0.0
) -> float:
    """Exposed seconds of a pass's TP collectives ``comm_s`` overlapped with its compute
    ``compute_s`` (async TP, ``--tp-comm-overlap``): the collective and the matmul are cut
    into ``tp`` chunks and pipelined, so the first chunk's communication waits for nothing to
    hide behind, and the rest hides behind the compute as far as it lasts."""
    rest = comm_s * (1.0 - 1.0 / tp)
    hidden = min(rest, compute_s)
    return comm_s / tp + max(0.0, rest - compute_s) + overlap_compute_loss * hidden


def unit_device_parameter_bytes(unit: UnitProfile, tp: int, parameter_size_bytes: int) -> float:
    """One device's bytes of ``unit``'s parameters with ``tp``-way tensor parallelism: the
    split ones (``tp_parameter_count``, and the routed experts, ``moe_expert_parameter_count``,
    which the runtime splits Megatron-style, each TP rank a slice of every expert's
    intermediate features) divided by ``tp``, the rest replicated."""
    whole = (
        unit.parameter_bytes
        if unit.parameter_bytes > 0
        else unit.parameter_count * parameter_size_bytes
    )
    count = unit.tp_parameter_count + unit.moe_expert_parameter_count
    if tp <= 1 or count <= 0:
        return float(whole)
    split = min(count * parameter_size_bytes, whole)
    return float(whole - split + split / tp)


REDUCE_BYTES = 4.0
"""Bytes per element of an unsharded gradient that FSDP2 accumulates across micro-batches
without syncing (under pipeline parallelism): ``FSDPParam.to_accumulated_grad_if_needed``
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py) casts it to the reduce dtype when that
differs from the parameter dtype, and torchtitan reduces in fp32 by default
(``training.mixed_precision_reduce = "float32"``, torchtitan's config manager)."""


def sharded_state_bytes_per_parameter(
    state_bytes_per_parameter: float,
    parameter_size_bytes: int,
    shard: str,
    dp: int,
    reshard_after_forward: bool = True,
    fp32_grad_buffer: bool = False,
) -> float:
    """Training-state bytes one device holds per parameter it owns (before data parallelism),
    with the state sharded over ``dp`` replicas: a parameter of ``p`` bytes carries itself
    (``p``), its gradient (``p``) and optimizer state (``state - 2 p``); ``optimizer`` (ZeRO-1)
    divides the optimizer state by ``dp``, ``gradients`` (ZeRO-2) the gradient too,
    ``parameters`` (ZeRO-3, FSDP2) all three (the gather buffers are apart:
    :func:`gather_buffer_bytes`). ``parameters`` without ``reshard_after_forward`` (FSDP2
    under pipeline parallelism, as torchtitan runs it) also holds every parameter and its
    gradient unsharded across the step's micro-batches: ``p`` more for the parameter, and the
    gradient accumulated in the reduce dtype, fp32 (4 bytes; :data:`REDUCE_BYTES`).
    ``fp32_grad_buffer`` (DeepSpeed's ``BF16_Optimizer``): an fp32 gradient beside the
    parameter's (:data:`REDUCE_BYTES` more, sharded as the gradient is)."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r}; expected one of {', '.join(SHARD_MODES)}")
    p = float(parameter_size_bytes)
    grad, opt = p, max(state_bytes_per_parameter - 2 * p, 0.0)
    if fp32_grad_buffer and shard in ("none", "optimizer", "gradients"):
        grad += REDUCE_BYTES
    if dp <= 1 or shard == "none":
        return p + grad + opt
    if shard == "optimizer":
        return p + grad + opt / dp
    if shard == "gradients":
        return p + (grad + opt) / dp
    if not reshard_after_forward:
        return p + max(grad, REDUCE_BYTES) + (p + grad + opt) / dp
    return (p + grad + opt) / dp


def gather_buffer_bytes(
    profile: Profile, tp: int, shard: str, dp: int, reshard_after_forward: bool = True
) -> float:
    """Bytes a device keeps for gathered parameters with ``parameters`` sharding: the largest
    unit's full (per-TP) parameters, twice (the one computing and the one prefetched). A bound
    for every stage (the largest unit of the model, not of the stage). 0 otherwise."""
    if shard != "parameters" or dp <= 1 or not reshard_after_forward:
        return 0.0  # without resharding the gathered parameters are in the state already
    size = max(int(profile.bytes_per_parameter), 1)
    return 2.0 * max(unit_device_parameter_bytes(u, tp, size) for u in profile.units)


def transient_bytes(device: Profile, microbatch_size: float) -> float:
    """Bytes a device needs above the saved activations while its largest-transient unit runs,
    at ``microbatch_size`` samples: per unit ``max(0, peak_bytes - activation_bytes)`` (the
    profile's transient peak, e.g. the loss's fp32 logits and their gradient), scaled from the
    profile's batch; the largest over ``device``'s units (a bound for every stage, as the
    gather buffers are). 0 where the profile records no peaks."""
    at = microbatch_size / max(device.batch_size, 1)
    extra = (max(u.peak_bytes - u.activation_bytes, 0) for u in device.units)
    return at * max(extra, default=0)


def gather_copy_out_s(parameter_bytes: float, topology: Topology) -> float:
    """Seconds the compute stream spends copying one ``parameters``-sharding all-gather's
    output (``parameter_bytes``, the unit's whole per-TP parameters) out of FSDP2's flat
    buffer into the parameters' own tensors: ``foreach_all_gather_copy_out``
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) waits for the all-gather on
    the current stream and runs ``split_with_sizes_copy`` there, reading and writing every
    byte once, at ``topology.memory_bytes_per_s``. 0 where that is unknown."""
    if topology.memory_bytes_per_s <= 0 or parameter_bytes <= 0:
        return 0.0
    return 2.0 * parameter_bytes / topology.memory_bytes_per_s


def reduce_copy_in_s(parameter_bytes: float, grad_bytes_factor: float, topology: Topology) -> float:
    """Seconds the compute stream spends copying ``parameter_bytes`` worth of unsharded
    gradients (in the parameters' dtype) into FSDP2's reduce-scatter input, written in the
    reduce dtype (``grad_bytes_factor`` bytes per byte: 2 for bf16 gradients reduced in
    fp32): ``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
    runs ``foreach_reduce_scatter_copy_in`` (``chunk_cat``) on the current stream before
    handing the buffer to the reduce-scatter stream. 0 where the bandwidth is unknown."""
    if topology.memory_bytes_per_s <= 0 or parameter_bytes <= 0:
        return 0.0
    return (1.0 + grad_bytes_factor) * parameter_bytes / topology.memory_bytes_per_s


def grad_accumulation_bytes_per_parameter(topology: Topology, shard: str, size: int) -> float:
    """Bytes the compute stream moves per parameter of a device, on every micro-batch, to add
    that micro-batch's gradient (``size`` bytes an element, the parameters' dtype) into an fp32
    accumulator outside the backward's own kernels (docs/cost-model.md, "Gradient accumulation
    into fp32"):

    - ``fp32_grad_buffer`` (DeepSpeed's ``BF16_Optimizer``): after each micro-batch's backward
      the pipeline engine calls ``update_hp_grads``, ``hp_grad.data.add_(lp.grad.data.to(
      hp_grad.dtype))`` per parameter (deepspeed/runtime/bf16_optimizer.py, 56c5223): the
      cast reads ``size`` and writes 4, the add reads 4 + 4 and writes 4: ``size + 16``;
    - FSDP2 under pipeline parallelism (``shard="parameters"`` without
      ``reshard_after_forward``) reducing in fp32: torch.distributed.pipelining turns the
      gradient sync off for every micro-batch, so FSDP2's post-backward adds each new
      gradient into its fp32 ``unsharded_accumulated_grad`` (``FSDPParam.
      accumulate_unsharded_grad_if_needed``, ``+=`` of the bf16 gradient: ``size`` + 4
      read, 4 written): ``size + 8`` (the first micro-batch's cast, ``size + 4``, counted
      the same);

    0 otherwise (Megatron accumulates in its fp32 ``main_grad`` inside the weight-gradient
    GEMM, ``gradient_accumulation_fusion``; fp32 parameters need no cast)."""
    if size >= REDUCE_BYTES:
        return 0.0
    if topology.fp32_grad_buffer:
        return size + 4 * REDUCE_BYTES
    fsdp_unsynced = shard == "parameters" and not topology.reshard_after_forward
    if fsdp_unsynced and topology.grad_reduce_fp32:
        return size + 2 * REDUCE_BYTES
    return 0.0


def grad_accumulation_s(
    parameter_bytes: float, size: int, per_parameter_bytes: float, topology: Topology
) -> float:
    """Seconds of one micro-batch's gradient accumulation on a device holding
    ``parameter_bytes`` of parameters (``size`` bytes each) at ``per_parameter_bytes``
    (:func:`grad_accumulation_bytes_per_parameter`); 0 where the bandwidth is unknown."""
    if topology.memory_bytes_per_s <= 0 or per_parameter_bytes <= 0 or parameter_bytes <= 0:
        return 0.0
    return parameter_bytes / max(size, 1) * per_parameter_bytes / topology.memory_bytes_per_s


def optimizer_step_s(
    parameter_count: float, shard: str, parameter_size_bytes: int, topology: Topology
) -> float:
    """Seconds of the optimizer step over ``parameter_count`` parameter elements (the rank's
    share after sharding), all memory-bound passes at ``topology.memory_bytes_per_s``:
    ``optimizer_step_bytes_per_parameter`` of ``topology.optimizer`` run as the trainer runs
    it. ``shard="parameters"`` (FSDP2) updates its fp32 sharded parameters in place (no
    16-bit copy to refresh) and gets fp32 gradients from its reduce-scatter; the other modes
    copy the fp32 master weights back into the 16-bit ones, and cast 16-bit gradients first
    unless they are reduced or accumulated in fp32. 0 where the bandwidth is unknown."""
    if topology.memory_bytes_per_s <= 0 or parameter_count <= 0:
        return 0.0
    fsdp = shard == "parameters"
    per_element = optimizer_step_bytes_per_parameter(
        topology.optimizer, parameter_size_bytes,
        kernel=topology.optimizer_kernel, grad_clip=topology.grad_clip,
        master_copy=not fsdp,
        grad_cast=not (fsdp or topology.grad_reduce_fp32 or topology.fp32_grad_buffer),
    )  # fmt: skip
    return parameter_count * per_element / topology.memory_bytes_per_s


def _scaled(total_s: float, overhead_s: float, factor: float) -> float:
    """``total_s`` with its size-dependent part (above ``overhead_s``) times ``factor``."""
    overhead_s = min(max(overhead_s, 0.0), total_s)
    return overhead_s + (total_s - overhead_s) * factor


def device_profile(
    profile: Profile,
    tp: int,
    topology: Topology,
    *,
    shard: str = "none",
    dp: int = 1,
    microbatch_size: float | None = None,
) -> Profile:
    """The Profile of one device of a mesh with tensor-parallel degree ``tp`` and ``dp``
    replicas sharded by ``shard``: per unit

    - compute: the split share of forward and backward (``tp_compute_fraction``) divided by
      ``tp`` (per-call overheads unchanged), plus the unit's TP collectives
      (:func:`tp_collective_s`) in forward and again in backward;
    - ``parameters`` sharding: each pass also all-gathers the unit's parameters over the DP
      group, prefetched while the previous unit (in that pass's order) computes: only
      ``max(0, gather - that unit's compute)`` is charged, a fixed per-call cost (it does not
      shrink with the micro-batch), priced with the previous unit's compute at
      ``microbatch_size`` samples (the profile's batch if None), so the profile holds for
      that micro-batch size only;
    - parameter bytes: :func:`unit_device_parameter_bytes` (``parameter_count`` keeps the
      model's own count, which the runtime checks the model against);
    - activations, outputs and cut tensors between two split units: divided by ``tp``
      (sequence parallelism shards them).

    With ``tp == 1`` and no ``parameters`` sharding the profile itself is returned. O(units).
    """
    gather = shard == "parameters" and dp > 1 and topology.reshard_after_forward
    size = max(int(profile.bytes_per_parameter), 1)
    accumulate = grad_accumulation_bytes_per_parameter(topology, shard if dp > 1 else "none", size)
    if tp <= 1 and not gather and (accumulate <= 0 or topology.memory_bytes_per_s <= 0):
        return profile
    n = len(profile.units)
    extras = (
        _gather_extras_s(profile, tp, topology, dp, size, microbatch_size)
        if gather
        else [(0.0, 0.0)] * n
    )
    units = [
        _device_unit(u, tp, topology, size, fwd_extra, bwd_extra, accumulate)
        for u, (fwd_extra, bwd_extra) in zip(profile.units, extras, strict=True)
    ]
    split = [
        tp > 1
        and profile.units[i].tp_parameter_count > 0
        and profile.units[i + 1].tp_parameter_count > 0
        for i in range(len(profile.cut_bytes))
    ]
    sends = [c // tp if s else c for c, s in zip(profile.cut_bytes, split, strict=True)]
    # without sequence parallelism the hidden state between TP units is whole on every TP
    # rank (what a checkpointed unit keeps); Megatron and DeepSpeed still send 1/T of it
    cuts = sends if topology.sequence_parallel else list(profile.cut_bytes)
    out = dataclasses.replace(
        profile, units=units, cut_bytes=cuts, send_cut_bytes=sends if cuts != sends else [],
        meta=dict(profile.meta),
    )  # fmt: skip
    out.meta["mesh_device"] = {"tensor_parallel": tp, "shard": shard, "replicas": dp}
    return out


def _gather_extras_s(
    profile: Profile,
    tp: int,
    topology: Topology,
    dp: int,
    size: int,
    microbatch_size: float | None,
) -> list[tuple[float, float]]:
    """Per unit, the seconds of its ``parameters``-sharding all-gather over the DP group that
    the neighbouring unit's compute does not hide, in forward and in backward."""
    computes: list[tuple[float, float]] = []
    at = (microbatch_size or profile.batch_size) / profile.batch_size
    for u in profile.units:
        c = tp_share(u, tp)
        computes.append(
            (
                _scaled(u.forward_s, u.forward_overhead_s, c * at),
                _scaled(u.backward_s, u.backward_overhead_s, c * at),
            )
        )
    n = len(profile.units)
    extras = []
    for i, u in enumerate(profile.units):
        param = unit_device_parameter_bytes(u, tp, size)
        # a float8 all-gather's casts of the shard run first, on the same copy-in stream
        g = fp8_gather_cast_s(u, tp, dp, topology) + topology.ring_s(param, tp, dp)
        # forward runs units in order (unit i's gather hides behind unit i-1), backward
        # in reverse (behind unit i+1); the first of each pass hides behind nothing.
        # then the copy-out, on the compute stream: nothing hides it
        copy_out = gather_copy_out_s(param, topology)
        fwd_extra = topology.hidden_cost_s(g, computes[i - 1][0] if i > 0 else 0.0) + copy_out
        bwd_extra = topology.hidden_cost_s(g, computes[i + 1][1] if i + 1 < n else 0.0) + copy_out
        extras.append((fwd_extra, bwd_extra))
    return extras


def _device_unit(
    u: UnitProfile,
    tp: int,
    topology: Topology,
    size: int,
    fwd_extra: float,
    bwd_extra: float,
    accumulate: float = 0.0,
) -> UnitProfile:
    """``u`` on one device of ``tp``: its split compute, its TP collectives in forward and
    backward, the gather seconds ``fwd_extra`` / ``bwd_extra``, its share of the bytes, and
    its gradients' fp32 accumulation at ``accumulate`` bytes per parameter per micro-batch
    (:func:`grad_accumulation_bytes_per_parameter`)."""
    c = tp_share(u, tp)
    sp = tp > 1 and u.tp_parameter_count > 0
    # a gathered output (an LM head's logits without loss parallelism) is whole on every TP
    # rank, and so is what the unit saves and peaks at: the gathered input, the logits and
    # the loss's fp32 copies of them
    whole = sp and u.tp_gathered_output_bytes > 0 and not topology.loss_parallel
    sharded = sp and not whole
    act = u.activation_bytes // tp if sharded else u.activation_bytes
    peak = u.peak_bytes // tp if sharded else u.peak_bytes
    if sharded and topology.sequence_parallel and u.tp_gathered_input_bytes > 0:
        # torch's ColwiseParallel saves the all-gathered input: whole on every TP rank
        gathered = min(u.tp_gathered_input_bytes, u.activation_bytes)
        act = (u.activation_bytes - gathered) // tp + gathered
        peak = (u.peak_bytes - gathered) // tp + gathered
    if sharded and not topology.sequence_parallel:
        # plain TP: what only sequence parallelism splits stays whole on every TP rank
        rep = min(max(u.tp_replicated_compute_fraction, 0.0), u.tp_compute_fraction)
        c += rep * (1.0 - 1.0 / tp)
        kept = min(u.tp_replicated_activation_bytes, u.activation_bytes)
        act = (u.activation_bytes - kept) // tp + kept
    param = unit_device_parameter_bytes(u, tp, size)
    fwd = _scaled(u.forward_s, u.forward_overhead_s, c)
    bwd = _scaled(u.backward_s, u.backward_overhead_s, c)
    comm = tp_collective_s(u, tp, topology)
    comm_f = comm_b = comm
    regather = selective_regather_s(u, tp, topology)
    # a pass's collectives gather and scatter 2 C bytes; with the sequence not leading, each
    # buffer is rearranged by a copy (the re-gathers too)
    relayout = sequence_relayout_s(2 * u.tp_collective_bytes, u, tp, topology)
    regather += sequence_relayout_s(u.selective_recompute_gather_bytes, u, tp, topology)
    relayout_f = relayout
    if topology.tp_comm_overlap and comm > 0:
        loss = topology.overlap_compute_loss
        comm_f = tp_overlap_exposed_s(comm, fwd, tp, loss)
        if topology.tp_overlap_backward:
            comm_b = tp_overlap_exposed_s(comm, bwd, tp, loss)
        else:
            # torchtitan's async TP overlaps the forward only: its authors measured forward
            # and end-to-end speedups (~29% / ~8% on Llama 3 8B, ~20% / ~8% on 70B) that the
            # forward alone accounts for, and its June 2025 table's async / vanilla ratios
            # (1.09 to 1.16) match a backward whose collectives all stay exposed
            comm_b = comm
            # its reduce-scatters in forward are torch's fused matmul-reduce-scatter, whose
            # partial sums are added up on the compute stream
            comm_f += fused_reduce_scatter_sum_s(u, tp, topology)
            # the fused reduce-scatter's sum writes the scattered layout itself; the fused
            # all-gather returns the gathered input chunk-major, which its other consumers
            # (the weight gradient) copy into the sequence-major layout: half stays
            relayout_f = relayout / 2
    comm_f += relayout_f
    comm_b += relayout
    # the re-run all-gathers open the backward's re-computation: exposed in every mode (async
    # TP could pipeline one with the re-computed matmul it feeds; not credited)
    comm_b += regather
    # the gradients summed into fp32 after the backward: a fixed cost per micro-batch (it
    # does not shrink with the micro-batch), with the weight gradients it follows
    acc = grad_accumulation_s(param, size, accumulate, topology)
    bwd_extra += acc
    split = u.backward_input_s + u.backward_weight_s
    b_in = _scaled(u.backward_input_s, u.backward_input_overhead_s, c)
    b_wt = _scaled(u.backward_weight_s, u.backward_weight_overhead_s, c) + acc
    out = copy.copy(u)  # dataclasses.replace, without re-running __init__ (100x faster)
    changes = dict(
        forward_s=fwd + comm_f + fwd_extra,
        forward_overhead_s=min(u.forward_overhead_s, u.forward_s) + fwd_extra,
        backward_s=bwd + comm_b + bwd_extra,
        backward_overhead_s=min(u.backward_overhead_s, u.backward_s) + bwd_extra,
        # the collectives carry the input gradient: they belong to B, not W
        backward_input_s=b_in + comm_b + bwd_extra - acc if split > 0 else 0.0,
        backward_weight_s=b_wt if split > 0 else 0.0,
        # the re-run's difference from the forward is compute (FP8 casts): split as it is
        full_recompute_extra_s=u.full_recompute_extra_s * c,
        parameter_bytes=int(math.ceil(param)),
        activation_bytes=act,
        output_bytes=u.output_bytes // tp if sharded else u.output_bytes,
        peak_bytes=peak,
    )
    for name, value in changes.items():
        setattr(out, name, value)
    return out
