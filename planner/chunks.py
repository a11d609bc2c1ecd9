"""A candidate's model chunks: the cost model over ``K x V`` chunks on their ranks, the work
each chunk gives the simulator, and a proven lower bound on the iteration time. Torch-free.

The planner cuts the model into ``K x V`` contiguous chunks placed as torch places them
(:func:`autopipe.core.schedule_rules.chunk_ranks`). For the partitioners, chunk ``c`` is a
"stage" on its rank's device (speed, memory, link), so the exact min-bottleneck search of
``planner/probe.py`` and ``planner/partition.py`` works over chunks unchanged:

- a chunk's micro-batches in flight (and, checkpointed, those holding re-computed
  activations) are the schedule's own, replayed from its order
  (:func:`autopipe.planner.simulate.inflight_counts`);
- a chunk whose successor runs on the same rank (the V-shape's turn at the last rank) sends
  nothing; a chunk sending to another rank uses that pair's link (the sender's link to the
  next device; going back up the V, the receiver's);
- with V > 1 the ranks' memory is shared by their chunks: the per-chunk limit is the rank's
  whole memory (then the rank's replayed peak decides), or ``1 / V`` of it (a separable
  bound: chunks that fit it always fit together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from autopipe.planner.costs import UNIT, CostModel, SegmentCost
from autopipe.planner.simulate import ChunkWork, _allocates, _frees, inflight_counts

from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_orders
from autopipe.core.timeline import Action
from autopipe.core.vocabulary import SPLIT_BACKWARD_SCHEDULES

__all__ = ["ScheduleShape", "chunk_cluster", "chunk_works", "lower_bound_s", "rank_fits"]


@dataclass
class ScheduleShape:
    """What a (schedule, K, V, M) fixes before any partition: where chunks run, each rank's
    order, and each chunk's micro-batches in flight. The orders (O(K V M) actions) are built
    on first use only: most candidates of a mesh search are priced by their in-flight counts
    and lower bound and never simulated (GPipe's and 1F1B's counts have closed forms)."""

    schedule: str
    num_ranks: int
    virtual_stages: int
    microbatches: int
    ranks: list[int]
    held: list[int]
    """Per chunk: most micro-batches holding its activations (or checkpointed inputs)."""
    full: list[int]
    """Per chunk: most micro-batches holding re-computed activations when checkpointed."""
    _orders: list[list[Action]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls, schedule: str, num_ranks: int, virtual_stages: int, microbatches: int
    ) -> ScheduleShape:
        """O(K V) for GPipe and 1F1B (closed-form in-flight counts, orders built when first
        read), else O(K V M): the orders are generated once here and reused by every
        simulation (and, per (schedule, K, V, M), by every later call: the mesh search asks
        for the same shapes mesh after mesh; each call gets its own lists)."""
        ranks = chunk_ranks(schedule, num_ranks, virtual_stages)
        m = microbatches
        if schedule == "gpipe" and virtual_stages == 1:
            held, full = [m] * num_ranks, [1] * num_ranks  # every forward before any backward
            return cls(schedule, num_ranks, virtual_stages, m, ranks, held, full)
        if schedule == "1f1b" and virtual_stages == 1:
            # K - s - 1 warm-up forwards, then one forward and one backward at a time
            held = [min(num_ranks - s, m) for s in range(num_ranks)]
            return cls(schedule, num_ranks, virtual_stages, m, ranks, held, [1] * num_ranks)
        orders, held_t, full_t = _orders_of(schedule, num_ranks, virtual_stages, m)
        out = cls(schedule, num_ranks, virtual_stages, m, ranks, list(held_t), list(full_t))
        out._orders = [list(o) for o in orders]
        return out

    @property
    def orders(self) -> list[list[Action]]:
        """Each rank's actions (:func:`autopipe.core.schedules.rank_orders`); this shape's
        own lists, built (or copied from the cache) on first read."""
        if self._orders is None:
            orders, _, _ = _orders_of(
                self.schedule, self.num_ranks, self.virtual_stages, self.microbatches
            )
            self._orders = [list(o) for o in orders]
        return self._orders

    @property
    def num_chunks(self) -> int:
        return len(self.ranks)

    @property
    def split_backward(self) -> bool:
        return self.schedule in SPLIT_BACKWARD_SCHEDULES


_MAX_SHAPES = 1024
_SHAPES: dict[
    tuple[str, int, int, int],
    tuple[tuple[tuple[Action, ...], ...], tuple[int, ...], tuple[int, ...]],
] = {}
"""ScheduleShape.of's results by (schedule, K, V, M): orders are pure functions of these."""


