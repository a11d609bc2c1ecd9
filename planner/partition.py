"""Exact min-max contiguous partitioning of the unit chain into K stages (fixed M and schedule).

Torch-free. Exact algorithms over the same ``CostModel`` (so they agree to the bit):

* ``exact_partition`` (the ``dp`` strategy): the bottleneck by the probe search
  (``planner/probe.py``), then ``banded_tie_break``: among partitions with that bottleneck,
  one with the least total stage time, by a min-sum DP over the band of segment lengths that
  can fit: O(K N W).
* ``dp_partition``: dynamic programming over cut positions. ``best[s][j]`` = smallest bottleneck
  placing units ``0..j-1`` on stages ``0..s-1``; one numpy min-max over an ``(N+1) x (N+1)`` cost
  matrix per stage: O(K N^2) time, O(N^2) memory, then the same tie-break. The reference (tests)
  and the fallback when the band is too wide.
* ``brute_force_partition``: all C(N-1, K-1) cut sets, for tests.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from autopipe.planner.chain import Partition, backtrack, bottleneck, minmax_dp, stage_key
from autopipe.planner.costs import CostModel
from autopipe.planner.probe import probe_partition

#: Above this many units the O(N^2) DP matrices are not used even as a fallback.
DP_MAX_UNITS = 2500


def _minsum_dp(matrices: list[np.ndarray], n: int, cap: float) -> list[int] | None:
    """Least sum of ``matrices[s][i, j]`` over partitions whose every entry is ``<= cap``."""
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    preds = []
    for mat in matrices:
        rows = np.flatnonzero(np.isfinite(best))
        if rows.size == 0:
            return None
        sub = mat[rows]
        cand = best[rows, None] + np.where(sub <= cap, sub, np.inf)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        preds.append(rows[arg])
    if not math.isfinite(best[n]):
        return None
    return backtrack(preds, n)


def dp_partition(cm: CostModel, *, tie_break: bool = True) -> Partition | None:
    """Exact min-bottleneck partition by DP; None if no partition fits in memory.

    O(K N^2) time (distinct stage kinds only build one matrix each), O(N^2) memory.
    """
    n, k = cm.n_units, cm.num_stages
    cache: dict[tuple, np.ndarray] = {}
    matrices = []
    for s in range(k):
        key = stage_key(cm, s)
        if key not in cache:
            cache[key] = cm.cost_matrix(s)
        matrices.append(cache[key])
    found = minmax_dp(matrices, n)
    if found is None:
        return None
    value, bounds = found
    if tie_break:
        better = _minsum_dp(matrices, n, value)
        if better is not None:
            bounds = better
    return Partition(bounds, bottleneck(cm, bounds), "dp")


def brute_force_partition(cm: CostModel) -> Partition | None:
    """Try every cut set: O(C(N-1, K-1) K). For tests on small instances only."""
    n, k = cm.n_units, cm.num_stages
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        value = bottleneck(cm, bounds)
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, bounds)
    if best is None:
        return None
    return Partition(best[1], best[0], "brute-force")


def banded_tie_break(cm: CostModel, cap_s: float, max_cells: int = 30_000_000) -> list[int] | None:
    """Least total stage time among partitions whose every stage time is ``<= cap_s``.

    A stage cannot be longer than the units whose forward+backward alone already exceed
    ``cap_s``, so segment ``[i, i+1+d)`` is only needed for ``d < W`` (W = the widest such run):
    a min-sum DP over an ``(N+1) x W`` band, O(K N W). Returns None if the band would exceed
    ``max_cells`` cells (e.g. many zero-time units) or nothing fits under the cap.
    """
    n, k = cm.n_units, cm.num_stages
    x = cm.fwd_prefix + cm.bwd_prefix
    pos = np.arange(n + 1)
    width = 1
    for v in set(cm.speed.tolist()):
        reach = np.searchsorted(x, x + v * cap_s * (1.0 + 1e-9), side="right") - 1
        width = max(width, int(np.max(reach - pos)))
    width = min(width, n)
    if (n + 1) * width > max_cells:
        return None
    dd = np.arange(width)[None, :]
    starts = pos[:, None] - 1 - dd  # segment start i for end j = row, length 1 + d
    valid = starts >= 0
    starts_c = np.maximum(starts, 0)
    ends = np.broadcast_to(pos[:, None], starts.shape)
    cache: dict[tuple, np.ndarray] = {}
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    preds = []
    rows = np.arange(n + 1)
    for s in range(k):
        key = stage_key(cm, s)
        if key not in cache:
            cost = cm.segment_times(s, starts_c, ends)
            cache[key] = np.where(valid & (cost <= cap_s), cost, np.inf)
        cand = best[starts_c] + cache[key]
        arg = np.argmin(cand, axis=1)
        best = cand[rows, arg]
        preds.append(starts_c[rows, arg])
    if not math.isfinite(best[n]):
        return None
    return backtrack(preds, n)


def exact_partition(cm: CostModel) -> Partition | None:
    """The ``dp`` strategy: exact bottleneck by the probe search, then the banded tie-break DP.

    Falls back to the full O(K N^2) DP when the band is too wide and N <= ``DP_MAX_UNITS``.
    """
    probe = probe_partition(cm)
    if probe is None:
        return None
    bounds = banded_tie_break(cm, probe.bottleneck_s)
    if bounds is None:
        if cm.n_units <= DP_MAX_UNITS:
            return dp_partition(cm)
        return probe
    return Partition(bounds, bottleneck(cm, bounds), "probe+banded-dp")
