"""The cost and memory model: what a contiguous segment of units costs on one stage.

Torch-free. Every formula here is written out in docs/cost-model.md. Positions are unit
boundaries ``0..N``: the segment ``[i, j)`` holds units ``i..j-1``; position ``p`` (``0 < p < N``)
is the cut between unit ``p-1`` and unit ``p``; position 0 is the model input.

Two memory/time options exist for a segment: ``A`` (keep activations) and ``B`` (checkpointed:
recompute the forward in backward). ``B`` is re-materialized at one of two granularities,
whichever needs less memory (the time is the same, one extra forward):

- per stage: keep only the stage's input; the backward re-computes the whole stage, so all of
  its activations are live at once;
- per unit (torchtitan's ``mode = "full"``, Megatron's ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1``): keep every unit's input; the
  backward re-computes one unit at a time, so only the largest unit's activations are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopipe.core.cluster import Cluster
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.vocabulary import CHECKPOINT_GRANULARITIES

STAGE, UNIT = CHECKPOINT_GRANULARITIES


def backward_input_share(unit: UnitProfile) -> float:
    """The share of ``unit``'s backward that computes its input gradient (the zero-bubble
    schedules' B; the rest, ``1 - share``, is the weight gradient W). O(1).

    The profile's split where it has one (``backward_input_s`` / ``backward_weight_s``,
    measured or counted); else the stated default (docs/cost-model.md): a unit without
    parameters has no weight gradient (share 1), and a unit with parameters splits half and
    half, which is Qi et al.'s assumption for transformer layers (each parameter matmul
    ``Y = X W`` costs one matmul for ``dX`` and one for ``dW``). Applied to the whole backward
    (its per-call overhead too), so B + W is always the unit's backward.
    """
    measured = unit.backward_input_s + unit.backward_weight_s
    if measured > 0:
        return unit.backward_input_s / measured
    if unit.parameter_count <= 0 and unit.parameter_bytes <= 0:
        return 1.0
    return 0.5


def backward_split_factor(unit: UnitProfile) -> float:
    """How much longer ``unit``'s backward takes split into B and W than whole: the measured
    ``(backward_input_s + backward_weight_s) / backward_s`` (at least 1), else 1. O(1).

    Run split, B keeps the graph and W walks it again from where the parameters' paths meet
    the inputs' (``torch.distributed.pipelining``'s ``stage_backward_input`` and
    ``stage_backward_weight``), so the two passes cost more than one; counted profiles split
    the FLOPs exactly (factor 1)."""
    measured = unit.backward_input_s + unit.backward_weight_s
    if measured <= 0 or unit.backward_s <= 0:
        return 1.0
    return max(measured / unit.backward_s, 1.0)


def _scaled_s(
    units: Sequence[UnitProfile], total: str, overhead: str, b: float, bp: int
) -> np.ndarray:
    """Each unit's ``total`` seconds (measured at batch ``bp``) at micro-batch ``b``; its
    ``overhead`` seconds are paid once per call, whatever the batch."""
    t = np.array([getattr(x, total) for x in units], float)
    a = np.clip(np.array([getattr(x, overhead) for x in units], float), 0.0, t)
    return a + (t - a) * (b / bp)


def _split_backward_s(
    units: Sequence[UnitProfile], bwd: np.ndarray, b: float, bp: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each unit's backward run split (B + W seconds) at micro-batch ``b``, and B's share."""
    share = np.array([backward_input_share(x) for x in units], float)
    split = bwd * np.array([backward_split_factor(x) for x in units], float)
    # A split measured at several sizes scales B and W each by its own fit.
    fitted = np.array([x.split_fitted for x in units], bool)
    if fitted.any():
        b_in = _scaled_s(units, "backward_input_s", "backward_input_overhead_s", b, bp)
        b_wt = _scaled_s(units, "backward_weight_s", "backward_weight_overhead_s", b, bp)
        both = b_in + b_wt
        safe = np.where(both > 0, both, 1.0)
        # Never below the whole backward: B + W cannot beat the one pass.
        split = np.where(fitted, np.maximum(both, bwd), split)
        share = np.where(fitted, b_in / safe, share)
    return split, share


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes per device of a stage holding one segment (or many: numpy arrays; or
    linear expressions: the ILP's rows), headroom not included, as the steady-state
    in-flight counts give it (docs/cost-model.md). The one formula for a stage's memory:
    :meth:`CostModel.segment`, :meth:`CostModel.segment_memory_need`,
    :meth:`CostModel.cost_matrix` / :meth:`CostModel.segment_times`, the prober
    (``planner/probe.py``) and the ILP (``planner/ilp.py``) all price memory through
    :func:`stage_memory`. (The schedule's replay over time, ``simulate.replay_memory``, is a
    different quantity: each rank's peak over its actions in order, from the same per
    micro-batch bytes; ``planner/mesh.py``'s gather buffers are reserved beside it.)

    Inputs, each at the micro-batch size: ``state_bytes`` (parameters, gradients, optimizer
    state), ``activation_bytes`` (one micro-batch's activations of the whole segment),
    ``input_bytes`` (the segment's input cut), ``unit_inputs_bytes`` (every unit's input),
    ``largest_unit_bytes`` (the largest unit's activations, or a function giving them, called
    only when :attr:`per_unit_bytes` is read); ``inflight`` micro-batches hold
    activations at once, ``full_inflight`` hold re-computed (full) ones."""

    state_bytes: Any
    activation_bytes: Any
    input_bytes: Any
    unit_inputs_bytes: Any
    largest_unit_bytes: Any
    inflight: Any
    full_inflight: Any

    @property
    def kept_bytes(self) -> Any:
        """Activations without re-materialization: every in-flight micro-batch's."""
        return self.activation_bytes * self.inflight

    @property
    def per_stage_bytes(self) -> Any:
        """Re-materialized per stage: the full activations of the micro-batches re-computing,
        plus the stage input of every in-flight one."""
        return self.activation_bytes * self.full_inflight + self.input_bytes * self.inflight

    @property
    def per_unit_bytes(self) -> Any:
        """Re-materialized per unit: the largest unit's activations of the micro-batches
        re-computing, plus every unit's input of every in-flight one."""
        largest = self.largest_unit_bytes
        if callable(largest):  # deferred: a range-maximum query only when this is read
            largest = largest()
        return largest * self.full_inflight + self.unit_inputs_bytes * self.inflight


def stage_memory(
    state_bytes: Any,
    activation_bytes: Any,
    input_bytes: Any,
    unit_inputs_bytes: Any,
    largest_unit_bytes: Any,
    inflight: Any,
    full_inflight: Any,
) -> StageMemory:
    """A stage's peak memory per device under each re-materialization option
    (:class:`StageMemory`; its arguments). O(1) per segment; lazy: only the options read
    are computed."""
    return StageMemory(
        state_bytes,
        activation_bytes,
        input_bytes,
        unit_inputs_bytes,
        largest_unit_bytes,
        inflight,
        full_inflight,
    )


@dataclass
class SegmentCost:
    """Per-micro-batch seconds and bytes of one segment on one stage (option already chosen)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    send_s: float
    parameter_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    checkpoint: bool
    feasible: bool
    memory_without_checkpoint_bytes: int
    """Memory the segment would need without checkpointing (for the Plan's notes)."""
    checkpoint_granularity: str = STAGE
    """When ``checkpoint``: ``"stage"`` (keep the stage input, re-compute the whole stage)
    or ``"unit"`` (keep each unit's input, re-compute one unit at a time), whichever needs
    less memory (``"stage"`` on a tie)."""

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.send_s

    @property
    def memory_bytes(self) -> int:
        return self.parameter_bytes + self.optimizer_bytes + self.activation_bytes


_DENSE_MAX_UNITS = 256
"""Up to this many units :meth:`CostModel.unit_activation_max` reads the cached
``(N+1)^2`` matrix (256 KiB at most at N=256; the sparse table beyond)."""


class CostModel:
    """Segment costs for one (profile, cluster, batch, M, schedule, checkpoint mode).

    Construction is O(N + K); ``segment`` is O(1); ``cost_matrix`` is O(N^2) numpy work.
    """

    def __init__(
        self,
        profile: Profile,
        cluster: Cluster,
        *,
        batch_size: int,
        microbatches: int,
        schedule: str,
        checkpoint: str,
        state_bytes_per_parameter: float,
        headroom: float,
        inflight: Sequence[float] | None = None,
        full_inflight: Sequence[float] | None = None,
    ) -> None:
        n = len(profile.units)
        k = len(cluster)
        self.profile = profile
        self.cluster = cluster
        self.n_units = n
        self.num_stages = k
        self.batch_size = batch_size
        self.microbatches = microbatches
        self.schedule = schedule
        self.checkpoint_mode = checkpoint
        self.headroom = headroom
        b = batch_size / microbatches
        self.microbatch_size = b
        # Activations and cut tensors scale linearly with the samples they hold.
        self.ratio = b / profile.batch_size
        self._init_units(profile, state_bytes_per_parameter)
        self._init_devices(cluster)
        self._init_inflight(inflight, full_inflight)
        self.options = [self._options(s) for s in range(k)]
        self._cache: dict = {}

    def _init_units(self, profile: Profile, state_bytes_per_parameter: float) -> None:
        """The units' prefix sums at the micro-batch size: seconds, parameter, activation
        and cut bytes (activations and cuts at the profile batch size; ``ratio`` scales them)."""
        u = profile.units
        b, bp = self.microbatch_size, profile.batch_size
        fwd = _scaled_s(u, "forward_s", "forward_overhead_s", b, bp)
        bwd = _scaled_s(u, "backward_s", "backward_overhead_s", b, bp)
        pbytes = max(int(profile.bytes_per_parameter), 1)
        param = np.array(
            [x.parameter_bytes if x.parameter_bytes > 0 else x.parameter_count * pbytes for x in u],
            float,
        )
        act = np.array([x.activation_bytes for x in u], float)
        zero = np.zeros(1)
        self.fwd_prefix = np.concatenate([zero, np.cumsum(fwd)])
        # a checkpointed unit's re-run: its forward, plus what it does beyond (or, fused with
        # the backward, less than) the forward (UnitProfile.full_recompute_extra_s; 0 for most
        # profiles, and then this is fwd_prefix bit for bit)
        extra = np.array([x.full_recompute_extra_s for x in u], float) * (b / bp)
        self.rec_prefix = np.concatenate([zero, np.cumsum(np.maximum(fwd + extra, 0.0))])
        """Prefix sums of each unit's re-computation under checkpointing (seconds per
        micro-batch): ``forward_s`` plus ``full_recompute_extra_s``, both at the micro-batch."""
        self.bwd_prefix = np.concatenate([zero, np.cumsum(bwd)])
        split, share = _split_backward_s(u, bwd, b, bp)
        self.bwd_input_prefix = np.concatenate([zero, np.cumsum(split * share)])
        """Prefix sums of the input-gradient part (B) of the backward run split
        (``backward_input_share`` of ``backward_split_factor`` times the backward)."""
        self.bwd_split_prefix = np.concatenate([zero, np.cumsum(split)])
        """Prefix sums of the backward run split, B + W (``backward_split_factor``)."""
        self.param_prefix = np.concatenate([zero, np.cumsum(param)])
        self.act_prefix = np.concatenate([zero, np.cumsum(act)])
        self.unit_activation_bytes = act
        """Each unit's activation bytes at the profile batch size (per-unit checkpointing
        re-computes one unit at a time: the segment's largest is live at once)."""
        # Bytes crossing each boundary position at the profile batch size; nothing leaves position N.
        self.cut_bytes_at = np.array(
            [float(profile.input_bytes), *map(float, profile.cut_bytes), 0.0]
        )
        sends = profile.send_cut_bytes or profile.cut_bytes
        self.send_bytes_at = np.array([float(profile.input_bytes), *map(float, sends), 0.0])
        """Bytes a boundary at each position sends (``Profile.send_cut_bytes``, else the cut)."""
        self.unit_input_prefix = np.concatenate([zero, np.cumsum(self.cut_bytes_at[: len(u)])])
        """Prefix sums of the units' input bytes (the cut before each unit, skip connections
        included): what per-unit checkpointing keeps of a segment, per micro-batch."""
        self.state_factor = state_bytes_per_parameter / pbytes
        """Training-state bytes per parameter byte (4.0 for fp32 Adam)."""
        state = param * self.state_factor
        if profile.extra_state_bytes:
            state = state + np.asarray(profile.extra_state_bytes, float)
        self.state_prefix = np.concatenate([zero, np.cumsum(state)])
        """Prefix sums of each unit's training-state bytes per device: its parameter bytes x
        ``state_factor``, plus the profile's ``extra_state_bytes`` (expert shards)."""

    def _init_devices(self, cluster: Cluster) -> None:
        """Each stage's device: relative speed, memory (inf: unlimited), link to the next."""
        devs = cluster.devices
        self.speed = np.array([d.speed for d in devs], float)
        self.capacity_bytes = np.array(
            [math.inf if d.memory_bytes is None else float(d.memory_bytes) for d in devs]
        )
        self.bandwidth_bytes_per_s = np.array([d.link_bandwidth_bytes_per_s for d in devs], float)
        self.latency_s = np.array([d.link_latency_s for d in devs], float)

    def _init_inflight(
        self, inflight: Sequence[float] | None, full_inflight: Sequence[float] | None
    ) -> None:
        """Micro-batches each stage holds at once: given (the schedule's own order), else
        GPipe's M or 1F1B's ``min(K - s, M)``."""
        k, schedule, microbatches = self.num_stages, self.schedule, self.microbatches
        if inflight is not None:  # from the schedule's own order (autopipe/core/schedules.py)
            self.inflight = np.asarray(inflight, dtype=float)
        elif schedule == "gpipe":
            self.inflight = np.full(k, microbatches, dtype=float)
        else:  # 1F1B: stage s holds at most K - s micro-batches between its forward and backward
            self.inflight = np.minimum(k - np.arange(k), microbatches).astype(float)
        self.full_inflight = (
            np.ones(k) if full_inflight is None else np.asarray(full_inflight, dtype=float)
        )
        """Checkpointed stages: the most micro-batches holding re-computed (full)
        activations at once: 1 with a whole backward, more when weight gradients wait."""
        if self.inflight.shape != (k,) or self.full_inflight.shape != (k,):
            raise ValueError(f"inflight counts need one value per stage ({k})")

    def _options(self, stage: int) -> str:
        """Allowed options for a stage: 'A' (keep), 'B' (checkpoint), 'AB' (A if it fits, else B)."""
        mode = self.checkpoint_mode
        if mode == "never":
            return "A"
        if mode == "always":
            return "B"
        if mode == "except_last":
            return "A" if stage == self.num_stages - 1 else "B"
        return "AB"

    # ----- per-position quantities (vectorised over positions) -----

    def send_s(self, stage: int, j: np.ndarray | int) -> np.ndarray:
        """Seconds to send the cut at position ``j`` from ``stage`` to the next; 0 at ``j == N``."""
        j = np.asarray(j)
        bw = self.bandwidth_bytes_per_s[stage]
        data = 0.0 if math.isinf(bw) else self.send_bytes_at[j] * self.ratio / bw
        return np.where(j >= self.n_units, 0.0, data + self.latency_s[stage])

    def limit_bytes(self, stage: int) -> float:
        """Raw bytes a stage may use: device memory / (1 + headroom)."""
        return self.capacity_bytes[stage] / (1.0 + self.headroom)

    # ----- one segment -----

    def segment(self, stage: int, i: int, j: int, checkpoint: bool | None = None) -> SegmentCost:
        """Cost of units ``i..j-1`` on ``stage`` with the option the checkpoint mode picks
        (``checkpoint`` True/False: that option, whatever the mode)."""
        v = self.speed[stage]
        fwd = (self.fwd_prefix[j] - self.fwd_prefix[i]) / v
        bwd = (self.bwd_prefix[j] - self.bwd_prefix[i]) / v
        rec = (self.rec_prefix[j] - self.rec_prefix[i]) / v
        send = float(self.send_s(stage, j))
        param = self.param_prefix[j] - self.param_prefix[i]
        mem = self.segment_memory(stage, i, j)
        state = mem.state_bytes  # param * state_factor (+ expert shards' extra)
        opt = state - param
        act_a, act_s, act_u = mem.kept_bytes, mem.per_stage_bytes, mem.per_unit_bytes
        act_b = min(act_s, act_u)
        limit = self.limit_bytes(stage)
        # Same expressions as cost_matrix so that the DP and this check agree exactly.
        fits_a = state + act_a <= limit
        fits_b = state + act_b <= limit
        opts = self.options[stage]
        if checkpoint is not None:
            opts = "B" if checkpoint else "A"
        if opts == "A" or (opts == "AB" and fits_a):
            ckpt, act, ok = False, act_a, fits_a
        else:  # checkpointed: always, or auto where the kept activations do not fit
            ckpt, act, ok = True, act_b, fits_b
        return SegmentCost(
            forward_s=float(fwd),
            backward_s=float(bwd),
            recompute_s=float(rec) if ckpt else 0.0,
            send_s=send,
            parameter_bytes=int(round(param)),
            optimizer_bytes=int(round(opt)),
            activation_bytes=int(round(act)),
            checkpoint=ckpt,
            feasible=bool(ok),
            memory_without_checkpoint_bytes=int(round(state + act_a)),
            checkpoint_granularity=UNIT if ckpt and act_u < act_s else STAGE,
        )

    def unit_activation_max(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        """The largest unit activation bytes (profile batch size) of segments ``[i, j)``
        (broadcast arrays), 0 where ``j <= i``. A sparse table, built once in O(N log N);
        each query O(1). Exact (a max of maxes), so it equals :meth:`unit_activation_max_matrix`,
        which answers instead up to ``_DENSE_MAX_UNITS`` units (one lookup, no per-level loop:
        the probe asks this once per stage per probe)."""
        if self.n_units <= _DENSE_MAX_UNITS:
            return self.unit_activation_max_matrix()[i, j]
        if "range_max" not in self._cache:
            levels = [self.unit_activation_bytes]
            width = 1
            while 2 * width <= self.n_units:
                prev = levels[-1]
                levels.append(np.maximum(prev[: prev.size - width], prev[width:]))
                width *= 2
            self._cache["range_max"] = levels
        levels = self._cache["range_max"]
        i_arr, j_arr = np.broadcast_arrays(np.asarray(i), np.asarray(j))
        length = j_arr - i_arr
        valid = length > 0
        lv = np.floor(np.log2(np.where(valid, length, 1))).astype(np.int64)
        out = np.zeros(i_arr.shape)
        for level in np.unique(lv[valid]):
            q = valid & (lv == level)
            tab = levels[int(level)]
            out[q] = np.maximum(tab[i_arr[q]], tab[j_arr[q] - (1 << int(level))])
        return out

    def unit_activation_max_matrix(self) -> np.ndarray:
        """``M[i, j]`` = the largest unit activation bytes (profile batch size) of segment
        ``[i, j)``, 0 where ``j <= i``. Shape ``(N+1, N+1)``; O(N^2), cached."""
        if "unit_max" not in self._cache:
            n = self.n_units
            act = np.concatenate([np.zeros(1), self.unit_activation_bytes])  # act[j - 1] at j
            last = np.where(np.tri(n + 1, dtype=bool), 0.0, act[None, :])
            self._cache["unit_max"] = np.maximum.accumulate(last, axis=1)
        return self._cache["unit_max"]

    def segment_time(self, stage: int, i: int, j: int) -> float:
        """Busy seconds per micro-batch of the segment, ``inf`` if it does not fit in memory."""
        c = self.segment(stage, i, j)
        return c.time_s if c.feasible else math.inf

    def segment_memory(self, stage: int, i: np.ndarray | int, j: np.ndarray | int) -> StageMemory:
        """The memory of segments ``[i, j)`` (ints, or broadcast arrays) on ``stage``
        (:func:`stage_memory`). O(1) per segment."""
        r = self.ratio
        u = self.unit_input_prefix

        def largest() -> Any:
            top = self.unit_activation_max(i, j)
            return (float(top) if np.ndim(top) == 0 else top) * r

        return stage_memory(
            self.state_prefix[j] - self.state_prefix[i],
            (self.act_prefix[j] - self.act_prefix[i]) * r,
            self.cut_bytes_at[i] * r,
            (u[j] - u[i]) * r,
            largest,
            self.inflight[stage],
            self.full_inflight[stage],
        )

    def segment_memory_need(self, stage: int, i: int, j: int) -> float:
        """Smallest device memory (bytes, headroom included) the segment fits in, in this mode."""
        mem = self.segment_memory(stage, i, j)
        act_a = mem.kept_bytes
        act_b = min(mem.per_stage_bytes, mem.per_unit_bytes)
        need = {"A": act_a, "B": act_b, "AB": min(act_a, act_b)}[self.options[stage]]
        return float((mem.state_bytes + need) * (1.0 + self.headroom))

    # ----- all segments at once (for the vectorised DP) -----

    def cost_matrix(self, stage: int) -> np.ndarray:
        """``C[i, j]`` = seconds per micro-batch of segment ``[i, j)`` on ``stage``.

        Shape ``(N+1, N+1)``; ``inf`` where ``j <= i`` or the segment does not fit.
        O(N^2) time and memory; the time and memory parts are cached per device kind, and
        the memory masks are skipped when even the whole chain fits on the stage.
        """
        v = self.speed[stage]
        tkey = ("time", v, self.bandwidth_bytes_per_s[stage], self.latency_s[stage])
        if tkey not in self._cache:
            n = self.n_units
            f, g, rp = self.fwd_prefix, self.bwd_prefix, self.rec_prefix
            # Same operation order as SegmentCost.time_s so that values agree to the last bit.
            fwd = (f[None, :] - f[:, None]) / v
            base = fwd + (g[None, :] - g[:, None]) / v
            rec = fwd if np.array_equal(rp, f) else (rp[None, :] - rp[:, None]) / v
            send = self.send_s(stage, np.arange(n + 1))[None, :]
            invalid = np.tri(n + 1, dtype=bool)  # [i, j] with j <= i
            time_a = base + send
            time_a[invalid] = np.inf
            self._cache[tkey] = (rec, base, send, time_a, invalid)
        rec, base, send, time_a, invalid = self._cache[tkey]
        limit = self.limit_bytes(stage)
        n_s = self.inflight[stage]
        n_full = self.full_inflight[stage]
        opts = self.options[stage]
        r = self.ratio
        # the whole chain with the largest input cut bounds every segment from above
        whole = stage_memory(
            self.state_prefix[-1],
            self.act_prefix[-1] * r,
            float(self.cut_bytes_at.max()) * r,
            self.unit_input_prefix[-1] * r,
            float(self.unit_activation_bytes.max(initial=0.0)) * r,
            n_s,
            n_full,
        )
        all_fit_a = whole.state_bytes + whole.kept_bytes <= limit
        all_fit_b = whole.state_bytes + whole.per_stage_bytes <= limit
        if "A" in opts and all_fit_a:
            return time_a  # every segment keeps its activations and fits: no masks needed
        mem = self._memory_matrix(stage)
        if "B" in opts:
            time_b = (base + rec) + send
            time_b[invalid] = np.inf
            if not all_fit_b:
                fits_b = mem.state_bytes + np.minimum(mem.per_stage_bytes, mem.per_unit_bytes)
                time_b[~(fits_b <= limit)] = np.inf
            if opts == "B":
                return time_b
        fits_a = mem.state_bytes + mem.kept_bytes <= limit
        if opts == "A":
            return np.where(fits_a, time_a, np.inf)
        return np.where(fits_a, time_a, time_b)

    def segment_times(self, stage: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Seconds per micro-batch of segments ``[i, j)`` (broadcast arrays); ``inf`` if invalid.

        The same expressions, in the same order, as ``cost_matrix`` and ``segment``.
        """
        v = self.speed[stage]
        f, g, r = self.fwd_prefix, self.bwd_prefix, self.rec_prefix
        fwd = (f[j] - f[i]) / v
        base = fwd + (g[j] - g[i]) / v
        rec = (r[j] - r[i]) / v
        send = self.send_s(stage, j)
        limit = self.limit_bytes(stage)
        mem = self.segment_memory(stage, i, j)
        opts = self.options[stage]
        time_a = np.where(mem.state_bytes + mem.kept_bytes <= limit, base + send, np.inf)
        fits_b = mem.state_bytes + np.minimum(mem.per_stage_bytes, mem.per_unit_bytes) <= limit
        time_b = np.where(fits_b, (base + rec) + send, np.inf)
        if opts == "A":
            out = time_a
        elif opts == "B":
            out = time_b
        else:
            out = np.where(np.isfinite(time_a), time_a, time_b)
        return np.where(j > i, out, np.inf)

    def clear_cache(self) -> None:
        """Drop the O(N^2) matrices kept between ``cost_matrix`` calls."""
        self._cache.clear()

    def _memory_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Training-state bytes and one micro-batch's activation bytes of every segment."""
        if "memory" not in self._cache:
            state = self.state_prefix[None, :] - self.state_prefix[:, None]
            act_one = (self.act_prefix[None, :] - self.act_prefix[:, None]) * self.ratio
            self._cache["memory"] = (state, act_one)
        return self._cache["memory"]

    def _memory_matrix(self, stage: int) -> StageMemory:
        """Every segment's memory on ``stage`` (:func:`stage_memory`, ``[i, j]`` matrices;
        the parts shared by all stages cached)."""
        state, act_one = self._memory_parts()
        r = self.ratio
        if "unit_memory" not in self._cache:
            u = self.unit_input_prefix
            self._cache["unit_memory"] = (
                (u[None, :] - u[:, None]) * r,
                self.unit_activation_max_matrix() * r,
            )
        unit_inputs, largest = self._cache["unit_memory"]
        return stage_memory(
            state,
            act_one,
            (self.cut_bytes_at * r)[:, None],
            unit_inputs,
            largest,
            self.inflight[stage],
            self.full_inflight[stage],
        )

    def stage_costs(self, bounds: list[int]) -> list[SegmentCost]:
        """Costs of the stages of a partition given as ``K + 1`` positions ``0 = p0 < ... < pK = N``."""
        return [self.segment(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
