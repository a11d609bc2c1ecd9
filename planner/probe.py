"""Parametric (probe) search for the min-bottleneck partition, and its (f, q) frontier.

Torch-free. A probe decides in O(K N log N) numpy work whether every stage can stay under a
threshold ``T`` (reachability over positions; the per-stage checkpointed-memory condition, which
is not monotone because of the stage-input cut, is a range-maximum query on a sparse table; the
per-unit one is monotone, so the latest reachable start decides it, as for kept activations).
Bisection on ``T``, where each feasible probe lowers the upper bound to the found partition's
exact bottleneck, ends when the float just below that bottleneck is infeasible: exact.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import numpy as np
from autopipe.planner.chain import Partition, backtrack, bottleneck, minmax_dp, stage_key
from autopipe.planner.costs import CostModel, stage_memory

from autopipe.core.profile import UnitProfile

Caps = tuple[float, float, float]
"""(stage time, forward + send, recompute + backward) upper bounds for a probe."""


class _Prober:
    """Decides ``exists partition with every stage time <= T`` in O(K N log N) numpy work."""

    def __init__(self, cm: CostModel, capacity_bytes: np.ndarray | None = None) -> None:
        self.cm = cm
        self.n = cm.n_units
        self.capacity_bytes = cm.capacity_bytes if capacity_bytes is None else capacity_bytes
        self.pos = np.arange(self.n + 1)
        self._stage_cache: dict[tuple, dict[str, np.ndarray]] = {}
        self._of_stage: dict[int, dict[str, np.ndarray]] = {}  # stage -> its key's arrays

    def _stage(self, s: int) -> dict[str, np.ndarray]:
        got = self._of_stage.get(s)  # each probe asks once per stage: skip the key's tuple
        if got is None:
            got = self._of_stage[s] = self._stage_arrays(s)
        return got

    def _stage_arrays(self, s: int) -> dict[str, np.ndarray]:
        cm = self.cm
        key = (*stage_key(cm, s), self.capacity_bytes[s])
        got = self._stage_cache.get(key)
        if got is not None:
            return got
        v = cm.speed[s]
        f, g, r = cm.fwd_prefix / v, cm.bwd_prefix / v, cm.rec_prefix / v
        limit = self.capacity_bytes[s] / (1.0 + cm.headroom)
        n_s = cm.inflight[s]
        state = cm.state_prefix
        act = cm.act_prefix * cm.ratio * cm.full_inflight[s]  # checkpointed: re-computed ones
        got = {
            "send": cm.send_s(s, self.pos),
            "x_a": f + g,  # time_A(i, j) = x_a[j] - x_a[i] + send[j] (up to rounding)
            "x_b": f + r + g,
            "x_f": f,  # forward part of a stage: x_f[j] - x_f[i] + send[j]
            "x_q": r + g,  # checkpointed backward part: recompute + backward
            # memory_B(i, j) = need_b[j] - y_b[i]; y_b is not monotone (stage-input cut term).
            # stage_memory's per-stage bytes split into prefix terms, to find the windows;
            # _fits checks every window's segments with stage_memory itself
            "y_b": state + act - cm.cut_bytes_at * cm.ratio * n_s,
            "need_b": state + act - limit,
        }
        self._stage_cache[key] = got
        return got

    def _fits(self, s: int, i: np.ndarray, j: np.ndarray, ckpt: bool, caps: Caps) -> np.ndarray:
        """Exact check (same arithmetic as ``CostModel.segment``) of segments ``[i, j)``."""
        cm = self.cm
        v = cm.speed[s]
        fwd = (cm.fwd_prefix[j] - cm.fwd_prefix[i]) / v
        bwd = (cm.bwd_prefix[j] - cm.bwd_prefix[i]) / v
        rec = (cm.rec_prefix[j] - cm.rec_prefix[i]) / v
        base = fwd + bwd
        send = self._stage(s)["send"][j]
        time = ((base + rec) if ckpt else base) + send
        t, f_cap, q_cap = caps
        ok = time <= t
        if math.isfinite(f_cap):  # forward part as the simulator sees it: forward + send
            ok &= fwd + send <= f_cap
        if math.isfinite(q_cap):  # backward part: recompute + backward
            ok &= ((rec + bwd) if ckpt else bwd) <= q_cap
        limit = self.capacity_bytes[s] / (1.0 + cm.headroom)
        if math.isinf(limit):
            return ok & (i < j)
        mem = cm.segment_memory(s, i, j)  # costs.stage_memory
        if ckpt:  # the smaller of per-stage and per-unit re-materialization
            act = np.minimum(mem.per_stage_bytes, mem.per_unit_bytes)
        else:
            act = mem.kept_bytes
        return ok & (mem.state_bytes + act <= limit) & (i < j)

    def probe(self, t: float, f_cap: float = math.inf, q_cap: float = math.inf) -> list[int] | None:
        """A partition within memory whose every stage has time ``<= t``, forward + send
        ``<= f_cap`` and recompute + backward ``<= q_cap``; or None.

        Each stage only looks at ends ``j`` in a window: after the first reachable start, and
        no further than a stage of time ``t`` can stretch from the last reachable start.
        """
        caps = (t, f_cap, q_cap)
        span = min(t, f_cap + q_cap)  # a stage's time is at least its forward + backward
        cm, n, pos = self.cm, self.n, self.pos
        reach = np.zeros(n + 1, bool)
        reach[0] = True
        preds = []
        for s in range(cm.num_stages):
            st = self._stage(s)
            opts = cm.options[s]
            starts = np.flatnonzero(reach)
            a = int(starts[0])
            b = n
            if math.isfinite(span):  # time >= x_a[j] - x_a[i]: ends beyond this cannot fit
                x = st["x_a"]
                top = x[starts[-1]] + span
                b = min(
                    n,
                    int(np.searchsorted(x, top + 1e-9 * (abs(top) + abs(span)), side="right")) - 1,
                )
            if b <= a:
                return None
            j = pos[a + 1 : b + 1]
            new_reach = np.zeros(n + 1, bool)
            pred = np.full(n + 1, -1)
            local = reach[a:b]
            # Latest reachable position strictly before j (positions a .. b-1).
            last = np.maximum.accumulate(np.where(local, pos[a:b], -1))
            if "A" in opts:
                # Option A's time and memory only shrink as i grows: the latest reachable i is best.
                ok = (last >= 0) & self._fits(s, np.maximum(last, 0), j, False, caps)
                new_reach[a + 1 : b + 1] = ok
                pred[a + 1 : b + 1] = np.where(ok, last, -1)
            if "B" in opts:
                ok, wit = self._probe_b(s, st, local, a, j, caps)
                window = pred[a + 1 : b + 1]
                take = ok & (window < 0)
                new_reach[a + 1 : b + 1] |= ok
                pred[a + 1 : b + 1] = np.where(take, wit, window)
                # Per-unit re-materialization: its time and memory only shrink as i grows
                # (fewer inputs kept, a smaller largest unit), so the latest reachable i is
                # best, as for option A.
                ok = (last >= 0) & self._fits(s, np.maximum(last, 0), j, True, caps)
                window = pred[a + 1 : b + 1]
                take = ok & (window < 0)
                new_reach[a + 1 : b + 1] |= ok
                pred[a + 1 : b + 1] = np.where(take, last, window)
            reach = new_reach
            preds.append(pred)
            if not reach.any():
                return None
        if not reach[n]:
            return None
        return backtrack(preds, n)

    def _probe_b(
        self,
        s: int,
        st: dict[str, np.ndarray],
        local: np.ndarray,
        a: int,
        j: np.ndarray,
        caps: Caps,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Option B: some reachable i in [lo_j, j) with y_b[i] >= need_b[j] (range max query).

        ``local`` is reachability of positions ``a .. a + len(local) - 1``.
        """
        lo = np.full(j.size, a, dtype=np.int64)
        send = st["send"][j]
        # Each time condition reads x[j] - x[i] + extra[j] <= cap  <=>  x[i] >= x[j] + extra - cap
        # with x nondecreasing; the tiny slack only widens the range, the exact check keeps it sound.
        for x, extra, cap in (
            (st["x_b"], send, caps[0]),
            (st["x_f"], send, caps[1]),
            (st["x_q"], 0.0, caps[2]),
        ):
            if math.isfinite(cap):
                thr = x[j] + extra - cap
                lo = np.maximum(
                    lo, np.searchsorted(x, thr - 1e-12 * (np.abs(thr) + abs(cap)), side="left")
                )
        hi = j - 1
        y = np.where(local, st["y_b"][a : a + local.size], -np.inf)
        val, wit = _range_argmax(y, lo - a, hi - a)
        wit = wit + a
        ok = (lo <= hi) & (val >= st["need_b"][j] - 1e-9 * np.abs(st["need_b"][j]))
        wit = np.where(ok, wit, a)
        ok &= local[wit - a] & self._fits(s, wit, j, True, caps)
        return ok, wit


