"""Context parallelism (CP, degree C) and expert parallelism (EP, degree E) in the mesh's cost
and memory model. Torch-free; the formulas are in docs/cost-model.md ("Context and expert
parallelism").

:func:`context_expert_profile` turns the model's Profile into the Profile of one rank of a
CP group of C ranks and an EP group of E ranks, *before* tensor parallelism
(:func:`autopipe.planner.mesh_costs.device_profile` then splits it over T as it splits any
profile), so the pipeline search runs on it unchanged:

- CP (torch's ``context_parallel``, ring attention): every unit runs on ``s / C`` tokens of
  each sample, so its batch-dependent time, activations, outputs, cut tensors and TP
  collectives are divided by C; causal attention is load-balanced as torch does (each rank
  holds chunks ``i`` and ``2C - 1 - i`` of ``2C``), so the attention work divides by C too.
  Each attention layer exchanges keys and values as torch's ring attention runs it
  (``torch/distributed/tensor/experimental/_attention.py``, its default ``ALL_GATHER``
  rotation, torchtitan's default ``context_parallel_rotate_method = "allgather"``): one
  all-gather of every rank's ``b (s / C) kv_heads (d_k + d_v)`` elements per pass, launched
  before the local (step 0) block and waited after it, so it hides only behind ``1 / C`` of
  the pass's attention; in backward the keys and values are all-gathered again and their
  gradients, accumulated in fp32, go round the ring one step at a time (``ALL_TO_ALL``), each
  step's transfer behind that step's block and the last one waited after the loop. Between
  the blocks, torch merges each block's output into an fp32 output (forward) and adds each
  block's gradients into fp32 accumulators (backward): element-wise passes at the device's
  memory bandwidth (:data:`RING_MERGE_BYTES`), charged in full. The other method,
  ``all_gather`` (the Llama 3 paper's, arXiv 2407.21783 section 3.3.2: K and V all-gathered,
  then the local queries' attention in one call; Megatron's ``--cp-comm-type all_gather``):
  the all-gather exposed (the paper: "exposed in the critical path"), no merges, and the K/V
  gradients reduce-scattered in backward. ``ring_compiled``: torch's ring traced into a
  ``torch.compile`` graph (torchtitan compiles each block with the attention inside): its
  functional collectives are waited as soon as issued, so every exchange is exposed, and
  inductor fuses the merges. Across nodes the all-gathers (and the reduce-scatter) run over
  every network adapter the group's ranks have in a node (``Topology.ring_s``, as a
  DP group's collectives), the gradients' ring steps at one adapter's rate
  (``Topology.step_link``: the ranks at a node's edge each send over their own).
- EP (torchtitan's MoE with an all-to-all token dispatch): each MoE layer's routed experts
  are spread over E ranks, so their parameters (and with them gradients and optimizer
  state) divide by E; each MoE layer dispatches and combines its tokens with an all-to-all,
  in forward and again in backward (four per layer and step of a micro-batch), each rank
  sending ``tokens x k x hidden`` elements of which ``(E-1)/E`` leave it, not overlapped: the
  share for its node's peers over NVLink, the share for other nodes' peers over its own
  network adapter, both at once (``Topology.all_to_all_s``); the busiest rank receives
  ``imbalance`` times the average and computes ``imbalance`` times the average expert work
  (:data:`DEFAULT_EXPERT_LOAD_IMBALANCE`).
  No token is dropped (dropless routing, as DeepSeek-V3 and torchtitan train).

Mesh layout (torchtitan's ``ParallelDims``): ``pp, dp, cp, tp`` outermost first, so a CP group
is C ranks T apart (it crosses nodes when ``T C`` exceeds the node), the gradient-reducing
(FSDP) group is ``dp x cp`` (``dp_shard * cp``), and the EP group is E ranks of ``dp x cp``
(torchtitan 0.2.2's layout with expert TP = TP, as ``autopipe run`` builds it), each expert's
FFN split over the T ranks of its TP group: E ranks T apart, crossing nodes when ``E T``
exceeds the node.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from autopipe.planner.errors import RuleViolation
from autopipe.planner.mesh_costs import Topology, sharded_state_bytes_per_parameter

from autopipe.core.catalog import get_device, is_catalog_device
from autopipe.core.profile import Profile, UnitProfile

__all__ = [
    "DEFAULT_EXPERT_LOAD_IMBALANCE",
    "RING_GRAD_BYTES",
    "RING_MERGE_BYTES",
    "RING_MERGE_BYTES_COMPILED",
    "context_expert_choices",
    "context_expert_profile",
    "context_parallel_degrees",
    "expert_data_parallel",
    "expert_device_bytes",
    "expert_parallel_degrees",
    "with_expert_state",
]

DEFAULT_EXPERT_LOAD_IMBALANCE = 1.25
"""Tokens the busiest expert-parallel rank receives over the average: the capacity factor
1.25 of the Switch Transformer (Fedus, Zoph and Shazeer, JMLR 2022, section 2.2 and its
tables, the factor at which its routing stopped dropping a material share of tokens; GShard
(Lepikhin et al., 2021) trained with 2.0). Dropless routing lets the busiest rank run over
the average; this is the stated default for how far."""


RING_GRAD_BYTES = 4
"""Bytes per element of the key and value gradients torch's ring passes round in backward:
its ``_cp_options.convert_to_f32`` (default True) accumulates them in fp32
(``accum_dtype = torch.float32``) and sends the accumulators."""

RING_MERGE_BYTES = {
    "forward_once": (12.0, 0.0),
    "forward_step": (38.0, 4.0),
    "backward_once": (20.0, 28.0),
    "backward_step": (10.0, 25.0),
}
"""Bytes torch's ring attention reads and writes per element between the attention blocks,
as ``(per query element, per key-and-value element)`` of one rank's chunk: ``b (s / C) H d``
query (and output) elements, ``b (s / C) kv_heads (d_k + d_v)`` key and value elements; each
op one kernel reading its inputs and writing its output (``_SDPAMerger``,
``_templated_ring_attention(_backward)``, ``_partial_update``), for the busiest rank (the
last: its every later block uses all its queries):

