"""Baseline partitioners that peers use, implemented from their public descriptions.

Torch-free. Each returns ``bounds`` (K + 1 positions ``0 = p0 < ... < pK = N``) without looking
at memory, micro-batches or communication, as the originals do; the planner then evaluates
them under the full cost model.

* ``uniform``: equal unit counts (torch.distributed.pipelining / Megatron default splits).
* ``parameters``: contiguous parts with balanced parameter counts (DeepSpeed's default
  ``partition_method='parameters'``): the exact min-max of per-part parameter counts.
* ``greedy-time``: balance by measured time (torchgpipe's ``balance_by_time``): put stage
  boundary s where the running forward+backward time is closest to ``s x total / K``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from autopipe.profiler.profile import Profile


def uniform_bounds(n_units: int, num_stages: int) -> list[int]:
    """Equal unit counts, the first ``N mod K`` stages one unit longer. O(K)."""
    sizes = [
        n_units // num_stages + (1 if s < n_units % num_stages else 0) for s in range(num_stages)
    ]
    return [0, *np.cumsum(sizes).tolist()]


def minmax_weight_bounds(weights: Sequence[float], num_stages: int) -> list[int]:
    """Exact min-max contiguous partition of non-negative weights into K non-empty parts.

    Bisection on the part limit with a greedy probe (valid because weights are
    non-negative): O(N x 100) numpy-free Python work, fine for N up to 10^5.
    """
    w = [max(float(x), 0.0) for x in weights]
    n = len(w)

    def parts(limit: float) -> list[int] | None:
        bounds, acc = [0], 0.0
        for i, x in enumerate(w):
            if acc + x > limit and i > bounds[-1]:
                bounds.append(i)
                acc = 0.0
            acc += x
        bounds.append(n)
        return bounds if len(bounds) - 1 <= num_stages else None

    lo, hi = max(w, default=0.0), sum(w)
    best = parts(hi)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        got = parts(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    assert best is not None
    return _fill_to(best, num_stages)


def _fill_to(bounds: list[int], num_stages: int) -> list[int]:
    """Split parts with several units until there are exactly K (never raises a part's weight)."""
    bounds = list(bounds)
    while len(bounds) - 1 < num_stages:
        sizes = np.diff(bounds)
        s = int(np.argmax(sizes))  # the longest part surely has >= 2 units
        bounds.insert(s + 1, bounds[s] + int(sizes[s]) // 2)
    return bounds


def greedy_time_bounds(unit_times_s: Sequence[float], num_stages: int) -> list[int]:
    """Boundary s at the prefix whose running time is closest to ``s x total / K``. O(N + K log N)."""
    t = np.asarray(unit_times_s, float)
    n = t.size
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    total = prefix[-1]
    bounds = [0]
    for s in range(1, num_stages):
        target = s * total / num_stages
        j = int(np.searchsorted(prefix, target))
        # Take whichever neighbour position is closer to the target, then keep every stage non-empty.
        if j > 0 and (j > n or abs(prefix[j - 1] - target) <= abs(prefix[j] - target)):
            j -= 1
        j = min(max(j, bounds[-1] + 1), n - (num_stages - s))
        bounds.append(j)
    bounds.append(n)
    return bounds


def baseline_bounds(name: str, profile: Profile, num_stages: int) -> list[int]:
    """Bounds of baseline ``name`` ('uniform', 'parameters' or 'greedy-time')."""
    n = len(profile.units)
    if name == "uniform":
        return uniform_bounds(n, num_stages)
    if name == "parameters":
        counts = [u.parameter_count or u.parameter_bytes for u in profile.units]
        return minmax_weight_bounds(counts, num_stages)
    if name == "greedy-time":
        return greedy_time_bounds([u.forward_s + u.backward_s for u in profile.units], num_stages)
    raise ValueError(f"unknown baseline {name!r}")


BASELINES = ("uniform", "parameters", "greedy-time")