def time_only_fits(cm: CostModel, t: float) -> bool:
    """False only when no cut of ``cm``'s units into its ``K`` stages keeps every stage's
    forward + backward ``<= t`` (seconds): then no cut passes :meth:`_Prober.probe` at
    ``t`` either, whose stage time adds the send, any recompute (all >= 0) and a memory
    check to the same forward + backward. Empty stages are allowed here (a relaxation),
    which makes the greedy exact for it: each stage reaches as far as it can, and a later
    start never reaches less (the prefix sums only grow), whatever the stages' speeds.
    O(K log N). A slack of 1e-9 only keeps it a relaxation under rounding."""
    n = cm.n_units
    work = cm.fwd_prefix + cm.bwd_prefix
    cap = t * (1.0 + 1e-9) + 1e-12 * abs(float(work[-1]))
    at = 0
    for s in range(cm.num_stages):
        if at >= n:
            break
        # (f[j] - f[i]) / v + (g[j] - g[i]) / v <= t  <=>  work[j] <= work[i] + t v (up to rounding)
        reach = int(np.searchsorted(work, work[at] + cap * float(cm.speed[s]), side="right")) - 1
        at = max(at, reach)
    return at >= n


def no_cut_within(cm: CostModel, limit_s: float) -> bool:
    """True when no cut of ``cm``'s units keeps every stage's time within ``limit_s``
    seconds in memory (:func:`time_only_fits`, then one :meth:`_Prober.probe`): the pipeline
    search's pruning test (``search._partition_candidate``).

    A "no" is remembered, and answers later questions it covers without a probe: the same
    units (one profile, or its per-shard copies that differ only in the expert shards'
    ``extra_state_bytes``), batch, M, schedule, checkpointing, speeds and links (the stage
    times are equal) with at least as much training state in every unit, at most as much
    memory per stage and a limit no larger. Each of those only removes segments the probe could use
    (a segment's memory grows with its state and the test it must pass tightens), so no cut
    fits there either: the answer the probe would give. The mesh search asks this of the
    shardings of one mesh in turn (ZeRO-2's gradients first, its bound is lowest; then
    ZeRO-1's and the unsharded, more state on the same device profile) at the best step
    so far, which only falls: DeepSeek-V3's deep meshes asked ~3 700 of their ~10 000
    probes again that way (#35). O(K log N) when remembered, else one probe."""
    if not time_only_fits(cm, limit_s):
        return True
    first = cm.profile.units[0]  # shared by the per-shard copies (dataclasses.replace)
    key = (
        id(first), cm.batch_size, cm.microbatches, cm.headroom, tuple(cm.options),
        # the units' own figures too: a copy sharing the first unit may differ in others
        cm.fwd_prefix.tobytes(), cm.bwd_prefix.tobytes(), cm.bwd_split_prefix.tobytes(),
        cm.rec_prefix.tobytes(), cm.param_prefix.tobytes(), cm.act_prefix.tobytes(), cm.unit_input_prefix.tobytes(),
        cm.speed.tobytes(), cm.bandwidth_bytes_per_s.tobytes(), cm.latency_s.tobytes(),
        cm.inflight.tobytes(), cm.full_inflight.tobytes(),
    )  # fmt: skip
    hit = _NO_CUT.get(key)
    known = hit[1] if hit is not None and hit[0]() is first else None
    state = np.diff(cm.state_prefix)
    for unit_state, capacity, t in known or ():
        if (
            t >= limit_s
            and bool(np.all(unit_state <= state))
            and bool(np.all(capacity >= cm.capacity_bytes))
        ):
            return True
    if _Prober(cm).probe(limit_s) is not None:
        return False
    if known is None:
        if len(_NO_CUT) > 4096:
            _NO_CUT.clear()
        known = []
        _NO_CUT[key] = (weakref.ref(first), known)
    if len(known) < 16:
        known.append((state, cm.capacity_bytes.copy(), limit_s))
    return True