- forward, once: step 0's output cast to fp32 (2 + 4) and the merged result back (4 + 2);
- forward, per later step: the block's output to fp32 (2 + 4), ``out - block_out``
  (4 + 4 + 4), times the log-sum-exp weight (4 + 4), ``out - that`` (4 + 4 + 4): 38; and
  the key and value concatenated for the exchange (2 + 2);
- backward, once: the fp32 accumulators zeroed (4 per query, key and value element), step
  0's gradients added (query 4 + 2 + 4; key and value likewise, then concatenated for the
  ring, 4 + 4), and the results cast back (4 + 2 each): 20 and 28;
- backward, per later step: the query gradient added (4 + 2 + 4); the key and value
  gradients added into their half (half of 4 + 2 + 4) and the halves concatenated (4 + 4),
  the pair concatenated for the ring (4 + 4), the keys and values for the exchange (2 + 2):
  10 and 25.

The per-row log-sum-exp updates (``1 / d`` of these) are left out."""

RING_MERGE_BYTES_COMPILED = {
    "forward_once": (0.0, 4.0),
    "forward_step": (10.0, 0.0),
    "backward_once": (6.0, 10.0),
    "backward_step": (10.0, 10.0),
}
""":data:`RING_MERGE_BYTES` when the ring is traced into a ``torch.compile`` graph
(``method="ring_compiled"``): inductor fuses each step's chain of element-wise ops into one
kernel that reads its inputs once and writes its output once, and drops what nothing reads:

- forward, once: the key and value concatenated for the all-gather (2 + 2); the later steps'
  concatenations are dead code (``_AllGatherRotater.exchange_buffers`` gathers only on its
  first call) and step 0's cast to fp32 is fused into step 1's merge;
- forward, per later step: the fp32 running output read (4), the block's bf16 output read
  (2), the merged output written (4): 10;
- backward, once: step 0's gradients written into the fp32 accumulators (read 2, write 4 per
  query, key and value element) and the keys and values concatenated for the all-gather (2 +
  2): 6 and 10;
