"""``plan``: choose schedule, virtual stages, chunks, micro-batch count and checkpointing
together.

Torch-free. Every (schedule, V, M) that breaks none of torch's rules
(:mod:`autopipe.core.schedule_rules`) is a candidate; one that does is skipped, and a request
that leaves only such candidates is refused with the rule's one-line message
(:class:`~autopipe.planner.errors.RuleViolation`). For each candidate the chosen strategy cuts
the model into ``K x V`` chunks with the smallest bottleneck chunk time under the memory
limits (exact for ``dp``, ``ilp`` and ``brute-force``, each chunk priced on its rank's device
with the schedule's own in-flight counts); the simulator (:mod:`autopipe.planner.simulate`)
then gives the iteration time and replays every rank's memory, and the fastest candidate
whose ranks all fit wins.

- V = 1 (GPipe, 1F1B and the looped schedules with one chunk per rank): the min-bottleneck
  partition is exact, and GPipe's fill-drain time is made exact by the frontier walk.
- V > 1: the method is "exact min-bottleneck over the ``K x V`` chunks, then simulated
  local search" (:func:`_refine_chunks`): not proven optimal, so every plan records
  :func:`autopipe.planner.chunks.lower_bound_s` (a proven bound on any cut of that schedule,
  V and M) and the gap to it (``Plan.lower_bound_s``, ``Plan.lower_bound_gap``).

Cost: #candidates x (partition + O(T) simulation, T = tasks ~ 3 K V M), plus the
refinements' simulations for the few candidates that could still win.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

from autopipe.planner.assemble import build_plan
from autopipe.planner.baselines import BASELINES, baseline_bounds
from autopipe.planner.candidate import Candidate
from autopipe.planner.chain import Partition, bottleneck
from autopipe.planner.chunks import ScheduleShape, cost_model_for, lower_bound_s
from autopipe.planner.costs import CostModel
from autopipe.planner.errors import PlanningError, RuleViolation
from autopipe.planner.partition import brute_force_partition, exact_partition
from autopipe.planner.probe import (
    memory_floor,
    min_memory_needed,
    no_cut_within,
    pareto_partitions,
)

from autopipe.core.cluster import Cluster
from autopipe.core.humanize import format_bytes
from autopipe.core.optimizer import (
    AUTO,
    OPTIMIZERS,
    default_optimizer,
    training_state_bytes_per_parameter,
)
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import check_virtual_stages, preflight, violations
from autopipe.core.schedules import virtual_stage_choices
from autopipe.core.trainer_options import TrainerOptions
from autopipe.core.vocabulary import CHECKPOINT_MODES, PLAN_SCHEDULES

STRATEGIES = ("dp", "ilp", "brute-force", *BASELINES)
EXACT_STRATEGIES = ("dp", "ilp", "brute-force")
_SOLVER_WORDS = {"dp": "dynamic programming", "ilp": "ILP", "brute-force": "brute force"}
"""The exact solvers in words: a report's "dp" would read as data parallel."""
"""The strategies whose partition has the smallest bottleneck (ILP: when it closed its gap)."""
_BRUTE_FORCE_MAX = 2_000_000


MAX_AUTO_MICROBATCHES = 4096
"""``microbatches="auto"`` tries the divisors of the batch size up to this many: beyond it
per-call overhead dominates any bubble saved, and 1F1B's simulation is O(K M log K)."""