_NO_CUT: dict[
    tuple, tuple[weakref.ref[UnitProfile], list[tuple[np.ndarray, np.ndarray, float]]]
] = {}
"""The "no cut fits" answers of :func:`no_cut_within` by everything but the units' state,
the memory and the limit (a weak reference to the first unit tells a reused ``id`` apart
without keeping the mesh search's device profiles alive)."""


_DENSE_RANGE_CELLS = 1 << 16
"""Largest ``queries x positions`` :func:`_range_argmax` answers with one dense argmax."""


def _range_argmax(y: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max and argmax of ``y[lo[q]..hi[q]]`` for every query q (sparse table, O(N log N));
    the first index of the max on ties, ``-inf`` where ``hi < lo``. Up to
    ``_DENSE_RANGE_CELLS`` queries x positions, one masked ``(Q, N)`` argmax instead: the
    same answers (both take the first maximum) in a few numpy calls, where the table's
    levels cost ~50 calls for the ~65 units of a large model's layers."""
    n = y.size
    if lo.size * n <= _DENSE_RANGE_CELLS:
        at = np.arange(n)[None, :]
        inside = (at >= lo[:, None]) & (at <= hi[:, None])
        masked = np.where(inside, y[None, :], -np.inf)
        arg = np.argmax(masked, axis=1)
        val = masked[np.arange(lo.size), arg]
        # a range holding only -inf: the table answers its first position
        arg = np.where(val == -np.inf, np.clip(lo, 0, n - 1), arg)
        val[hi < lo] = -np.inf
        return val, arg
    vals = [y]
    args = [np.arange(n)]
    width = 1
    while 2 * width <= n:
        pv, pa = vals[-1], args[-1]
        left, right = pv[: n - 2 * width + 1], pv[width : n - width + 1]
        take_right = right > left
        vals.append(np.where(take_right, right, left))
        args.append(np.where(take_right, pa[width : n - width + 1], pa[: n - 2 * width + 1]))
        width *= 2
    length = np.maximum(hi - lo + 1, 1)
    level = np.floor(np.log2(length)).astype(np.int64)
    lo_c = np.clip(lo, 0, n - 1)
    out_v = np.full(lo.size, -np.inf)
    out_a = np.zeros(lo.size, dtype=np.int64)
    for lv in np.unique(level):
        q = np.flatnonzero(level == lv)
        w = 1 << int(lv)
        a = lo_c[q]
        b = np.clip(hi[q] - w + 1, 0, None)
        va, vb = vals[lv][a], vals[lv][b]
        right = vb > va
        out_v[q] = np.where(right, vb, va)
        out_a[q] = np.where(right, args[lv][b], args[lv][a])
    out_v[hi < lo] = -np.inf
    return out_v, out_a


def probe_partition(cm: CostModel) -> Partition | None:
    """Exact min-bottleneck partition by parametric search; None if nothing fits in memory.

    Each probe is O(K N log N). Up to ``EXACT_VALUES_MAX_UNITS`` units: bisection over the
    segments' sorted times (:func:`_segment_times`), about log2(2 K' N^2) probes; beyond:
    about 20-40 probes (bisection to a relative width of 1e-6, then one probe just below the
    incumbent to prove it optimal).
    """
    prober = _Prober(cm)
    first = prober.probe(math.inf)
    if first is None:
        return None
    best = first
    hi = bottleneck(cm, best)
    # Lower bound: the stage time of the single most expensive unit on the fastest device.
    v = float(np.max(cm.speed))
    unit = np.diff(cm.fwd_prefix + cm.bwd_prefix) / v
    total = float(cm.fwd_prefix[-1] + cm.bwd_prefix[-1]) / float(np.sum(cm.speed))
    lo = max(float(unit.max(initial=0.0)), total) * (1.0 - 1e-9)
    if cm.n_units <= EXACT_VALUES_MAX_UNITS:
        # The least bottleneck is one segment's time: bisect over those times (as the probe
        # computes them) between lo and hi, ~log2(N^2) probes, not ~20 halvings of [lo, hi]
        # to 1e-6 and the proof below it. The same value: the smallest time some cut attains.
        times = _segment_times(cm)
        times = times[(times > lo) & (times < hi)]
        a, b = 0, times.size  # the answer is times[b], or hi when b == times.size
        while a < b:
            mid = (a + b) // 2
            found = prober.probe(float(times[mid]))
            if found is None:
                a = mid + 1
            else:
                best, hi, b = found, bottleneck(cm, found), mid
        return Partition(best, hi, "probe")
    while True:
        if hi - lo > 1e-6 * hi:
            t = 0.5 * (lo + hi)
        else:
            t = float(np.nextafter(hi, -np.inf))
        if t <= lo:
            break
        found = prober.probe(t)
        if found is None:
            lo = t
        else:
            best = found
            hi = bottleneck(cm, best)
    return Partition(best, hi, "probe")


EXACT_VALUES_MAX_UNITS = 256
"""Up to this many units :func:`probe_partition` bisects over the segments' times."""


def _segment_times(cm: CostModel) -> np.ndarray:
    """Every segment's time per micro-batch, kept and re-computed, on every stage's device,
    sorted and distinct: the arithmetic of :meth:`_Prober._fits` (and ``CostModel.segment``)
    elementwise, so the least bottleneck is one of these floats exactly. O(K' N^2 log N)
    for K' distinct devices and links."""
    n = cm.n_units
    i, j = np.triu_indices(n + 1, 1)
    out = []
    links = {
        (cm.speed[s], cm.bandwidth_bytes_per_s[s], cm.latency_s[s]): s for s in range(cm.num_stages)
    }
    for s in links.values():
        v = cm.speed[s]
        fwd = (cm.fwd_prefix[j] - cm.fwd_prefix[i]) / v
        bwd = (cm.bwd_prefix[j] - cm.bwd_prefix[i]) / v
        rec = (cm.rec_prefix[j] - cm.rec_prefix[i]) / v
        base = fwd + bwd
        send = cm.send_s(s, np.arange(n + 1))[j]
        out += [base + send, (base + rec) + send]
    return np.unique(np.concatenate(out))


MEMORY_DP_MAX_UNITS = 256
"""Up to this many units :func:`min_memory_needed` is one min-max DP over every segment's
need (O(K N^2), exact); above it, the bisection with the probe (O(K N log N) per step)."""


def min_memory_needed(cm: CostModel) -> float:
    """Smallest equal memory per device (bytes, headroom included) for which some partition fits.

    Up to ``MEMORY_DP_MAX_UNITS`` units: the min over partitions of their largest stage's
    :meth:`CostModel.segment_memory_need`, by one min-max DP (:func:`_memory_need_dp`). A
    refused request computes this for every candidate (every M of every mesh: 499 times for
    ``--shard auto --batch-size 10**12`` on 8 GPUs), where the bisection's ~30 probes each
    took 30 s of the 35 s. Beyond: the smallest power of two 2^e (e = 0..99) that fits, found
    by bisection on e (a larger memory never fits less), then bisection on the capacity in
    ``[0, 2^e]`` with the probe at ``T = inf``: O(K N log N) per step, at most 7 + 60 steps,
    to a relative 1e-6. ``inf`` if nothing fits (beyond: 2^99).
    """
    if cm.n_units <= MEMORY_DP_MAX_UNITS:
        return _memory_need_dp(cm)
    k = cm.num_stages

    def fits(capacity: float) -> bool:
        return _Prober(cm, np.full(k, capacity)).probe(math.inf) is not None

    if not fits(2.0**99):
        return math.inf
    low_e, high_e = -1, 99  # 2^low_e does not fit (or is below 1), 2^high_e fits
    while high_e - low_e > 1:
        mid_e = (low_e + high_e) // 2
        if fits(2.0**mid_e):
            high_e = mid_e
        else:
            low_e = mid_e
    hi = 2.0**high_e
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _Prober(cm, np.full(k, mid)).probe(math.inf) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-6 * hi:
            break
    return hi


def _memory_need_dp(cm: CostModel) -> float:
    """The least memory need (bytes, headroom included) over every partition, exact: each
    stage's ``[i, j]`` need matrix by the expressions of :meth:`CostModel.segment_memory_need`
    (broadcast, so each entry equals the scalar call's), then :func:`minmax_dp`. O(K N^2)
    time, O(N^2) memory per distinct stage kind."""
    n = cm.n_units
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    cols = np.broadcast_to(j, (n + 1, n + 1))
    rows = np.broadcast_to(i, (n + 1, n + 1))
    valid = cols > rows
    ii, jj = rows[valid], cols[valid]  # only j > i: the ranges a stage can hold
    cache: dict[tuple, np.ndarray] = {}
    matrices = []
    for s in range(cm.num_stages):
        key = (cm.inflight[s], cm.full_inflight[s], cm.options[s])
        if key not in cache:
            mem = cm.segment_memory(s, ii, jj)
            act_a = mem.kept_bytes
            act_b = np.minimum(mem.per_stage_bytes, mem.per_unit_bytes)
            act = {"A": act_a, "B": act_b, "AB": np.minimum(act_a, act_b)}[cm.options[s]]
            need = np.full((n + 1, n + 1), np.inf)
            need[valid] = (mem.state_bytes + act) * (1.0 + cm.headroom)
            cache[key] = need
        matrices.append(cache[key])
    found = minmax_dp(matrices, n)
    return math.inf if found is None else found[0]


def memory_floor(cm: CostModel) -> float:
    """A lower bound on :func:`min_memory_needed` (bytes, headroom included) in O(K N): every
    unit lies on some stage, and a stage holding it holds at least its training state and,
    by the stage's options, its kept or its re-computed activations
    (:func:`autopipe.planner.costs.stage_memory` of the unit alone, inputs left out)."""
    n = cm.n_units
    u = np.arange(n)
    state = cm.state_prefix[u + 1] - cm.state_prefix[u]
    act = (cm.act_prefix[u + 1] - cm.act_prefix[u]) * cm.ratio
    least = np.full(n, math.inf)
    for s in range(cm.num_stages):
        mem = stage_memory(state, act, 0.0, 0.0, act, cm.inflight[s], cm.full_inflight[s])
        opts = cm.options[s]
        held = np.full(n, math.inf)
        if "A" in opts:
            held = np.minimum(held, mem.kept_bytes)
        if "B" in opts:
            held = np.minimum(held, np.minimum(mem.per_stage_bytes, mem.per_unit_bytes))
        least = np.minimum(least, state + held)
    return float(least.max(initial=0.0)) * (1.0 + cm.headroom)


def _parametric(
    prober: _Prober,
    measure: Callable[[list[int]], float],
    caps_of: Callable[[float], Caps],
    max_probes: int = 200,
) -> tuple[float, list[int], int] | None:
    """Smallest ``v`` for which ``prober.probe(*caps_of(v))`` succeeds, and that partition.

    ``measure(bounds)`` must return the exact capped quantity of a partition (so each feasible
    probe lowers the upper bound to a value some partition attains). Bisection as in
    ``probe_partition``; at most ``max_probes`` probes.
    """
    best = prober.probe(*caps_of(math.inf))
    if best is None:
        return None
    hi, lo = measure(best), 0.0
    probes = 1
    while probes < max_probes:
        t = 0.5 * (lo + hi) if hi - lo > 1e-6 * hi else float(np.nextafter(hi, -np.inf))
        if t <= lo:
            break
        probes += 1
        found = prober.probe(*caps_of(t))
        if found is None:
            lo = t
        else:
            best, hi = found, min(hi, measure(found))
    return hi, best, probes


def pareto_partitions(
    cm: CostModel, max_points: int = 6, max_work: float = 3e7
) -> tuple[list[list[int]], bool]:
    """Partitions on the Pareto frontier of (max forward part, max backward part).

    GPipe's fill-drain time on dedicated devices is ``sum + (M-1) (max_s f_s + max_s q_s)``
    (f = forward + send, q = recompute + backward), so when the stage with the largest f is not
    the one with the largest q the min-bottleneck partition need not be the fastest. Walks the
    frontier from the smallest max f: (min f s.t. q <= Q) then (min q s.t. f <= F), each by
    parametric search. Returns the partitions and whether the walk reached the end of the
    frontier (False if it stopped at ``max_points`` or after ``max_work`` probe x K x N units
    of work, a deterministic budget). O(points x probes x K N log N).
    """
    budget = int(max_work / (cm.num_stages * cm.n_units))
    if budget < 60:  # not even one frontier point (two parametric searches): do not start
        return [], False
    prober = _Prober(cm)

    def f_part(bounds: list[int]) -> float:
        return max(c.forward_s + c.send_s for c in cm.stage_costs(bounds))

    def q_part(bounds: list[int]) -> float:
        return max(c.recompute_s + c.backward_s for c in cm.stage_costs(bounds))

    out: list[list[int]] = []
    q_limit = math.inf
    for _ in range(max_points):
        if budget <= 0:
            return out, False

        def forward_caps(v: float, q: float = q_limit) -> Caps:
            return (math.inf, v, q)

        got = _parametric(prober, f_part, forward_caps, budget)
        if got is None:
            return out, True
        f_star, _, used = got
        budget -= used

        def backward_caps(v: float, f: float = f_star) -> Caps:
            return (math.inf, f, v)

        second = _parametric(prober, q_part, backward_caps, max(budget, 1))
        assert second is not None  # f_star is attained, so the uncapped probe succeeds
        q_star, bounds, used = second
        budget -= used
        out.append(bounds)
        q_limit = float(np.nextafter(q_star, -np.inf))
    return out, False