- backward, per later step: the query gradient added (4 + 2 read, 4 written); the key and
  value gradients added to the received fp32 buffer, written straight into the buffer sent
  on (4 + 2 read, 4 written): 10 and 10."""


def replaced(u: UnitProfile, **changes: object) -> UnitProfile:
    """``dataclasses.replace`` for a unit, without re-running ``__init__`` (a hundred times
    faster; the mesh search builds thousands of device profiles)."""
    out = copy.copy(u)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def context_parallel_degrees(profile: Profile) -> list[int]:
    """The C > 1 the profile allows: it has attention and a sequence length, and torch's
    load-balanced ring needs ``2 C`` equal chunks of the sequence (C divides ``s / 2``)."""
    s = profile.sequence_length
    if s < 2 or not any(u.attention_layers for u in profile.units):
        return []
    return [c for c in range(2, s // 2 + 1) if (s // 2) % c == 0 and s % 2 == 0]


MIN_AUTO_CHUNK_TOKENS = 128
"""``auto`` weighs only the C whose ``2 C`` load-balanced chunks hold at least this many
tokens each: one tile of the flash-attention kernels (128 query rows); smaller chunks leave
the kernel idle and only add ring steps. A fixed C below it is planned as asked."""


def expert_parallel_degrees(profile: Profile) -> list[int]:
    """The E > 1 the profile allows: every MoE layer's routed experts divide over E."""
    g = 0
    for u in profile.units:
        if u.moe_layers and u.moe_experts:
            g = math.gcd(g, u.moe_experts)
    return [e for e in range(2, g + 1) if g % e == 0]


def _flops(u: UnitProfile, batch: int, seq: int) -> tuple[float, float, float]:
    """(attention core, routed experts, whole unit) forward FLOPs at ``batch`` samples: the
    attention scores and weighted values ``2 b H s^2 (d_k + d_v)`` per layer (as the
    analytic profiler counts them, unmasked), the experts ``2 b s k P_exp / E`` (every token
    meets k of the E experts); the whole is the profile's count where it has one, else
    those plus ``2 b s`` per dense parameter."""
    attn = (
        2.0
        * batch
        * u.attention_heads
        * seq
        * seq
        * (u.attention_head_dim + u.attention_value_head_dim)
        * u.attention_layers
    )
    exp = (
        2.0 * batch * seq * u.moe_top_k * u.moe_expert_parameter_count / u.moe_experts
        if u.moe_experts
        else 0.0
    )
    whole = u.forward_flops
    if whole <= 0:
        dense = max(u.parameter_count - u.moe_expert_parameter_count, 0)
        whole = attn + exp + 2.0 * batch * seq * dense
    return attn, exp, whole


def _ring_s(
    u: UnitProfile,
    tokens: float,
    cp: int,
    size: int,
    tp: int,
    topology: Topology,
    memory_bytes_per_s: float,
    attention_f_s: float,
    attention_b_s: float,
    method: str = "ring",
) -> tuple[float, float]:
    """(forward, backward) seconds torch's ring attention adds to a unit's ``L`` attention
    layers on one rank of ``tokens`` tokens (``b s / C``), beside the attention blocks
    themselves (module docstring): per layer and pass, the K/V all-gather (``C - 1`` chunks
    received, one ring collective's latency, ``Topology.ring_s``) behind the local block
    (``1 / C`` of the layer's attention, ``attention_*_s / L``); in backward also the fp32 K/V
    gradients' ring, ``C - 1`` steps each behind one block and the last exposed; and the merges
    (:data:`RING_MERGE_BYTES`) at ``memory_bytes_per_s``. Overlaps priced by
    ``topology.hidden_cost_s``. ``method="all_gather"``: the all-gather exposed in forward,
    the K/V gradients' reduce-scatter (the same bytes, the parameters' dtype) in backward,
    nothing else. ``method="ring_compiled"``: the ring traced into a ``torch.compile`` graph,
    where torch's functional collectives wait at once (``_maybe_wrap_tensor``: under tracing
    ``wait_tensor`` follows the collective; inductor moves it only with
    ``reorder_for_compute_comm_overlap``, off by default): every exchange exposed, the merges
    fused (:data:`RING_MERGE_BYTES_COMPILED`)."""
    step_bw, step_lat = topology.step_link(tp, cp)
    layers = u.attention_layers
    e_q = tokens * u.attention_heads * u.attention_head_dim
    e_kv = tokens * u.attention_kv_heads * (u.attention_head_dim + u.attention_value_head_dim)
    gather = topology.ring_s(cp * e_kv * size, tp, cp)
    grad_step = e_kv * RING_GRAD_BYTES / step_bw + step_lat
    if method == "all_gather":
        return layers * gather, layers * gather
    block_f = attention_f_s / layers / cp
    block_b = attention_b_s / layers / cp

    def merges(once: str, step: str) -> float:
        if memory_bytes_per_s <= 0:
            return 0.0
        table = RING_MERGE_BYTES_COMPILED if method == "ring_compiled" else RING_MERGE_BYTES
        (q1, kv1), (qs, kvs) = table[once], table[step]
        return (q1 * e_q + kv1 * e_kv + (cp - 1) * (qs * e_q + kvs * e_kv)) / memory_bytes_per_s

    if method == "ring_compiled":
        # each collective waited right after it is issued: the gather in both passes and
        # every one of the C fp32 K/V gradient steps outside the attention blocks
        fwd = gather + merges("forward_once", "forward_step")
        bwd = gather + cp * grad_step + merges("backward_once", "backward_step")
        return layers * fwd, layers * bwd
    fwd = topology.hidden_cost_s(gather, block_f) + merges("forward_once", "forward_step")
    bwd = (
        topology.hidden_cost_s(gather, block_b)
        + (cp - 1) * topology.hidden_cost_s(grad_step, block_b)
        + grad_step
        + merges("backward_once", "backward_step")
    )
    return layers * fwd, layers * bwd