def divisors(n: int, up_to: int | None = None) -> list[int]:
    """The positive divisors of ``n >= 1`` that are at most ``up_to`` (default: all), in
    increasing order, in O(min(up_to, sqrt(n))) steps: a batch size of 10^24 with
    ``up_to=4096`` takes 4096 trial divisions, not 10^12."""
    limit = n if up_to is None else min(up_to, n)
    root = math.isqrt(n)
    small = [d for d in range(1, min(root, limit) + 1) if n % d == 0]
    if limit <= root:  # every divisor <= limit was tried directly
        return small
    large = [n // d for d in reversed(small) if d * d != n and n // d <= limit]
    return small + large


def microbatch_counts(batch_size: int, candidates: Sequence[int] | None = None) -> list[int]:
    """The micro-batch counts M a search of ``batch_size`` samples tries, in increasing
    order: the ``candidates`` given that divide it, or (None: ``auto``) every divisor up to
    ``MAX_AUTO_MICROBATCHES``. The one enumeration of M: the pipeline search, the mesh's
    lower bounds and its per-M searches. O(min(MAX_AUTO_MICROBATCHES, sqrt(batch_size)))."""
    if candidates is None:
        return divisors(batch_size, up_to=MAX_AUTO_MICROBATCHES)
    return [m for m in candidates if batch_size % m == 0]


_HINT_SEARCH_LIMIT = 1 << 20
"""The largest divisor :func:`divisor_hint` looks for (bounded work for any batch size)."""


def divisor_hint(n: int, near: int, count: int = 6) -> str:
    """``"pick a divisor (e.g. 4, 8, 16)"``: the ``count`` divisors of ``n`` closest to
    ``near``, in increasing order, for the errors about a micro-batch count that does not
    divide the batch size (the planner's and the CLI's).

    Looks up to ``2 * near + count``, then 4 times as far while fewer than ``count`` turn up
    (exact: any divisor further out is further from ``near`` than all found), but never
    past ``_HINT_SEARCH_LIMIT``: a huge prime batch size gets the divisors found by then."""
    up_to = 2 * near + count
    found = divisors(n, up_to=up_to)
    while len(found) < count and up_to < min(n, _HINT_SEARCH_LIMIT):
        up_to = min(4 * up_to, _HINT_SEARCH_LIMIT)
        found = divisors(n, up_to=up_to)
    nearest = sorted(sorted(found, key=lambda d: abs(d - near))[:count])
    return f"pick a divisor (e.g. {', '.join(map(str, nearest))})"


def _positive_int(name: str, value: object) -> int:
    """``value`` as a Python int (numpy integers welcome); PlanningError unless it is >= 1."""
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        out = 0
    if isinstance(value, bool) or out < 1:
        raise PlanningError(f"{name}={value!r} must be a positive integer")
    return out


def training_state(
    profile: Profile, optimizer: str = "auto", bytes_per_parameter: float | None = None
) -> tuple[str, float]:
    """``(optimizer, bytes per parameter)`` the plan charges for parameters, gradients and
    optimizer state (docs/cost-model.md).

    ``bytes_per_parameter`` wins (the optimizer is then reported as ``"custom"``). ``"auto"``
    takes the profile's choice when it was made explicitly (``autopipe profile --optimizer``
    / ``--bytes-per-parameter``), else the default for the profile's parameter size:
    mixed-precision Adam (16 bytes) for 16-bit parameters, Adam (16) for fp32. O(1).
    """
    if bytes_per_parameter is not None:
        if not bytes_per_parameter > 0:
            raise PlanningError(f"bytes_per_parameter={bytes_per_parameter} must be positive")
        return "custom", float(bytes_per_parameter)
    key = optimizer.lower().replace("_", "-") if isinstance(optimizer, str) else optimizer
    _check_choice("optimizer", key, (AUTO, *OPTIMIZERS))
    parameter_size_bytes = max(int(profile.bytes_per_parameter), 1)
    if key == AUTO:
        if profile.optimizer_chosen:
            recorded = profile.state_bytes_per_parameter
            if recorded:
                return "custom", float(recorded)
            key = profile.optimizer
        else:
            key = default_optimizer(parameter_size_bytes)
    return key, float(training_state_bytes_per_parameter(key, parameter_size_bytes))


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise PlanningError(
            f"{name}={value!r} is not valid; use one of {', '.join(map(repr, allowed))}"
        )


def _resolve_cluster(
    profile: Profile, gpus: int | None, cluster: Cluster | None, memory_per_device: int | None
) -> Cluster:
    if (gpus is None) == (cluster is None):
        raise PlanningError("pass exactly one of gpus=K or cluster=Cluster(...)")
    if memory_per_device is not None and memory_per_device <= 0:
        raise PlanningError(
            f"memory_per_device={memory_per_device} must be a positive number of bytes"
        )
    if cluster is None:
        assert gpus is not None
        cluster = Cluster.homogeneous(
            _positive_int("gpus", gpus), profile.device, memory_per_device
        )
    elif memory_per_device is not None:
        # An explicit memory_per_device fills in devices whose memory is unknown.
        cluster = Cluster(
            [
                d
                if d.memory_bytes is not None
                else type(d)(**{**vars(d), "memory_bytes": memory_per_device})
                for d in cluster.devices
            ],
            cluster.host_throughput,
        )
    k = len(cluster)
    if k < 1:
        raise PlanningError("the cluster has no devices; give at least one")
    if k > len(profile.units):
        raise PlanningError(
            f"{k} stages need at least {k} units but the profile has {len(profile.units)}; "
            f"use at most {len(profile.units)} GPUs or profile with finer units"
        )
    if cluster.host_throughput is not None and not cluster.host_throughput > 0:
        raise PlanningError(
            f"host_throughput={cluster.host_throughput} must be > 0 devices' worth of compute "
            "(or None for dedicated devices)"
        )
    for d in cluster.devices:
        if d.speed <= 0 or d.link_bandwidth_bytes_per_s <= 0 or d.link_latency_s < 0:
            raise PlanningError(
                f"device {d.name!r} needs speed > 0, bandwidth > 0 and latency >= 0"
            )
    return cluster


def _candidate_microbatches(batch_size: int, microbatches: int | str | Sequence[int]) -> list[int]:
    if isinstance(microbatches, bool):
        raise PlanningError(f"microbatches={microbatches!r} must be a positive integer")
    if isinstance(microbatches, str) and microbatches.strip().isdigit():
        microbatches = int(microbatches)
    if isinstance(microbatches, str):
        if microbatches != "auto":
            raise PlanningError(
                f"microbatches={microbatches!r}: give 'auto', an integer or a list of integers"
            )
        return microbatch_counts(batch_size)
    try:
        values = [operator.index(microbatches)]  # type: ignore[arg-type]
    except TypeError:
        try:
            values = list(microbatches)  # type: ignore[arg-type]
        except TypeError:
            raise PlanningError(
                f"microbatches={microbatches!r}: give 'auto', an integer or a list of integers"
            ) from None
    if not values:
        raise PlanningError("microbatches is an empty list; give at least one candidate or 'auto'")
    values = [_positive_int("microbatches", m) for m in values]
    for m in values:
        if batch_size % m:
            raise PlanningError(
                f"microbatches={m} does not divide batch size {batch_size}; "
                + divisor_hint(batch_size, m)
            )
    return sorted(set(values))


def _partition(
    cm: CostModel, strategy: str, profile: Profile, time_limit_s: float
) -> Partition | None:
    if strategy == "dp":
        return exact_partition(cm)
    if strategy == "ilp":
        from autopipe.planner.ilp import ilp_partition  # PuLP only when asked for

        return ilp_partition(cm, time_limit_s=time_limit_s)
    if strategy == "brute-force":
        if math.comb(cm.n_units - 1, cm.num_stages - 1) > _BRUTE_FORCE_MAX:
            raise PlanningError(
                f"brute-force over C({cm.n_units - 1}, {cm.num_stages - 1}) cut sets is too slow; use strategy='dp'"
            )
        return brute_force_partition(cm)
    bounds = baseline_bounds(strategy, profile, cm.num_stages)
    value = bottleneck(cm, bounds)
    return Partition(bounds, value, strategy) if math.isfinite(value) else None


class CannotBeat(PlanningError):
    """:func:`plan_pipeline` found no candidate whose proven lower bound is below its
    ``cutoff_s``: no plan of this request beats a plan the caller already has."""


def plan_pipeline(
    profile: Profile,
    req: PlanRequest,
    cutoff_s: float = math.inf,
    *,
    schedules: Sequence[str] = PLAN_SCHEDULES,
) -> Plan:
    """:func:`plan` for one K-stage pipeline (no mesh). ``cutoff_s``: a step time the caller
    already has (the mesh search's best): candidates whose proven lower bound is not below it
    are not searched, and ``CannotBeat`` is raised when that leaves none feasible.
    ``schedules``: those ``schedule="auto"`` may pick (the mesh search passes the ones
    ``autopipe run`` runs on the mesh, :func:`autopipe.core.mesh_rules.mesh_schedules`, and
    refuses a named one outside them before searching)."""
    _check_choice("schedule", req.schedule, (*PLAN_SCHEDULES, "auto"))
    _check_choice("checkpoint", req.checkpoint, CHECKPOINT_MODES)
    _check_choice("strategy", req.strategy, STRATEGIES)
    chosen_optimizer, state_bpp = training_state(profile, req.optimizer, req.bytes_per_parameter)
    if not req.headroom >= 0 or not math.isfinite(req.headroom):
        raise PlanningError(f"headroom={req.headroom} must be a fraction >= 0 (0.1 keeps 10% free)")
    cluster = _resolve_cluster(profile, req.gpus, req.cluster, req.memory_per_device)
    batch = profile.batch_size if req.batch_size is None else req.batch_size
    batch = _positive_int("batch_size", batch)
    m_list = _candidate_microbatches(batch, req.microbatches)
    combos = _candidate_shapes(req, len(cluster), len(profile.units), m_list, batch, schedules)

    # Cheapest first: each candidate's proven lower bound (O(N + K V M)) orders them, and
    # one that cannot beat the best time found so far is not partitioned at all.
    prepared = [
        _prepare(profile, cluster, req, sched, v, m, batch=batch, state_bpp=state_bpp)
        for sched, v, m in combos
    ]
    _branch_and_bound(prepared, profile, req, batch=batch, state_bpp=state_bpp, cutoff_s=cutoff_s)
    candidates = prepared
    feasible = [c for c in candidates if c.feasible]
    if not feasible and math.isfinite(cutoff_s) and any(c.pruned for c in candidates):
        raise CannotBeat(f"no candidate's lower bound is below {cutoff_s:.6g} s")
    if not feasible:
        raise _infeasible_error(candidates, cluster, req, batch)
    order = list(dict.fromkeys(s for s, _, _ in combos))

    def rank(c: Candidate) -> tuple[float, int, int, int]:
        # Fastest; ties go to fewer micro-batches (less per-call overhead), then to the
        # simpler schedule (PLAN_SCHEDULES order: GPipe first) and fewer chunks.
        return (c.iteration_time_s, c.microbatches, order.index(c.schedule), c.virtual_stages)

    if req.strategy == "dp":
        _refine_gpipe(feasible, rank)
        _adopt_faster_heuristics(feasible, profile)
        _refine_chunks(feasible, rank)
    best = min(feasible, key=rank)
    out = build_plan(
        profile, cluster, best, candidates, req.strategy, req.baselines, batch, req.checkpoint
    )
    _record_request(out, profile, req, chosen_optimizer, state_bpp)
    problems = preflight(out)
    if problems:  # cannot happen: every candidate passed the same rules
        raise RuleViolation(problems[0])
    return out


def _branch_and_bound(
    prepared: list[Candidate],
    profile: Profile,
    req: PlanRequest,
    *,
    batch: int,
    state_bpp: float,
    cutoff_s: float,
) -> None:
    """Partition the candidates cheapest bound first; one whose proven lower bound is not
    below the best time found so far (at first ``cutoff_s``) is marked ``pruned`` instead."""
    best_s = cutoff_s
    for cand in sorted(prepared, key=lambda c: c.lower_bound_s):
        if cand.lower_bound_s >= best_s:
            cand.pruned = True
            continue
        _partition_candidate(cand, profile, req, batch=batch, state_bpp=state_bpp, best_s=best_s)
        if cand.feasible:
            best_s = min(best_s, cand.iteration_time_s)


def _record_request(
    out: Plan, profile: Profile, req: PlanRequest, optimizer: str, state_bpp: float
) -> None:
    """What the plan was made for: the request (and the trainer options it asked for, which
    the ranks and the emitters act on), the training state, the unit granularity."""
    out.optimizer = optimizer
    out.state_bytes_per_parameter = state_bpp
    out.parameter_size_bytes = max(int(profile.bytes_per_parameter), 1)
    # The runtime re-traces the model into the plan's units at this granularity.
    out.granularity = profile.granularity
    out.request = req
    out.trainer = TrainerOptions.from_request(req)


MAX_AUTO_CHUNK_MICROBATCHES = 256
"""With ``schedule="auto"`` the schedules other than GPipe and 1F1B are tried only up to this
M: their simulation is O(K V M) Python steps, and beyond it the bubble they save is < 1%."""


def _candidate_shapes(
    req: PlanRequest,
    k: int,
    n_units: int,
    m_list: list[int],
    batch: int,
    allowed: Sequence[str] = PLAN_SCHEDULES,
) -> list[tuple[str, int, int]]:
    """Every (schedule, V, M) to try, ``schedule="auto"`` trying those of ``allowed``. A
    request that forces a schedule (and V, and M) which torch refuses raises
    :class:`RuleViolation` naming the rule; with ``schedule="auto"`` rule-breaking
    combinations are just skipped. O(#schedules x #V x #M)."""
    forced_v = req.virtual_stages != "auto"
    if forced_v:
        v_req = _positive_int("virtual_stages", req.virtual_stages)
    schedules = (
        [s for s in PLAN_SCHEDULES if s in allowed] if req.schedule == "auto" else [req.schedule]
    )
    combos: list[tuple[str, int, int]] = []
    refused: list[str] = []
    for sched in schedules:
        if forced_v:
            why = check_virtual_stages(sched, v_req)
            if why is not None:
                refused.append(f"stages-per-rank: {why}")
                continue
            if k * v_req > n_units:
                # Bad input like the rules above (the CLI's exit 2), not a search failure.
                raise RuleViolation(
                    f"stages-per-rank: {k} ranks x {v_req} virtual stages need at least "
                    f"{k * v_req} units but the profile has {n_units}; use fewer virtual "
                    "stages or finer units"
                )
            vs = [v_req]
        else:
            vs = virtual_stage_choices(sched, k, n_units)
            if not vs:
                refused.append(
                    f"stages-per-rank: {sched} needs {2 * k} chunks on {k} ranks but the "
                    f"profile has {n_units} units"
                )
        for v in vs:
            for m in m_list:
                if (
                    req.schedule == "auto"
                    and sched not in ("gpipe", "1f1b")
                    and m > MAX_AUTO_CHUNK_MICROBATCHES
                ):
                    continue
                bad = violations(sched, k, v, m, batch, compile=req.compile)
                if bad:
                    refused.append(bad[0])
                else:
                    combos.append((sched, v, m))
    if not combos:
        if not refused:
            raise PlanningError("no (schedule, virtual stages, micro-batches) to try")
        more = f" (and {len(refused) - 1} more refused)" if len(refused) > 1 else ""
        raise RuleViolation(refused[0] + more)
    return combos


def _prepare(
    profile: Profile,
    cluster: Cluster,
    req: PlanRequest,
    sched: str,
    v: int,
    m: int,
    *,
    batch: int,
    state_bpp: float,
) -> Candidate:
    """One (schedule, V, M) with its orders, chunk cost model and proven lower bound, not yet
    partitioned. O(N + K V M)."""
    k = len(cluster)
    shape = ScheduleShape.of(sched, k, v, m)
    cm = cost_model_for(
        profile,
        cluster,
        shape,
        batch_size=batch,
        checkpoint=req.checkpoint,
        state_bytes_per_parameter=state_bpp,
        headroom=req.headroom,
    )
    cand = Candidate(m, sched, cm, shape=shape, cluster=cluster)
    cand.lower_bound_s = lower_bound_s(cm, shape, cluster)
    if req.strategy not in ("dp", "ilp", "brute-force"):
        cand.method = f"the {req.strategy} baseline's cut into {k}x{v} chunks"
    elif v == 1:
        cand.method = f"exact min-bottleneck partition ({_SOLVER_WORDS[req.strategy]})"
    else:
        cand.method = (
            f"min-bottleneck partition of the {k}x{v} chunks ({_SOLVER_WORDS[req.strategy]})"
        )
    return cand


def _partition_candidate(
    cand: Candidate,
    profile: Profile,
    req: PlanRequest,
    *,
    batch: int,
    state_bpp: float,
    best_s: float = math.inf,
) -> None:
    """Partition and price ``cand`` in place (it stays infeasible when nothing fits). With
    V > 1 a cut whose ranks overflow when every chunk may use its whole rank is retried with
    each chunk limited to ``1 / V`` of it, which always fit together. O(partition + T)."""
    assert cand.shape is not None and cand.cluster is not None
    v = cand.virtual_stages
    for share in [1.0] if v == 1 else [1.0, 1.0 / v]:
        if share != 1.0 and cand.lower_bound_s >= best_s:
            return  # even the relaxed cut's bound cannot beat the plan already found
        if share != 1.0:
            cand.cost_model = cost_model_for(
                profile,
                cand.cluster,
                cand.shape,
                batch_size=batch,
                checkpoint=req.checkpoint,
                state_bytes_per_parameter=state_bpp,
                headroom=req.headroom,
                memory_share=share,
            )
        cm = cand.cost_model
        if share == 1.0 and req.strategy == "dp" and math.isfinite(best_s):
            # One probe: if no cut keeps every chunk within best_s / M, every cut's
            # bottleneck rank is busy longer than the plan already found. O(K V N log N).
            limit_s = best_s / cand.microbatches
            if no_cut_within(cm, limit_s):
                cand.pruned = True
                cm.clear_cache()
                return
        part = _partition(cm, req.strategy, profile, req.time_limit_s)
        cm.clear_cache()
        if part is None:
            continue
        if math.isfinite(best_s) and _no_cut_beats(cand, part.bounds, profile, req, best_s):
            cand.pruned = True  # neither its cut nor a baseline's can beat the plan found
            return
        ev = cand.evaluate(part.bounds)
        cand.min_bottleneck_s = part.bottleneck_s
        if share == 1.0 and part.optimality_gap == 0 and req.strategy in EXACT_STRATEGIES:
            # Every chunk may use its whole rank here, a relaxation of the rank's shared
            # memory, so no cut of this candidate has a smaller bottleneck; the rank holding
            # the bottleneck chunk runs it M times: M x bottleneck is a proven bound too.
            cand.lower_bound_s = max(cand.lower_bound_s, cand.microbatches * part.bottleneck_s)
        if ev.fits:
            cand.adopt(part, ev.costs, ev.simulation, ev.works, ev.peaks)
            return


def _no_cut_beats(
    cand: Candidate, bounds: list[int], profile: Profile, req: PlanRequest, best_s: float
) -> bool:
    """Whether every cut this candidate could end with (the partition ``bounds``, and with
    the ``dp`` strategy the baselines' cuts :func:`_adopt_faster_heuristics` may adopt) has
    a proven per-cut bound (:meth:`Candidate.cut_lower_bound_s`) not below ``best_s``: then
    simulating them cannot give a faster plan. O(N + K) per cut."""
    cuts = [bounds]
    if req.strategy == "dp":
        cuts += [baseline_bounds(name, profile, cand.cost_model.num_stages) for name in BASELINES]
    return all(cand.cut_lower_bound_s(b) >= best_s for b in cuts)


def _refine_chunks(
    feasible: list[Candidate],
    rank: Callable[[Candidate], Any],
    max_walks: int = 3,
    max_rounds: int = 4,
    max_evaluations: int = 160,
) -> None:
    """Simulated local search for the candidates not covered by an exact method (V > 1 and
    the looped / zero-bubble schedules): move one chunk boundary by one unit at a time and
    keep a move when the simulated iteration gets faster and every rank still fits.

    Walks candidates in order of their time while their proven lower bound is below the
    best time so far, at most ``max_walks`` of them, each for at most ``max_rounds`` passes
    over the ``K V - 1`` boundaries and ``max_evaluations`` simulations:
    O(max_walks x min(max_rounds x K V, max_evaluations) x T).
    """
    walked = 0
    for c in sorted(feasible, key=rank):
        if walked >= max_walks:
            break
        if c.schedule in ("gpipe", "1f1b") or c.partition is None:
            continue
        best_now = min(feasible, key=rank)
        if c is not best_now and c.lower_bound_s >= best_now.iteration_time_s:
            continue
        walked += 1
        bounds = list(c.partition.bounds)
        n = bounds[-1]
        tried = moved = 0
        for _ in range(max_rounds):
            improved = False
            for b in range(1, len(bounds) - 1):
                for step in (-1, 1):
                    if tried >= max_evaluations:
                        break
                    pos = bounds[b] + step
                    if not bounds[b - 1] < pos < bounds[b + 1] or not 0 < pos < n:
                        continue
                    trial = bounds[:b] + [pos] + bounds[b + 1 :]
                    ev = c.evaluate(trial)
                    tried += 1
                    if ev.fits and ev.iteration_time_s < c.iteration_time_s * (1 - 1e-12):
                        c.adopt_evaluation(ev, "dp+moves")
                        bounds = trial
                        improved = True
                        moved += 1
            if not improved:
                break
        c.refinement = {"evaluated": tried, "moves": moved}
        c.method += f", then simulated local search over chunk boundaries ({moved} moves kept)"


def _refine_gpipe(
    feasible: list[Candidate], rank: Callable[[Candidate], Any], max_walks: int = 3
) -> None:
    """Walk the (max forward part, max backward part) frontier for the best GPipe candidates.

    GPipe's time is ``sum + (M-1)(max f + max q)``; the min-bottleneck partition minimises
    ``max (f + q)`` instead, which is the same only when one stage holds both maxima. Walks
    GPipe candidates in order of their current time while a walk could still beat the best
    plan so far (lower bound: ``(M-1) x min bottleneck + total work / fastest device``), at
    most ``max_walks`` walks; a candidate takes a frontier partition that simulates faster.
    """
    walked = 0
    for c in sorted(feasible, key=rank):
        if walked >= max_walks or c.schedule != "gpipe":
            continue
        best_now = min(feasible, key=rank)
        cm = c.cost_model
        work = float(cm.fwd_prefix[-1] + cm.bwd_prefix[-1]) / float(cm.speed.max())
        bound = (c.microbatches - 1) * c.min_bottleneck_s + work
        if c is not best_now and bound >= best_now.iteration_time_s:
            continue
        f_max = max(x.forward_s + x.send_s for x in c.costs)
        q_max = max(x.recompute_s + x.backward_s for x in c.costs)
        if f_max + q_max <= max(x.time_s for x in c.costs) * (1 + 1e-12):
            continue  # one stage holds both maxima: the min-bottleneck partition is already best
        walked += 1
        points, complete = pareto_partitions(cm)
        c.frontier = {"points": len(points), "complete": complete}
        for bounds in points:
            ev = c.evaluate(bounds)
            if ev.fits and ev.iteration_time_s < c.iteration_time_s * (1 - 1e-12):
                c.adopt_evaluation(ev, "pareto")


def _adopt_faster_heuristics(feasible: list[Candidate], profile: Profile) -> None:
    """Let a baseline's partition stand in where it simulates faster than the exact one.

    The DP is exact for the bottleneck (and, via ``_refine_gpipe``, for GPipe's fill-drain
    time on equal devices), but a 1F1B iteration also depends on how the other stages line
    up, so a heuristic cut can occasionally simulate a little faster. The baselines are cheap
    to evaluate (3 partitions per candidate, O(K M) simulation each), so taking the faster one
    guarantees the plan is never slower than any baseline under the same cost model.
    A candidate whose proven lower bound (on any of its cuts, a baseline's too) is above the
    fastest time found is skipped: no cut of it can win (the deep meshes' 1F1B simulations
    made this most of a mesh search's time).
    """
    fastest = min((c.iteration_time_s for c in feasible), default=math.inf)
    for c in sorted(feasible, key=lambda c: c.lower_bound_s):
        if c.lower_bound_s > fastest:
            continue
        cm = c.cost_model
        for name in BASELINES:
            bounds = baseline_bounds(name, profile, cm.num_stages)
            if c.cut_lower_bound_s(bounds) >= c.iteration_time_s * (1 - 1e-12):
                continue  # proven not faster than the cut it has: no need to simulate it
            ev = c.evaluate(bounds)
            if ev.fits and ev.iteration_time_s < c.iteration_time_s * (1 - 1e-12):
                c.adopt_evaluation(ev, f"dp+{name}")
        fastest = min(fastest, c.iteration_time_s)


def _least_need(
    candidates: list[Candidate], need_of: Callable[[CostModel], float], baseline: bool
) -> tuple[float, int, str]:
    """The smallest ``(memory need x V, M, schedule)`` of ``candidates``. For the exact
    strategies, a candidate whose :func:`memory_floor` is above the least need found so far
    cannot hold the minimum and is not bisected (cheapest floor first): the same answer."""
    if baseline:
        return min((need_of(c.cost_model) * c.virtual_stages, c.microbatches, c.schedule)
                   for c in candidates)  # fmt: skip
    floors = [(memory_floor(c.cost_model) * c.virtual_stages, i) for i, c in enumerate(candidates)]
    best: tuple[float, int, str] | None = None
    for floor, i in sorted(floors):
        if best is not None and floor > best[0] * (1 + 1e-9):
            break  # every later floor is higher still
        c = candidates[i]
        got = (need_of(c.cost_model) * c.virtual_stages, c.microbatches, c.schedule)
        best = got if best is None else min(best, got)
    assert best is not None
    return best


def _infeasible_error(
    candidates: list[Candidate], cluster: Cluster, req: PlanRequest, batch: int
) -> PlanningError:
    """Nothing fits: the least memory a cut needs, and only tries that could lower it and
    that the request has not made already (#36: it said "more micro-batches" after M "auto"
    tried every count, and "more GPUs" where one unit alone is larger than a device)."""
    k, checkpoint, strategy = len(cluster), req.checkpoint, req.strategy
    if strategy in BASELINES:  # the baseline's own partition is fixed: its fullest stage decides

        def need_of(cm: CostModel) -> float:
            bounds = baseline_bounds(strategy, cm.profile, k)
            return max(cm.segment_memory_need(s, bounds[s], bounds[s + 1]) for s in range(k))
    else:
        need_of = min_memory_needed
    # V = 1: the cost model's stage is the rank, so its need is exact. V > 1: each chunk's
    # need bounds one chunk only; V of them always fit together (a sufficient figure).
    single = [c for c in candidates if c.virtual_stages == 1] or candidates
    need, m, sched = _least_need(single, need_of, strategy in BASELINES)
    caps = [d.memory_bytes for d in cluster.devices if d.memory_bytes is not None]
    have = format_bytes(min(caps), fixed=True) if caps else "unlimited"
    capacity = min(caps) if caps else math.inf
    # a unit alone on a device (memory_floor) does not shrink with more stages
    one_unit = min(memory_floor(c.cost_model) for c in single)
    tries = ["more GPUs"] if one_unit <= capacity else ["a smaller batch or finer units"]
    if checkpoint in ("never", "except_last"):
        tries.append("checkpoint='auto' or 'always'")
    if req.schedule == "gpipe" and m > 1:  # GPipe holds all M micro-batches' activations
        tries.append("schedule='1f1b' or 'auto'")
    fixed_m = not (isinstance(req.microbatches, str) and req.microbatches == "auto")
    if fixed_m and m == max(c.microbatches for c in candidates) and batch > m:
        tries.append("more micro-batches")
    if req.shard == "none":  # FSDP over D replicas keeps 1/D of the weights and their state
        tries.append("shard='parameters' with data_parallel > 1")
    if strategy not in ("dp", "ilp", "brute-force"):
        tries.append("strategy='dp'")
    exc = PlanningError(
        f"no {k}-stage plan fits in {have} per device: the smallest memory per device that fits "
        f"is {format_bytes(need, fixed=True)} (M={m}, schedule={sched}, headroom included); "
        f"try {', '.join(tries)}"
    )
    exc.min_memory_bytes = int(math.ceil(need))
    return exc