def _orders_of(
    schedule: str, num_ranks: int, virtual_stages: int, microbatches: int
) -> tuple[tuple[tuple[Action, ...], ...], tuple[int, ...], tuple[int, ...]]:
    """The ranks' orders and the in-flight counts replayed from them (``full`` at least 1),
    built once per (schedule, K, V, M). O(K V M) the first time."""
    key = (schedule, num_ranks, virtual_stages, microbatches)
    hit = _SHAPES.get(key)
    if hit is None:
        orders = rank_orders(schedule, num_ranks, virtual_stages, microbatches)
        held, full = inflight_counts(orders, num_ranks * virtual_stages)
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        hit = _SHAPES[key] = (
            tuple(tuple(o) for o in orders),
            tuple(held),
            tuple(max(f, 1) for f in full),
        )
    return hit


def chunk_cluster(cluster: Cluster, shape: ScheduleShape, memory_share: float = 1.0) -> Cluster:
    """One "device" per chunk for the partitioners: its rank's device with ``memory_share``
    of its memory and the link its output crosses (none when the next chunk is on the same
    rank). O(K V)."""
    devices: list[Device] = []
    ranks = shape.ranks
    for c, r in enumerate(ranks):
        d = cluster.devices[r]
        memory = d.memory_bytes
        if memory is not None and memory_share != 1.0:
            memory = int(memory * memory_share)
        bandwidth, latency = d.link_bandwidth_bytes_per_s, d.link_latency_s
        if c + 1 < len(ranks):
            nxt = ranks[c + 1]
            if nxt == r:
                bandwidth, latency = math.inf, 0.0
            elif nxt == r - 1:  # going back up the V: the link between r - 1 and r
                back = cluster.devices[nxt]
                bandwidth, latency = back.link_bandwidth_bytes_per_s, back.link_latency_s
        devices.append(
            Device(
                name=d.name,
                memory_bytes=memory,
                speed=d.speed,
                link_bandwidth_bytes_per_s=bandwidth,
                link_latency_s=latency,
            )
        )
    return Cluster(devices, cluster.host_throughput)


def splits_backward(profile: Profile, i: int, j: int, index: int, checkpoint: bool) -> bool:
    """Whether chunk ``index`` (units ``i..j-1``) runs its backward as B then W under a
    zero-bubble schedule, as the plan records it (``StagePlan.split_backward``) and the
    runtime runs it: not when re-materialized (one recomputation in B rather than one per
    parameter group in W) or :func:`runs_unsplit`. The first chunk is torch's own (its whole
    backward in W, no input gradient to send): recorded as split."""
    return index == 0 or not (checkpoint or runs_unsplit(profile, i, j))


def runs_unsplit(profile: Profile, i: int, j: int) -> bool:
    """Whether the chunk of units ``i..j-1`` runs its backward unsplit under a zero-bubble
    schedule: one of its units could not be split (``UnitProfile.backward_unsplit``), or two
    of its units hold one parameter (``shared_parameters``: calls of one shared layer, a tied
    weight), which torch's split weight pass cannot take (``autopipe.profiler.weight_pass``).
    O(units of the chunk x their shared parameters)."""
    seen: set[str] = set()
    for unit in profile.units[i:j]:
        if unit.backward_unsplit:
            return True
        names = set(unit.shared_parameters)
        if names & seen:
            return True
        seen |= names
    return False