def _unit(
    u: UnitProfile,
    profile: Profile,
    cp: int,
    ep: int,
    tp: int,
    imbalance: float,
    topology: Topology,
    memory_bytes_per_s: float,
    method: str = "ring",
) -> UnitProfile:
    """``u`` on one rank of a CP group of ``cp`` and an EP group of ``ep`` (before TP);
    ``memory_bytes_per_s``: the device's sustained memory bandwidth for the ring's merges (0:
    unknown device, merges not priced)."""
    b, s = profile.batch_size, profile.sequence_length
    size = max(int(profile.bytes_per_parameter), 1)
    attn, exp, whole = _flops(u, b, s) if s > 0 else (0.0, 0.0, 1.0)
    f_att = min(attn / whole, 1.0) if whole > 0 else 0.0
    f_exp = min(exp / whole, 1.0 - f_att) if whole > 0 else 0.0
    # the busiest rank's expert work: `imbalance` x the average share
    factor = (1.0 + f_exp * (imbalance - 1.0) if ep > 1 else 1.0) / cp

    def size_part(total: float, overhead: float) -> float:
        return total - min(max(overhead, 0.0), total)

    fwd_size = size_part(u.forward_s, u.forward_overhead_s)
    bwd_size = size_part(u.backward_s, u.backward_overhead_s)
    ring_f = ring_b = 0.0
    if cp > 1 and u.attention_layers and s > 0:
        ring_f, ring_b = _ring_s(
            u, b * s / cp, cp, size, tp, topology, memory_bytes_per_s,
            fwd_size * f_att / cp, bwd_size * f_att / cp, method,
        )  # fmt: skip
    a2a = 0.0
    if ep > 1 and u.moe_layers and s > 0:
        sent = b * (s / cp) * u.moe_top_k * u.moe_hidden_size * size * (ep - 1) / ep
        # dispatch + combine
        a2a = u.moe_layers * 2 * topology.all_to_all_s(imbalance * sent, tp, ep)
    fwd = u.forward_s - fwd_size + fwd_size * factor + ring_f + a2a
    bwd = u.backward_s - bwd_size + bwd_size * factor + ring_b + a2a
    split = u.backward_input_s + u.backward_weight_s
    b_in = b_wt = 0.0
    if split > 0:
        in_size = size_part(u.backward_input_s, u.backward_input_overhead_s)
        wt_size = size_part(u.backward_weight_s, u.backward_weight_overhead_s)
        # the exchanges carry the input gradient: they belong to B, not W
        b_in = u.backward_input_s - in_size + in_size * factor + ring_b + a2a
        b_wt = u.backward_weight_s - wt_size + wt_size * factor
    phi = u.tp_compute_fraction
    if u.tp_parameter_count > 0 and fwd_size > 0:
        # TP splits its share of the dense work; the experts' tokens and the exchanges are
        # split over the TP ranks too (sequence parallelism), so only the unsplit dense rest
        # stays whole on every TP rank
        dense = max(u.parameter_count - u.moe_expert_parameter_count, 1)
        phi_dense = min(u.tp_parameter_count / dense, 1.0) if u.moe_layers else phi
        rest = (1.0 - phi_dense) * (1.0 - f_exp) * fwd_size / cp
        phi = min(max(1.0 - rest / max(fwd - u.forward_overhead_s, 1e-300), 0.0), 1.0)
    experts = u.moe_expert_parameter_count * size * (1.0 - 1.0 / ep) if ep > 1 else 0.0
    return replaced(
        u,
        forward_s=fwd,
        backward_s=bwd,
        backward_input_s=b_in,
        backward_weight_s=b_wt,
        tp_compute_fraction=phi,
        # per token (FP8 casts): each CP rank re-runs its 1/cp of the sequence
        full_recompute_extra_s=u.full_recompute_extra_s / cp,
        # TP splits each expert's FFN (Megatron-style): one more region per MoE layer, its
        # tokens all-gathered before the experts and reduce-scattered after, as a dense MLP's
        tp_collective_bytes=(u.tp_collective_bytes + u.moe_layers * u.output_bytes) // cp,
        tp_rowwise_output_bytes=(u.tp_rowwise_output_bytes + u.moe_layers * u.output_bytes) // cp,
        selective_recompute_gather_bytes=u.selective_recompute_gather_bytes // cp,
        tp_gathered_output_bytes=u.tp_gathered_output_bytes // cp,
        tp_gathered_input_bytes=u.tp_gathered_input_bytes // cp,
        parameter_bytes=int(math.ceil(max(u.parameter_bytes - experts, 0.0))),
        # this rank's routed experts, which TP then splits (mesh_costs)
        moe_expert_parameter_count=u.moe_expert_parameter_count // ep,
        activation_bytes=u.activation_bytes // cp,
        output_bytes=u.output_bytes // cp,
        peak_bytes=u.peak_bytes // cp,
    )


