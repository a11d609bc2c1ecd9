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
from autopipe.profiler.profile_data import Profile


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


# The split each framework makes when the user gives it no split (docs/frameworks.md). They
# count layers of the model's one stack (planner/layers.py); the embedding goes with the
# first stage and the head with the last, as all of them place those.
FRAMEWORK_DEFAULTS = ("torchtitan-even", "megatron-uniform", "deepspeed-parameters", "torch-even")


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
    """``(bounds, "")`` of the split framework ``name`` makes by default, or ``(None, why)``
    where it makes none for this model (no single layer stack, too few layers, ...).

    - ``torchtitan-even``: torchtitan's ``generate_llm_fqn_per_model_part`` with its default
      ``pipeline_parallel_first/last_stage_less_layers = 1``: the embedding and the output
      count as one layer each, the L + 2 "layers" are spread evenly (the first stages take
      the remainder), and the first and last stage hold one transformer layer fewer.
    - ``megatron-uniform``: Megatron-Core's default, ``num_layers / pipeline size`` decoder
      layers per stage; it refuses a layer count the stage count does not divide.
    - ``deepspeed-parameters``: DeepSpeed ``PipelineModule(partition_method="parameters")``,
      contiguous parts with balanced parameter counts (the ``parameters`` baseline).
    - ``torch-even``: the manual even split of the torch.distributed.pipelining examples,
      ``ceil``-balanced layer counts with a ``SplitPoint.BEGINNING`` at each stage's first
      layer.
    O(units).
    """
    if name == "deepspeed-parameters":
        return baseline_bounds("parameters", profile, num_stages), ""
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
    elif name == "torch-even":
        layers = [n // k + (1 if s < n % k else 0) for s in range(k)]
    else:  # torchtitan-even
        effective = n + 2
        layers = [effective // k + (1 if s < effective % k else 0) for s in range(k)]
        layers[0] -= 1
        layers[-1] -= 1
        if k == 1:
            layers = [n]
        if min(layers) < 0:
            return None, f"has too few layers ({n}) for {k} stages"
    bounds = _layer_bounds(stack, layers)
    if bounds is None:
        return None, f"leaves a stage empty ({n} layers over {k} stages)"
    return bounds, ""
