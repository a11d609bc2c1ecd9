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
from autopipe.planner.layers import LayerStack, layer_stack

from autopipe.core.profile import Profile
from autopipe.core.vocabulary import FRAMEWORK_DEFAULTS, SINGLE_SCHEDULES


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


# The split each framework makes when the user gives it no split, under the schedule and
# stages per rank it would run (docs/frameworks.md, with the version each rule was read from).
# The layer-counting rules count layers of the model's one stack (planner/layers.py); the
# embedding goes with the first stage and the head with the last, as all of them place those.
# (torch.distributed.pipelining has no default split: pipeline() without split points gives
# one stage, so there is no torch row.) The names: autopipe.core.vocabulary.FRAMEWORK_DEFAULTS.

# Megatron-Core runs 1F1B, interleaved with virtual stages; nothing else.
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


def framework_shape(name: str, schedule: str, virtual_stages: int) -> tuple[str, int] | str:
    """``(schedule, stages per rank)`` framework ``name`` runs when asked for the plan's
    ``schedule`` (with the plan's ``virtual_stages``), or one line saying why it cannot.

    - torchtitan 0.2.2 (``pipeline_llm`` without ``pipeline_parallel_layers_per_stage``):
      the plan's schedule (it takes every torch schedule) with 1 stage per rank for the
      single-stage schedules (GPipe, 1F1B) and 2 for the multi-stage ones, whatever V the
      plan chose.
    - Megatron-Core 0.16: only 1F1B and interleaved 1F1B, with the plan's V.
    - DeepSpeed 0.19 (``PipelineEngine``'s ``TrainSchedule``): its own 1F1B, one stage per
      rank, whatever the plan's schedule.
    O(1)."""
    if name == "torchtitan-even":
        return schedule, 1 if schedule in SINGLE_SCHEDULES else 2
    if name == "megatron-uniform":
        if schedule not in MEGATRON_SCHEDULES:
            return f"Megatron-Core has no {schedule} schedule (only 1F1B and interleaved 1F1B)"
        return schedule, virtual_stages
    if name == "deepspeed-parameters":
        return "1f1b", 1
    raise ValueError(f"unknown framework default {name!r}")


def deepspeed_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` rule (``deepspeed/runtime/utils.py``, 0.19.8), from
    its description and behaviour: ``num_parts + 1`` bounds of contiguous parts that minimize
    the spread ``max(part sum) - min(part sum)`` (not the maximum), by dynamic programming
    over (items, parts); among equal spreads the last cut position wins, and with no more
    items than parts it falls back to the uniform split (``min(p, n)`` per bound). Parts may
    be empty when the spread says so, as in DeepSpeed. O(n^2 x parts) in numpy."""
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, float))])
    inf = np.inf
    # spread[i, j]: best spread of the first i items in j parts; hi/lo that part's max/min sum.
    spread = np.full((n + 1, m + 1), inf)
    hi = np.full((n + 1, m + 1), inf)
    lo = np.full((n + 1, m + 1), inf)
    cut = np.zeros((n + 1, m + 1), dtype=int)
    spread[0, 0] = 0.0
    hi[0, 0] = 0.0
    for i in range(1, n + 1):
        last = prefix[i] - prefix[:i]  # the last part's sum for each cut k in [0, i)
        for j in range(1, min(i, m) + 1):
            top = np.maximum(hi[:i, j - 1], last)
            bottom = np.minimum(lo[:i, j - 1], last)
            with np.errstate(invalid="ignore"):
                cost = top - bottom
            cost = np.where(np.isnan(cost), inf, cost)
            best = float(cost.min())
            k = int(np.flatnonzero(cost == best)[-1])  # ties: the last k, as DeepSpeed's >=
            spread[i, j], hi[i, j], lo[i, j], cut[i, j] = best, top[k], bottom[k], k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(int(cut[bounds[-1], j]))
    return bounds[::-1]


def _layer_bounds(stack: LayerStack, layers: Sequence[int]) -> list[int] | None:
    """Bounds from per-stage layer counts (the first stage also holds the units before the
    stack, the last those after); None if a stage would hold nothing."""
    bounds = [0]
    at = stack.start
    for count in layers[:-1]:
        at += count
        bounds.append(at)
    bounds.append(stack.num_units)
    return bounds if all(b < c for b, c in zip(bounds, bounds[1:], strict=False)) else None


def framework_default_bounds(
    name: str, profile: Profile, num_stages: int
) -> tuple[list[int] | None, str]:
    """``(bounds, "")`` of the split framework ``name`` makes by default into ``num_stages``
    pipeline stages (all ``K x V`` of them, in model order), or ``(None, why)`` where it
    makes none for this model (no single layer stack, too few layers, ...).

    - ``torchtitan-even``: torchtitan 0.2.2's ``generate_llm_fqn_per_model_part`` with its
      default ``pipeline_parallel_first/last_stage_less_layers = 1``: the embedding and the
      output count as one layer each, the L + 2 "layers" are spread evenly (the first
      stages take the remainder), and the first and last stage hold one transformer layer
      fewer; it refuses more stages than L + 2.
    - ``megatron-uniform``: Megatron-Core's default without a layout, ``num_layers /
      (pipeline size x virtual stages)`` decoder layers per stage; it refuses a layer count
      the stage count does not divide.
    - ``deepspeed-parameters``: DeepSpeed ``PipelineModule(partition_method="parameters")``:
      :func:`deepspeed_partition_balanced` over each unit's parameter count (DeepSpeed counts
      the trainable parameters of each layer of its list; the units are that list).
    O(units) (DeepSpeed's rule O(units^2 x stages)).
    """
    if name == "deepspeed-parameters":
        counts = [u.parameter_count for u in profile.units]
        bounds = deepspeed_partition_balanced(counts, num_stages)
        if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
            return None, f"leaves a stage empty ({len(counts)} layers over {num_stages} stages)"
        return bounds, ""
    if name not in FRAMEWORK_DEFAULTS:
        raise ValueError(f"unknown framework default {name!r}")
    stack = layer_stack(profile.unit_names)
    if stack is None:
        return None, "splits the layers of one stack, and this model has no single one"
    n, k = stack.num_layers, num_stages
    if name == "megatron-uniform":
        if n % k:
            return None, f"needs the {n} layers divisible by {k} stages"
        layers = [n // k] * k
    else:  # torchtitan-even
        effective = n + 2
        if k > effective:
            return None, f"refuses {k} stages for {n} layers + embedding + output"
        layers = [effective // k + (1 if s < effective % k else 0) for s in range(k)]
        layers[0] -= 1
        layers[-1] -= 1
        if k == 1:
            layers = [n]
    layer_bounds = _layer_bounds(stack, layers)
    if layer_bounds is None:
        return None, f"leaves a stage empty ({n} layers over {k} stages)"
    return layer_bounds, ""