def context_expert_profile(
    profile: Profile,
    cp: int,
    ep: int,
    tp: int,
    topology: Topology,
    imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE,
    method: str = "ring",
) -> Profile:
    """The Profile of one rank of a ``cp``-way CP group and an ``ep``-way EP group, before
    tensor parallelism over ``tp`` (which only decides the links the CP and EP groups cross);
    the profile itself when C = E = 1 and the model has no MoE layer. ``method``: how CP's attention
    exchanges keys and values (``ring`` or ``all_gather``, ``PlanRequest.context_parallel_method``).
    See the module docstring. O(units)."""
    moe = any(u.moe_layers for u in profile.units)
    if cp <= 1 and ep <= 1 and not moe:
        return profile
    memory = 0.0
    if is_catalog_device(profile.device):
        spec = get_device(profile.device)
        memory = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    units = [
        _unit(u, profile, cp, ep, tp, imbalance, topology, memory, method) for u in profile.units
    ]
    out = dataclasses.replace(
        profile,
        units=units,
        cut_bytes=[c // cp for c in profile.cut_bytes],
        input_bytes=profile.input_bytes // cp,
        meta=dict(profile.meta),
    )
    out.meta["mesh_context_expert"] = {"context_parallel": cp, "expert_parallel": ep}
    return out


def expert_data_parallel(fsdp: int, ep: int) -> int:
    """The ranks holding the same expert shards, over which their gradients are summed and
    (ZeRO-1) their optimizer state sharded: the ``fsdp / E`` same-position ranks of the
    ``fsdp / E`` EP groups of a gradient group of ``fsdp`` (``dp x cp``) ranks (autopipe's
    ``expert_mesh`` ``dp_between_ep``, Megatron's expert data-parallel group); 1 when E
    spans the whole group (E = D: no other rank holds them)."""
    return max(fsdp // max(ep, 1), 1)


def expert_device_bytes(u: UnitProfile, tp: int, size: int) -> float:
    """Bytes of ``u``'s routed-expert parameters on one device: the unit of a context/expert
    profile (:func:`context_expert_profile`, its ``moe_expert_parameter_count`` already this
    EP rank's share) split over ``tp`` TP ranks as
    :func:`autopipe.planner.mesh_costs.unit_device_parameter_bytes` splits it."""
    if u.moe_expert_parameter_count <= 0:
        return 0.0
    whole = u.parameter_bytes if u.parameter_bytes > 0 else u.parameter_count * size
    return min(u.moe_expert_parameter_count * size, whole) / max(tp, 1)


def with_expert_state(
    device: Profile,
    tp: int,
    ep: int,
    shard: str,
    fsdp: int,
    state_bytes_per_parameter: float,
    reshard_after_forward: bool = True,
) -> Profile:
    """``device`` (one device's profile, state priced at ``shard`` over ``fsdp`` ranks per
    parameter) with the state its expert shards hold beyond that, per unit, in
    ``extra_state_bytes`` (read by :class:`autopipe.planner.costs.CostModel`): what the
    runtime runs (runtime/distributed/expert_parallel.py, docs/cost-model.md):

    - ``optimizer`` (ZeRO-1, ``ExpertZeroOptimizer``): a rank's expert shards keep their
      parameters and gradients whole and their optimizer state sharded over the
      :func:`expert_data_parallel` ranks holding the same experts, not over all ``fsdp``:
      ``1 / D`` of the stage's experts' state, as Megatron's distributed optimizer;
    - ``gradients`` / ``parameters`` (FSDP2): ``fully_shard`` leaves the expert shards alone
      (``ignored_params``): their parameters, gradients and optimizer state stay whole;
    - ``none``: as priced already.

    ``device`` itself when E = 1 or nothing differs. O(units)."""
    if ep <= 1 or fsdp <= 1 or shard == "none":
        return device
    size = max(int(device.bytes_per_parameter), 1)
    priced = sharded_state_bytes_per_parameter(
        state_bytes_per_parameter, size, shard, fsdp, reshard_after_forward
    )
    if shard == "optimizer":
        runs = sharded_state_bytes_per_parameter(
            state_bytes_per_parameter, size, shard, expert_data_parallel(fsdp, ep)
        )
    else:
        runs = state_bytes_per_parameter
    per_byte = (runs - priced) / size
    extra = [expert_device_bytes(u, tp, size) * per_byte for u in device.units]
    if not any(extra):
        return device
    return dataclasses.replace(device, extra_state_bytes=extra)


def _degree(
    name: str, flag: str, value: int | str, allowed: list[int], n: int, why: str
) -> list[int]:
    """The degrees to weigh for ``value`` (``auto`` or a fixed one), one line if refused."""
    if value == "auto":
        return [1] + [d for d in allowed if n % d == 0]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RuleViolation(f"{flag}: {value!r} must be 'auto' or a positive integer")
    if value > 1 and value not in allowed:
        ok = ", ".join(map(str, [d for d in allowed if n % d == 0][:12])) or "none"
        raise RuleViolation(f"{flag}: {name}={value} {why}; {name} > 1 it allows: {ok}")
    if n % value:
        raise RuleViolation(f"{flag}: {name}={value} does not divide the {n} GPUs")
    return [value]


def context_expert_choices(
    profile: Profile, n: int, context_parallel: int | str, expert_parallel: int | str
) -> tuple[list[int], list[int]]:
    """The C and E a request allows on ``n`` devices (``auto``: 1 and every degree the model
    allows, :func:`context_parallel_degrees`, :func:`expert_parallel_degrees`); a fixed one the
    model cannot take is refused (``RuleViolation``, one line)."""
    s = profile.sequence_length
    cp_why = (
        "needs a model with attention and a recorded sequence length (re-profile it)"
        if not s
        else f"must divide half the sequence ({s} tokens: 2 C load-balanced chunks)"
    )
    allowed = context_parallel_degrees(profile)
    if context_parallel == "auto":
        allowed = [c for c in allowed if s // (2 * c) >= MIN_AUTO_CHUNK_TOKENS]
    cps = _degree("C", "context-parallel", context_parallel, allowed, n, cp_why)
    experts = sorted({u.moe_experts for u in profile.units if u.moe_layers})
    ep_why = (
        f"must divide the {experts[0]} routed experts of each MoE layer"
        if experts
        else "needs a mixture-of-experts model (no MoE layer is recorded)"
    )
    eps = _degree(
        "E", "expert-parallel", expert_parallel, expert_parallel_degrees(profile), n, ep_why
    )
    return cps, eps
