"""The least re-materialization a mesh's memory forces, for the mesh search's lower bound
(:func:`autopipe.planner.mesh.mesh_lower_bound_s`). Torch-free.

A pipeline of K stages on devices that keep ``limit_bytes`` each (memory less the gather
buffers, over ``1 + headroom``) runs one micro-batch-count M of GPipe or 1F1B. Stage ``s``
holds ``n_s`` micro-batches in flight (GPipe: M; 1F1B: ``min(K - s, M)``). A stage that keeps
its activations needs ``state_s + n_s x act_s <= limit`` (``planner/costs.py``'s
``kept_bytes``); one that re-materializes pays its forward once more per micro-batch. So
the activations every kept stage holds sum to at most ``sum_s (limit - state_s) / n_s``,
largest when the training state sits on the stages holding the most micro-batches, each
up to its limit (greedy, ``kept_capacity_bytes``); the activations beyond that capacity
belong to re-computed stages, whose forward is at least the cheapest forward per byte
that covers them (the fractional knapsack, a relaxation of any cut:
``least_recompute_s``). A stage re-computing its whole forward costs at least that, so
``work + least_recompute`` bounds the summed stage times of every cut from below, and
the pipeline bounds built on the summed work stay proven with it. When even the state
cannot fit (``sum state > K x limit``) no cut fits: infinity (the mesh's memory floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopipe.core.profile import Profile

__all__ = [
    "PipelineMemory",
    "fill_drain_within",
    "inflight_per_stage",
    "kept_capacity_bytes",
    "least_recompute_s",
    "unit_bytes",
]


def fill_drain_within(
    unit_s: np.ndarray,
    forward_s: np.ndarray,
    microbatches: np.ndarray,
    stages: int,
    limit_s: float,
    memory: tuple[np.ndarray, np.ndarray, np.ndarray, float] | None = None,
) -> np.ndarray:
    """Per M (columns): False only when no cut of the units into ``stages`` contiguous
    stages has ``max_s (W_<s + M t_s) <= limit_s``, so every GPipe or 1F1B plan of that M
    takes longer than ``limit_s`` seconds. ``unit_s`` and ``forward_s``: ``(N, #M)`` each
    unit's forward + backward and forward seconds per micro-batch of that M (on the stages'
    device); ``W_<s``: one micro-batch's forward and backward over the stages before ``s``;
    ``t_s``: stage ``s``'s seconds per micro-batch, its forward once more where ``memory``
    forces re-materialization. ``memory``: per unit its training state bytes ``(N,)`` and
    activation bytes per micro-batch ``(N, #M)``, the micro-batches each stage holds
    ``(K, #M)`` (:func:`inflight_per_stage`) and the bytes a stage may use (None: no limit).

    Why a plan's iteration is at least ``W_<s + M t_s`` for every stage ``s``: the stage
    cannot start before micro-batch 0's forward crossed the stages before it, then runs M
    forwards and M backwards one at a time, and the last one's input gradient must cross
    those stages back; sends only add (the fill-and-drain term of
    :func:`autopipe.planner.mesh.mesh_lower_bound_s`, here on the units' discrete cuts, not
    on an even split of the work). A stage whose state and kept activations (``n_s`` in
    flight, ``planner/costs.py``'s ``kept_bytes``) exceed the limit must re-compute its
    forward (checkpointed: one more forward per micro-batch); one whose state alone
    exceeds it fits in no way. Both only grow as a stage gains units, so the stage time is
    monotone in its ends, and taking the farthest reach stage after stage finds a cut
    whenever one exists (by induction: the greedy position after ``s`` stages is never
    behind any cut's). Exact for this relaxation (empty stages allowed, state beyond the
    units' own and the checkpointed option's activations left out, which only adds cuts).
    Slacks of 1e-9 keep it a relaxation under rounding: it says False only where the least
    such maximum is above ``limit_s (1 + 1e-9)``. O(K N #M)."""
    ms = np.asarray(microbatches, dtype=float)
    n = unit_s.shape[0]
    zero = np.zeros((1, ms.size))
    work = np.concatenate([zero, np.cumsum(unit_s, axis=0)])  # (N+1, #M), nondecreasing
    fwd = np.concatenate([zero, np.cumsum(forward_s, axis=0)])
    cap = limit_s + 1e-9 * abs(limit_s) + 1e-12 * np.abs(work[-1])
    cols = np.arange(ms.size)
    pos = np.arange(n + 1)[:, None]
    if memory is not None:
        state_b, act_b, held, limit_b = memory
        state = np.concatenate([[0.0], np.cumsum(state_b)])[:, None]  # (N+1, 1)
        act = np.concatenate([zero, np.cumsum(act_b, axis=0)])
        room = limit_b + 1e-9 * abs(limit_b)  # only a clear excess forces or refuses
    at = np.zeros(ms.size, dtype=np.int64)
    for s in range(stages):
        w_at = work[at, cols]
        t = work - w_at  # the stage [at, j)'s forward + backward, (N+1, #M)
        if memory is not None and math.isfinite(limit_b):
            st = state - state[at, 0][None, :]
            kept = st + (act - act[at, cols]) * held[s]
            t = np.where(kept > room, t + (fwd - fwd[at, cols]), t)
            t = np.where(st > room, np.inf, t)
        ok = (pos >= at[None, :]) & (w_at + ms * t <= cap)
        reach = np.where(ok, pos, -1).max(axis=0)  # ok is a run of positions from ``at``
        moved = np.maximum(at, reach)
        if np.array_equal(moved, at):
            break  # no column moves again: each next stage starts where this one did
        at = moved
        if bool((at >= n).all()):
            break
    return at >= n


def inflight_per_stage(schedule: str, stages: int, microbatches: np.ndarray) -> np.ndarray:
    """``(K, #M)`` micro-batches each stage holds at once: GPipe ``M``, 1F1B ``min(K - s, M)``
    (``ScheduleShape.of``'s closed forms)."""
    ms = np.asarray(microbatches, dtype=float)[None, :]
    if schedule == "gpipe":
        return np.repeat(ms, stages, axis=0)
    if schedule != "1f1b":
        raise ValueError(f"in-flight counts in closed form for gpipe and 1f1b only: {schedule}")
    left = (stages - np.arange(stages, dtype=float))[:, None]
    return np.minimum(left, ms)


def kept_capacity_bytes(limit_bytes: float, state_bytes: float, inflight: np.ndarray) -> np.ndarray:
    """Per M (columns of ``inflight``, ``(K, #M)``): the most activation bytes per
    micro-batch the kept stages can hold together, ``max sum_s (limit - state_s) / n_s``
    over the splits of ``state_bytes`` into stages of at most ``limit_bytes`` each: the
    state fills the stages with the largest ``n_s`` first. ``-inf`` where the state alone
    exceeds ``K x limit``. O(K log K x #M)."""
    k = inflight.shape[0]
    if not math.isfinite(limit_bytes):
        return np.full(inflight.shape[1], np.inf)
    if limit_bytes <= 0 or state_bytes > k * limit_bytes:
        return np.full(inflight.shape[1], -np.inf)
    n = -np.sort(-inflight, axis=0)  # each column, most in flight first
    full = int(state_bytes // limit_bytes)  # stages whose state fills them
    rest = state_bytes - full * limit_bytes
    free = np.full(k, limit_bytes, dtype=float)
    free[:full] = 0.0
    if full < k:
        free[full] = limit_bytes - rest
    return (free[:, None] / n).sum(axis=0)


def least_recompute_s(
    device: Profile,
    replica: int,
    microbatches: np.ndarray,
    *,
    schedule: str,
    stages: int,
    limit_bytes: float,
    state_bytes_per_parameter: float,
    speed: float = 1.0,
) -> np.ndarray:
    """Per M of ``microbatches``: the least re-materialization seconds per micro-batch any
    cut of ``device``'s units into ``stages`` stages must add to fit ``limit_bytes`` per
    device (see the module docstring; ``state_bytes_per_parameter``: the training state
    per parameter as the pipeline search charges it, sharding applied); ``inf`` where no cut
    fits. The same unit arithmetic as ``planner/costs.py`` (overhead + size-dependent part,
    activations scaled by the micro-batch). O(N log N x #M)."""
    ms = np.asarray(microbatches, dtype=float)
    size = max(int(device.bytes_per_parameter), 1)
    params, unit_act, fo, fs = unit_bytes(device)
    state = float(params.sum()) * state_bytes_per_parameter / size
    held = inflight_per_stage(schedule, stages, ms)
    capacity = kept_capacity_bytes(limit_bytes, state, held)
    ratio = (replica / ms) / device.batch_size  # (#M,)
    act = unit_act[:, None] * ratio[None, :]
    fwd = (fo[:, None] + fs[:, None] * ratio[None, :]) / speed  # (N, #M)
    excess = act.sum(axis=0) - capacity
    out = np.zeros(ms.size)
    cols = np.flatnonzero(excess > 0)
    if cols.size:  # every M at once: a Python loop over ~30 Ms was most of the mesh bounds
        out[cols] = _cheapest_covers_s(fwd[:, cols], act[:, cols], excess[cols])
    out[capacity == -np.inf] = np.inf
    return out


def unit_bytes(device: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per unit of ``device``: parameter bytes (``planner/costs.py``'s), activation bytes
    at its batch size, forward overhead and the size-dependent seconds of its re-computation
    (the forward's, plus ``full_recompute_extra_s``); cached per
    profile object (the mesh search asks ~10^4 times of a few device profiles)."""
    hit = _UNIT_BYTES.get(id(device))
    if hit is not None and hit[0] is device:
        return hit[1]
    units = device.units
    size = max(int(device.bytes_per_parameter), 1)
    params = np.array(
        [u.parameter_bytes if u.parameter_bytes > 0 else u.parameter_count * size for u in units],
        dtype=float,
    )
    act = np.array([u.activation_bytes for u in units], dtype=float)
    fo = np.array([min(max(u.forward_overhead_s, 0.0), u.forward_s) for u in units])
    # what re-materialization re-runs of the forward: its size-dependent part plus the
    # unit's full_recompute_extra_s (which scales with the samples; 0 for most profiles)
    fs = np.maximum(np.array([u.forward_s + u.full_recompute_extra_s for u in units]) - fo, 0.0)
    if len(_UNIT_BYTES) > 4096:
        _UNIT_BYTES.clear()
    _UNIT_BYTES[id(device)] = (device, (params, act, fo, fs))
    return params, act, fo, fs


_UNIT_BYTES: dict[int, tuple[Profile, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}


def _cheapest_cover_s(seconds: np.ndarray, nbytes: np.ndarray, need_bytes: float) -> float:
    """The least seconds of units whose bytes cover ``need_bytes``, units taken fractionally
    (cheapest seconds per byte first): a lower bound on any whole-unit choice. ``inf`` when
    every unit together cannot cover it."""
    got = _cheapest_covers_s(seconds[:, None], nbytes[:, None], np.array([need_bytes]))
    return float(got[0])


def _cheapest_covers_s(
    seconds: np.ndarray, nbytes: np.ndarray, need_bytes: np.ndarray
) -> np.ndarray:
    """:func:`_cheapest_cover_s` of every column at once: ``seconds`` and ``nbytes`` are
    ``(N, C)``, ``need_bytes`` ``(C,)``. O(N log N x C) in a few numpy calls."""
    n, c = nbytes.shape
    has = nbytes > 0
    per = np.where(has, seconds / np.where(has, nbytes, 1.0), np.inf)
    order = np.argsort(per, axis=0, kind="stable")
    cum = np.cumsum(np.take_along_axis(nbytes, order, axis=0), axis=0)
    cum_s = np.cumsum(np.take_along_axis(seconds, order, axis=0), axis=0)
    per = np.take_along_axis(per, order, axis=0)
    cols = np.arange(c)
    i = np.minimum((cum < need_bytes[None, :]).sum(axis=0), n - 1)  # the first cum >= need
    before = np.where(i > 0, cum[np.maximum(i - 1, 0), cols], 0.0)
    whole_s = np.where(i > 0, cum_s[np.maximum(i - 1, 0), cols], 0.0)
    rest = np.maximum(need_bytes - before, 0.0)
    out = whole_s + np.where(rest > 0, per[i, cols] * rest, 0.0)
    return np.where(need_bytes > nbytes.sum(axis=0) * (1 + 1e-12), np.inf, out)


@dataclass(frozen=True)
class PipelineMemory:
    """What the pipeline search of one mesh may hold per device: ``limit_bytes`` (memory
    less the gather buffers, over ``1 + headroom``: ``CostModel.limit_bytes``), the training
    state per parameter it charges (``state_bytes_per_parameter``, sharding applied), the
    schedule (in-flight counts known in closed form for ``gpipe`` and ``1f1b`` only) and
    the devices' relative ``speed``."""

    schedule: str
    limit_bytes: float
    state_bytes_per_parameter: float
    speed: float = 1.0

    def least_recompute_s(
        self, device: Profile, replica: int, stages: int, ms: np.ndarray
    ) -> np.ndarray:
        """:func:`least_recompute_s` per M of ``ms``, zeros for the other schedules."""
        if self.schedule not in ("gpipe", "1f1b"):
            return np.zeros(np.asarray(ms).size)
        out = least_recompute_s(
            device, replica, ms, schedule=self.schedule, stages=stages,
            limit_bytes=self.limit_bytes,
            state_bytes_per_parameter=self.state_bytes_per_parameter, speed=self.speed,
        )  # fmt: skip
        return out * (1.0 - 1e-9)  # rounding must not make the bound exceed a real plan
