"""The min-bottleneck partition as a mixed-integer linear program (PuLP + bundled CBC).

Torch-free. Same problem as ``partition.dp_partition`` (used to cross-check it, and selectable
as ``strategy="ilp"``):

* ``d[s, p]`` binary: stage ``s`` (0..K-2) ends at position ``p``; one per stage; cut ``s+1``
  lies strictly after cut ``s`` (cumulative form, tighter than comparing positions).
* With ``checkpoint="auto"``: ``c[s]`` binary (stage ``s`` checkpointed) and ``r[s] >= 0`` its
  recompute time, ``r[s] >= rec_s - BigT (1 - c[s])`` (``rec_s``: the stage's forward plus its
  units' ``full_recompute_extra_s``); the kept-activation memory row is
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import pulp
from autopipe.planner.chain import Partition, bottleneck
from autopipe.planner.costs import CostModel, stage_memory


def ilp_partition(cm: CostModel, *, time_limit_s: float = 30.0) -> Partition | None:
    """Solve the min-bottleneck partition with CBC; None if infeasible (or no solution in time)."""
    with warnings.catch_warnings():
        # PuLP 3.x flags the 2.x API (LpVariable, PULP_CBC_CMD) that pyproject still allows.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(cm, time_limit_s)


def _solve(cm: CostModel, time_limit_s: float) -> Partition | None:
    """Build the program (cuts, then each stage's rows), run CBC, read the cut back."""
    x_all = cm.fwd_prefix + cm.bwd_prefix
    scale = 1.0 / max(float(x_all[-1]) / cm.num_stages, 1e-300)  # ~1 for a balanced stage
    prob = pulp.LpProblem("autopipe_partition", pulp.LpMinimize)
    t_var = pulp.LpVariable("T", lowBound=0)
    prob += t_var
    cuts = _cut_variables(prob, cm.n_units, cm.num_stages)
    for s in range(cm.num_stages):
        _add_stage(prob, t_var, cm, cuts, s, scale)
    log_text = _run_cbc(prob, time_limit_s)
    return _read_partition(prob, cm, cuts, scale, log_text)


def _cut_variables(prob: Any, n: int, k: int) -> list[dict[int, Any]]:
    """``d[s, p]`` for every cut ``s`` (one position each, strictly after the previous cut),
    framed by the fixed ends: position 0 before stage 0 and ``n`` after stage ``k - 1``."""
    # Cut s may sit at positions s+1 .. N-(K-1-s) so that every stage keeps a unit.
    cuts: list[dict[int, Any]] = [{0: 1}]  # stage -1 "ends" at position 0
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
    return cuts


def _lin(d: dict[int, Any], values: Any) -> Any:  # PuLP expressions are untyped
    """``sum_p values[p] d[p]``: a prefix-sum array read at the cut ``d``."""
    return pulp.lpSum(float(values[p]) * v for p, v in d.items())


@dataclass
class _StageExprs:
    """One stage's terms: times scaled to O(1), memory rows as shares of the stage's limit."""

    base: Any
    """Forward, backward and send of the stage (scaled seconds)."""
    fwd: Any
    """The forward alone: what a checkpointed stage computes again (scaled seconds)."""
    limit: float
    """Bytes the stage may use (inf: no memory rows)."""
    n_s: float
    n_full: float
    state: Any
    """Training-state bytes of the stage's parameters."""
    mem_a: Any | None
    """Kept activations' memory share (None without a limit)."""
    mem_b: Any | None
    """Re-materialized per stage: memory share (None without a limit)."""


def _stage_exprs(cm: CostModel, cuts: list[dict[int, Any]], s: int, scale: float) -> _StageExprs:
    """Stage ``s``'s time and memory expressions between its two cuts."""
    n = cm.n_units
    x_fwd = cm.rec_prefix  # what checkpointing re-runs: the forward (and its extra)
    x_all = cm.fwd_prefix + cm.bwd_prefix
    start, end = cuts[s], cuts[s + 1]
    v = float(cm.speed[s])
    send = cm.send_s(s, np.arange(n + 1))
    base = (_lin(end, x_all) - _lin(start, x_all)) * (scale / v) + _lin(end, send * scale)
    fwd = (_lin(end, x_fwd) - _lin(start, x_fwd)) * (scale / v)
    limit = cm.capacity_bytes[s] / (1.0 + cm.headroom)
    n_s = float(cm.inflight[s])
    n_full = float(cm.full_inflight[s])
    mem = _stage_memory(cm, start, end, n_s, n_full, None)
    state = mem.state_bytes
    mem_a = (state + mem.kept_bytes) * (1.0 / limit) if math.isfinite(limit) else None
    # Checkpointed: one micro-batch's activations plus every in-flight stage input.
    mem_b = (state + mem.per_stage_bytes) * (1.0 / limit) if math.isfinite(limit) else None
    return _StageExprs(base, fwd, limit, n_s, n_full, state, mem_a, mem_b)


def _stage_memory(
    cm: CostModel,
    start: dict[int, Any],
    end: dict[int, Any],
    n_s: float,
    n_full: float,
    largest_unit_bytes: Any,
) -> Any:
    """The stage between the cuts ``start`` and ``end`` as :func:`costs.stage_memory`'s
    linear expressions (``largest_unit_bytes``: the variable bounding its largest unit)."""
    r = cm.ratio
    return stage_memory(
        _lin(end, cm.state_prefix) - _lin(start, cm.state_prefix),
        (_lin(end, cm.act_prefix) - _lin(start, cm.act_prefix)) * r,
        _lin(start, cm.cut_bytes_at) * r,
        (_lin(end, cm.unit_input_prefix) - _lin(start, cm.unit_input_prefix)) * r,
        largest_unit_bytes,
        n_s,
        n_full,
    )


@dataclass
class _PerUnitRows:
    """Per-unit re-materialization of one stage: its memory share and the switch ``g``."""

    mem_u: Any
    g: Any
    """Binary: 1 = per unit (its row binds), 0 = per stage."""
    big_u: float
    """Big-M that relaxes whichever granularity's row is not chosen."""


def _per_unit_rows(
    prob: Any, cm: CostModel, cuts: list[dict[int, Any]], s: int, e: _StageExprs
) -> _PerUnitRows:
    """Per unit: every unit's input in flight, plus the largest unit's activations (``top``
    >= each unit's that the stage holds: ``held`` is 1 inside it). Adds the ``held`` rows."""
    start, end = cuts[s], cuts[s + 1]
    limit, n_s, n_full = e.limit, e.n_s, e.n_full
    top = pulp.LpVariable(f"m_{s}", lowBound=0)
    held: Any = 0  # 1 exactly while unit p is on the stage: started, not ended
    for p in range(cm.n_units):
        step = held + start.get(p, 0) - end.get(p, 0)
        held = pulp.LpVariable(f"h_{s}_{p}")
        prob += held == step  # a running sum: O(1) terms per row
        weight = float(cm.unit_activation_bytes[p]) * cm.ratio * n_full / limit
        if weight > 0:
            prob += top >= weight * held
    # top is the largest unit's share of the limit: limit / n_full of its bytes
    mem = _stage_memory(cm, start, end, n_s, n_full, top * (limit / n_full) if n_full else 0)
    mem_u = (mem.state_bytes + mem.per_unit_bytes) * (1.0 / limit)
    # g = 1: per unit. Either granularity's memory row may be relaxed, not both.
    g = pulp.LpVariable(f"g_{s}", cat="Binary")
    big_u = float(
        (
            cm.state_prefix[-1]
            + cm.act_prefix[-1] * cm.ratio * n_full
            + cm.unit_input_prefix[-1] * cm.ratio * n_s
            + cm.cut_bytes_at.max() * cm.ratio * n_s
        )
        / limit
    )
    return _PerUnitRows(mem_u, g, big_u)


def _add_stage(
    prob: Any, t_var: Any, cm: CostModel, cuts: list[dict[int, Any]], s: int, scale: float
) -> None:
    """Stage ``s``'s rows: ``T`` bounds its time, its memory fits, as its options allow."""
    e = _stage_exprs(cm, cuts, s, scale)
    opts = cm.options[s]
    unit = None
    if e.mem_b is not None and "B" in opts and _unit_can_matter(cm, s, e.limit):
        unit = _per_unit_rows(prob, cm, cuts, s, e)
    whole_a = cm.state_prefix[-1] + cm.act_prefix[-1] * cm.ratio * e.n_s
    if opts == "AB" and whole_a <= e.limit:
        opts = "A"  # even the whole chain keeps its activations here: auto never checkpoints
    if opts == "A":
        prob += t_var >= e.base
        if e.mem_a is not None:
            prob += e.mem_a <= 1.0
    elif opts == "B":
        prob += t_var >= e.base + e.fwd
        if e.mem_b is not None and unit is not None:
            prob += e.mem_b <= 1.0 + unit.big_u * unit.g
            prob += unit.mem_u <= 1.0 + unit.big_u * (1 - unit.g)
        elif e.mem_b is not None:
            prob += e.mem_b <= 1.0
    else:
        _add_auto_rows(prob, t_var, cm, s, scale, e, unit)


def _add_auto_rows(
    prob: Any,
    t_var: Any,
    cm: CostModel,
    s: int,
    scale: float,
    e: _StageExprs,
    unit: _PerUnitRows | None,
) -> None:
    """``checkpoint="auto"``: ``c = 1`` checkpoints stage ``s``. Big-M rows switch the
    recompute time and the memory row; the recompute variable can never go negative in the
    LP relaxation."""
    c = pulp.LpVariable(f"c_{s}", cat="Binary")
    rec = pulp.LpVariable(f"r_{s}", lowBound=0)
    big_t = float(cm.rec_prefix[-1]) * scale / float(cm.speed[s])
    prob += rec >= e.fwd - big_t * (1 - c)
    prob += t_var >= e.base + rec
    if e.mem_a is None:
        return
    n_s = e.n_s
    big_m = (
        float(
            cm.state_prefix[-1]
            + cm.act_prefix[-1] * cm.ratio * n_s
            + cm.cut_bytes_at.max() * cm.ratio * n_s
            + cm.act_prefix[-1] * cm.ratio * float(cm.full_inflight[s])
        )
        / e.limit
    )
    prob += e.mem_a <= 1.0 + big_m * c
    if e.mem_b is not None and unit is not None:
        prob += e.mem_b <= 1.0 + big_m * (1 - c) + unit.big_u * unit.g
        prob += unit.mem_u <= 1.0 + big_m * (1 - c) + unit.big_u * (1 - unit.g)
    elif e.mem_b is not None:
        prob += e.mem_b <= 1.0 + big_m * (1 - c)


def _run_cbc(prob: Any, time_limit_s: float) -> str:
    """Solve ``prob`` with the bundled CBC to a zero gap; the text of CBC's log."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, logPath=log)
        prob.solve(solver)
        return open(log).read() if os.path.exists(log) else ""


def _read_partition(
    prob: Any, cm: CostModel, cuts: list[dict[int, Any]], scale: float, log_text: str
) -> Partition | None:
    """The cut CBC chose, priced by the cost model; a solution stopped early by the time
    limit carries its gap to CBC's lower bound. None without a (finite) solution."""
    n, k = cm.n_units, cm.num_stages
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
        found = re.search(r"Lower bound:\s*([-+0-9.eE]+)", log_text)
        bound_s = float(found.group(1)) / scale if found else 0.0
        gap = max(0.0, (value - bound_s) / value) if value > 0 else 0.0
    return Partition(bounds, value, "ilp", optimality_gap=gap)


def _unit_can_matter(cm: CostModel, s: int, limit: float) -> bool:
    """Whether some segment fits stage ``s`` re-materialized per unit but not per stage: only
    then do the per-unit rows change the feasible set (else they are left out, exactly).
    O(N^2) numpy."""
    mem = cm._memory_matrix(s)
    state, act_s, act_u = mem.state_bytes, mem.per_stage_bytes, mem.per_unit_bytes
    valid = ~np.tri(cm.n_units + 1, dtype=bool)
    return bool(np.any(valid & (state + act_u <= limit) & (state + act_s > limit)))


def _value(x: object) -> float:
    return float(x) if isinstance(x, int | float) else float(pulp.value(x) or 0.0)