def chunk_works(
    cm: CostModel, bounds: list[int], costs: list[SegmentCost], split: bool
) -> list[ChunkWork]:
    """What each chunk of ``bounds`` (with its ``costs``) gives the simulator; the
    backward split (``backward_input_share``) where ``split``. O(K V).

    As the runtime runs them (``runtime/distributed/zero_bubble.py``): a re-materialized
    chunk runs its whole backward in B (one recomputation; torch's split weight pass would
    recompute once per parameter group), so its W is empty; torch runs the first chunk's
    whole backward in W (it has no input gradient to send, ``PipelineStage.is_first``), so
    its B is empty. A chunk that uses a parameter more than once (:func:`runs_unsplit`)
    runs its whole backward in B too, as the runtime runs it. A chunk re-materialized per
    unit keeps every unit's input and re-computes its largest unit's activations at most at
    once (``ChunkWork.input_bytes`` / ``activation_bytes``)."""
    works = []
    for c, cost in enumerate(costs):
        i, j = bounds[c], bounds[c + 1]
        inp = wgt = 0.0
        if split and cost.checkpoint:
            inp = cost.backward_s
        elif split and c == 0:
            wgt = cost.backward_s
        elif split and runs_unsplit(cm.profile, i, j):
            inp = cost.backward_s
        elif split:
            # B + W of the chunk run split, over the whole backward's cost (its per-call
            # overhead and the micro-batch scaling included).
            whole = float(cm.bwd_prefix[j] - cm.bwd_prefix[i])
            ratio = float(cm.bwd_split_prefix[j] - cm.bwd_split_prefix[i]) / whole if whole else 1
            share = float(cm.bwd_input_prefix[j] - cm.bwd_input_prefix[i]) / (
                float(cm.bwd_split_prefix[j] - cm.bwd_split_prefix[i]) or 1.0
            )
            # Prefix-sum differences round apart: a chunk with no weight gradient gave a
            # share of 1 + 1 ulp and W = -1.7e-18 s, which the plan's own loader refuses.
            inp = cost.backward_s * ratio * min(share, 1.0)
            wgt = max(cost.backward_s * ratio - inp, 0.0)
        activation = float(cm.act_prefix[j] - cm.act_prefix[i]) * cm.ratio
        kept = float(cm.cut_bytes_at[i]) * cm.ratio
        if cost.checkpoint and cost.checkpoint_granularity == UNIT:
            # one unit re-computed at a time; every unit's input kept until then
            activation = float(cm.unit_activation_max(i, j)) * cm.ratio
            kept = float(cm.unit_input_prefix[j] - cm.unit_input_prefix[i]) * cm.ratio
        works.append(
            ChunkWork(
                forward_s=cost.forward_s,
                backward_s=cost.backward_s,
                backward_input_s=inp,
                backward_weight_s=wgt,
                recompute_s=cost.recompute_s,
                send_s=cost.send_s,
                activation_bytes=activation,
                input_bytes=kept,
                checkpoint=cost.checkpoint,
                state_bytes=float(cost.parameter_bytes + cost.optimizer_bytes),
            )
        )
    return works


def rank_fits(
    works: list[ChunkWork], shape: ScheduleShape, cluster: Cluster, headroom: float
) -> tuple[bool, list[float]]:
    """Whether every rank's replayed peak (headroom included) fits its memory, and the
    peaks (bytes, headroom not included). O(T)."""
    peaks = replay_peaks(shape, works)
    ok = all(
        d.memory_bytes is None or p * (1.0 + headroom) <= d.memory_bytes
        for p, d in zip(peaks, cluster.devices, strict=True)
    )
    return ok, peaks


