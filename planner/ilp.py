"""The min-bottleneck partition as a mixed-integer linear program (PuLP + bundled CBC).

Torch-free. Same problem as ``partition.dp_partition`` (used to cross-check it, and selectable
as ``strategy="ilp"``):

* ``d[s, p]`` binary: stage ``s`` (0..K-2) ends at position ``p``; one per stage; cut ``s+1``
  lies strictly after cut ``s`` (cumulative form, tighter than comparing positions).
* With ``checkpoint="auto"``: ``c[s]`` binary (stage ``s`` checkpointed) and ``r[s] >= 0`` its
  recompute time, ``r[s] >= fwd_s - BigT (1 - c[s])``; the kept-activation memory row is
  relaxed by ``BigM c[s]`` and the checkpointed one by ``BigM (1 - c[s])``. Other modes fix the
  choice, so their rows are plain.
* Checkpointed stages: ``g[s]`` binary picks per-unit re-materialization (its row relaxed by
  ``BigM (1 - g[s])``, the per-stage one by ``BigM g[s]``); ``m[s] >= a_p x held[s, p]`` is
  the largest activation of the units it holds (``held[s, p]``: the cumulative cut sums, 1
  exactly when unit ``p`` is on stage ``s``).
* ``T >= time_s`` for every stage; memory of each stage ``<= limit_s``; minimise ``T``.

Times are scaled to O(1) and memory rows divided by their limit so that CBC's absolute
tolerances do not blur the optimum. Size: O(K N) variables and constraints.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from typing import Any

import numpy as np
import pulp
from autopipe.planner.chain import Partition, bottleneck
from autopipe.planner.costs import CostModel


def ilp_partition(cm: CostModel, *, time_limit_s: float = 30.0) -> Partition | None:
    """Solve the min-bottleneck partition with CBC; None if infeasible (or no solution in time)."""
    with warnings.catch_warnings():
        # PuLP 3.x flags the 2.x API (LpVariable, PULP_CBC_CMD) that pyproject still allows.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(cm, time_limit_s)


def _solve(cm: CostModel, time_limit_s: float) -> Partition | None:
    n, k = cm.n_units, cm.num_stages
    x_fwd = cm.fwd_prefix
    x_all = cm.fwd_prefix + cm.bwd_prefix
    scale = 1.0 / max(float(x_all[-1]) / k, 1e-300)  # ~1 for a balanced stage
    prob = pulp.LpProblem("autopipe_partition", pulp.LpMinimize)
    t_var = pulp.LpVariable("T", lowBound=0)
    prob += t_var

    # Cut s may sit at positions s+1 .. N-(K-1-s) so that every stage keeps a unit.
    cuts: list[dict[int, object]] = [{0: 1}]  # stage -1 "ends" at position 0
    for s in range(k - 1):
        dom = range(s + 1, n - (k - 1 - s) + 1)
        d = {p: pulp.LpVariable(f"d_{s}_{p}", cat="Binary") for p in dom}
        prob += pulp.lpSum(d.values()) == 1
        cuts.append(d)
    cuts.append({n: 1})
    for s in range(1, k - 1):  # cut s strictly after cut s-1: sum_{q<=p} d[s] <= sum_{q<p} d[s-1]
        prev, cur = cuts[s], cuts[s + 1]
        for p in cur:
            prob += pulp.lpSum(v for q, v in cur.items() if q <= p) <= pulp.lpSum(
                v for q, v in prev.items() if q < p
            )

    def lin(d: dict[int, Any], values: Any) -> Any:  # PuLP expressions are untyped
        return pulp.lpSum(float(values[p]) * v for p, v in d.items())

    for s in range(k):
        start, end = cuts[s], cuts[s + 1]
        opts = cm.options[s]
        v = float(cm.speed[s])
        send = cm.send_s(s, np.arange(n + 1))
        base = (lin(end, x_all) - lin(start, x_all)) * (scale / v) + lin(end, send * scale)
        fwd = (lin(end, x_fwd) - lin(start, x_fwd)) * (scale / v)
        limit = cm.capacity_bytes[s] / (1.0 + cm.headroom)
        n_s = float(cm.inflight[s])
        state = (lin(end, cm.param_prefix) - lin(start, cm.param_prefix)) * cm.state_factor
        act_one = (lin(end, cm.act_prefix) - lin(start, cm.act_prefix)) * cm.ratio
        mem_a = (state + act_one * n_s) * (1.0 / limit) if math.isfinite(limit) else None
        # Checkpointed: one micro-batch's activations plus every in-flight stage input.
        inputs = lin(start, cm.cut_bytes_at) * (cm.ratio * n_s)
        n_full = float(cm.full_inflight[s])
        mem_b = (
            (state + act_one * n_full + inputs) * (1.0 / limit) if math.isfinite(limit) else None
        )
        mem_u = None
        if mem_b is not None and "B" in opts and _unit_can_matter(cm, s, limit):
            # Per unit: every unit's input in flight, plus the largest unit's activations
            # (``top`` >= each unit's that the stage holds: ``held`` is 1 inside it).
            top = pulp.LpVariable(f"m_{s}", lowBound=0)
            held: Any = 0  # 1 exactly while unit p is on the stage: started, not ended
            for p in range(n):
                step = held + start.get(p, 0) - end.get(p, 0)
                held = pulp.LpVariable(f"h_{s}_{p}")
                prob += held == step  # a running sum: O(1) terms per row
                weight = float(cm.unit_activation_bytes[p]) * cm.ratio * n_full / limit
                if weight > 0:
                    prob += top >= weight * held
            kept = (lin(end, cm.unit_input_prefix) - lin(start, cm.unit_input_prefix)) * (
                cm.ratio * n_s / limit
            )
            mem_u = state * (1.0 / limit) + kept + top
            # g = 1: per unit. Either granularity's memory row may be relaxed, not both.
            g = pulp.LpVariable(f"g_{s}", cat="Binary")
            big_u = float(
                (
                    cm.param_prefix[-1] * cm.state_factor
                    + cm.act_prefix[-1] * cm.ratio * n_full
                    + cm.unit_input_prefix[-1] * cm.ratio * n_s
                    + cm.cut_bytes_at.max() * cm.ratio * n_s
                )
                / limit
            )
        whole_a = cm.param_prefix[-1] * cm.state_factor + cm.act_prefix[-1] * cm.ratio * n_s
        if opts == "AB" and whole_a <= limit:
            opts = "A"  # even the whole chain keeps its activations here: auto never checkpoints
        if opts == "A":
            prob += t_var >= base
            if mem_a is not None:
                prob += mem_a <= 1.0
        elif opts == "B":
            prob += t_var >= base + fwd
            if mem_b is not None and mem_u is not None:
                prob += mem_b <= 1.0 + big_u * g
                prob += mem_u <= 1.0 + big_u * (1 - g)
            elif mem_b is not None:
                prob += mem_b <= 1.0
        else:
            # c = 1: checkpointed. Big-M rows switch the recompute time and the memory row;
            # the recompute variable can never go negative in the LP relaxation.
            c = pulp.LpVariable(f"c_{s}", cat="Binary")
            rec = pulp.LpVariable(f"r_{s}", lowBound=0)
            big_t = float(x_fwd[-1]) * scale / v
            prob += rec >= fwd - big_t * (1 - c)
            prob += t_var >= base + rec
            if mem_a is not None:
                big_m = (
                    float(
                        cm.param_prefix[-1] * cm.state_factor
                        + cm.act_prefix[-1] * cm.ratio * n_s
                        + cm.cut_bytes_at.max() * cm.ratio * n_s
                        + cm.act_prefix[-1] * cm.ratio * float(cm.full_inflight[s])
                    )
                    / limit
                )
                prob += mem_a <= 1.0 + big_m * c
                if mem_b is not None and mem_u is not None:
                    prob += mem_b <= 1.0 + big_m * (1 - c) + big_u * g
                    prob += mem_u <= 1.0 + big_m * (1 - c) + big_u * (1 - g)
                elif mem_b is not None:
                    prob += mem_b <= 1.0 + big_m * (1 - c)

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, logPath=log)
        prob.solve(solver)
        text = open(log).read() if os.path.exists(log) else ""
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    bounds = [0]
    for s in range(1, k):
        bounds.append(max(cuts[s].items(), key=lambda kv: _value(kv[1]))[0])
    bounds.append(n)
    value = bottleneck(cm, bounds)
    if not math.isfinite(value):
        return None
    gap = 0.0
    if prob.sol_status != pulp.LpSolutionOptimal:
        found = re.search(r"Lower bound:\s*([-+0-9.eE]+)", text)
        bound_s = float(found.group(1)) / scale if found else 0.0
        gap = max(0.0, (value - bound_s) / value) if value > 0 else 0.0
    return Partition(bounds, value, "ilp", optimality_gap=gap)


def _unit_can_matter(cm: CostModel, s: int, limit: float) -> bool:
    """Whether some segment fits stage ``s`` re-materialized per unit but not per stage: only
    then do the per-unit rows change the feasible set (else they are left out, exactly).
    O(N^2) numpy."""
    state, act_one = cm._memory_parts()
    r, n_s, n_full = cm.ratio, cm.inflight[s], cm.full_inflight[s]
    u = cm.unit_input_prefix
    act_s = act_one * n_full + (cm.cut_bytes_at * r * n_s)[:, None]
    act_u = cm.unit_activation_max_matrix() * r * n_full + (u[None, :] - u[:, None]) * r * n_s
    valid = ~np.tri(cm.n_units + 1, dtype=bool)
    return bool(np.any(valid & (state + act_u <= limit) & (state + act_s > limit)))


def _value(x: object) -> float:
    return float(x) if isinstance(x, int | float) else float(pulp.value(x) or 0.0)
