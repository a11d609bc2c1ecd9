"""A partition of the unit chain and the helpers every partitioner shares. Torch-free.

A partition is given as ``bounds``: K + 1 positions ``0 = p0 < p1 < ... < pK = N``; stage
``s`` holds units ``bounds[s] .. bounds[s+1] - 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from autopipe.planner.costs import CostModel


@dataclass
class Partition:
    bounds: list[int]
    bottleneck_s: float
    algorithm: str = "dp"
    optimality_gap: float = 0.0
    """Relative gap between the solution and the best proven lower bound (0 when proven optimal)."""


def bottleneck(cm: CostModel, bounds: list[int]) -> float:
    """Largest stage time of a partition; ``inf`` if a stage does not fit in memory."""
    return max(cm.segment_time(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1))


def stage_key(cm: CostModel, s: int) -> tuple:
    # Stages with equal devices, in-flight count and options share one cost matrix.
    return (
        cm.speed[s],
        cm.capacity_bytes[s],
        cm.bandwidth_bytes_per_s[s],
        cm.latency_s[s],
        cm.inflight[s],
        cm.full_inflight[s],
        cm.options[s],
    )


def backtrack(preds: list[np.ndarray], n: int) -> list[int]:
    bounds = [n]
    for pred in reversed(preds):
        bounds.append(int(pred[bounds[-1]]))
    return bounds[::-1]


def minmax_dp(matrices: list[np.ndarray], n: int) -> tuple[float, list[int]] | None:
    """Min over partitions of the max over stages of ``matrices[s][i, j]`` (one ``(N+1) x (N+1)``
    matrix per stage, ``inf`` where a segment is invalid) and the bounds attaining it; None if
    every partition is inf. O(K N^2). The exact DP partition and the least memory need."""
    k = len(matrices)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    preds = []
    for s in range(k):
        rows = np.flatnonzero(np.isfinite(best))
        if rows.size == 0:
            return None
        cand = np.maximum(best[rows, None], matrices[s][rows])
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        preds.append(rows[arg])
    if not math.isfinite(best[n]):
        return None
    return float(best[n]), backtrack(preds, n)