_PHASES = ("forward", "backward", "backward_input", "backward_weight")
_ACTIONS: dict[tuple[str, int, int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
"""Per (schedule, K, V, M): each rank's actions as (chunk, phase index) arrays."""


def replay_peaks(shape: ScheduleShape, works: list[ChunkWork]) -> list[float]:
    """:func:`autopipe.planner.simulate.replay_memory` of the shape's orders, vectorised: the
    same additions in the same order (a sequential cumulative sum), so the same floats.
    O(T) numpy work; the orders' arrays are built once per (schedule, K, V, M)."""
    key = (shape.schedule, shape.num_ranks, shape.virtual_stages, shape.microbatches)
    arrays = _ACTIONS.get(key)
    if arrays is None:
        index = {p: i for i, p in enumerate(_PHASES)}
        arrays = [
            (
                np.array([a.stage for a in order], dtype=np.int64),
                np.array([index[a.phase] for a in order], dtype=np.int64),
            )
            for order in shape.orders
        ]
        if len(_ACTIONS) >= _MAX_SHAPES:
            _ACTIONS.clear()
        _ACTIONS[key] = arrays
    # what each (chunk, phase) allocates at its start and frees at its end (simulate.py)
    alloc = np.array([[_allocates(w, p) for p in _PHASES] for w in works], dtype=float)
    free = np.array([[_frees(w, p) for p in _PHASES] for w in works], dtype=float)
    peaks = []
    for r, (stage, phase) in enumerate(arrays):
        now = sum(w.state_bytes for c, w in enumerate(works) if shape.ranks[c] == r)
        steps = np.empty(2 * stage.size + 1)
        steps[0] = now
        steps[1::2] = alloc[stage, phase]
        steps[2::2] = -free[stage, phase]
        running = np.cumsum(steps)
        peaks.append(max(now, float(running[1::2].max(initial=now))))
    return peaks


def lower_bound_s(cm: CostModel, shape: ScheduleShape, cluster: Cluster) -> float:
    """A proven lower bound on the iteration time of *any* cut of the model into
    ``K x V`` chunks under this schedule, M and micro-batch size (docs/cost-model.md):

    - work: every rank runs all its chunks' forwards and backwards for M micro-batches, and
      the ranks share the whole model's work, so some rank is busy at least
      ``M x sum_u (F_u + G_u) / sum_r v_r``;
    - the heaviest unit: its rank runs it M times, ``M x max_u (F_u + G_u) / v_max``;
    - one micro-batch's critical path: micro-batch 0 goes forward through every unit and
      its input gradient back through every unit, one after the other,
      ``sum_u (F_u + B_u) / v_max`` (B_u = the input-gradient part with a split backward,
      else the whole backward).

    Re-computation and sends only add time, so leaving them out keeps it a bound. O(N + K).
    """
    m = shape.microbatches
    speeds = np.array([d.speed for d in cluster.devices], float)
    unit = np.diff(cm.fwd_prefix + cm.bwd_prefix)
    work = float(cm.fwd_prefix[-1] + cm.bwd_prefix[-1])
    back = cm.bwd_input_prefix if shape.split_backward else cm.bwd_prefix
    path = float(cm.fwd_prefix[-1] + back[-1])
    v_max = float(speeds.max())
    return max(
        m * work / float(speeds.sum()),
        m * float(unit.max(initial=0.0)) / v_max,
        path / v_max,
    )


def cost_model_for(
    profile: Profile,
    cluster: Cluster,
    shape: ScheduleShape,
    *,
    batch_size: int,
    checkpoint: str,
    state_bytes_per_parameter: float,
    headroom: float,
    memory_share: float = 1.0,
) -> CostModel:
    """The cost model over the shape's chunks (see the module docstring). O(N + K V)."""
    return CostModel(
        profile,
        chunk_cluster(cluster, shape, memory_share) if shape.virtual_stages > 1 else cluster,
        batch_size=batch_size,
        microbatches=shape.microbatches,
        schedule=shape.schedule,
        checkpoint=checkpoint,
        state_bytes_per_parameter=state_bytes_per_parameter,
        headroom=headroom,
        inflight=shape.held,
        full_inflight=shape.full,
    )


def checkpointed(cost: SegmentCost) -> SegmentCost:
    """``cost`` with re-materialization switched on (the recompute is one more forward)."""
    return replace(cost, checkpoint=True, recompute_s=cost.forward_s)
