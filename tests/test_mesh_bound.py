"""The mesh search's memory-aware lower bound (planner/mesh_bound.py, issue 35's planning
speed): the re-materialization a mesh's memory forces, by hand; the bound below every mesh's
searched step; and the pruned search returning the same mesh and step as the search that
searches every mesh (no mesh-level pruning), on small seeded instances."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from autopipe.planner import PlanningError, plan
from autopipe.planner import mesh as mesh_module
from autopipe.planner.mesh import (
    MeshCandidate,
    _MeshSearch,
    _search,
    mesh_candidates,
    mesh_lower_bound_s,
)
from autopipe.planner.mesh_bound import (
    PipelineMemory,
    _cheapest_cover_s,
    fill_drain_within,
    inflight_per_stage,
    kept_capacity_bytes,
    least_recompute_s,
)
from autopipe.planner.search import plan_pipeline, training_state
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_context_expert import long_profile

from autopipe.core.cluster import Cluster, Device
from autopipe.core.mesh_rules import mesh_schedule_problem
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest


def test_inflight_counts_of_gpipe_and_1f1b() -> None:
    assert inflight_per_stage("1f1b", 4, np.array([2, 8])).tolist() == [
        [2, 4], [2, 3], [2, 2], [1, 1]
    ]  # fmt: skip
    assert inflight_per_stage("gpipe", 2, np.array([3])).tolist() == [[3], [3]]
    with pytest.raises(ValueError, match="gpipe and 1f1b only"):
        inflight_per_stage("interleaved-1f1b", 2, np.array([4]))


def test_kept_capacity_puts_the_state_where_most_micro_batches_wait() -> None:
    """1F1B, K = 4, M = 8: stages hold 4, 3, 2, 1 micro-batches. 10 bytes each, 15 bytes of
    state: stage 0 full (10), stage 1 holds 5 -> (0/4 + 5/3 + 10/2 + 10/1) = 16.667."""
    held = inflight_per_stage("1f1b", 4, np.array([8]))
    assert kept_capacity_bytes(10.0, 15.0, held)[0] == pytest.approx(5 / 3 + 5 + 10)
    assert kept_capacity_bytes(10.0, 0.0, held)[0] == pytest.approx(10 / 4 + 10 / 3 + 5 + 10)
    assert kept_capacity_bytes(10.0, 41.0, held)[0] == -np.inf  # the state alone overflows
    assert kept_capacity_bytes(math.inf, 41.0, held)[0] == np.inf


def test_cheapest_cover_takes_the_cheapest_seconds_per_byte_first() -> None:
    seconds = np.array([4.0, 1.0, 3.0])
    nbytes = np.array([4.0, 2.0, 1.0])  # 1, 0.5, 3 s per byte
    assert _cheapest_cover_s(seconds, nbytes, 0.0) == 0.0
    assert _cheapest_cover_s(seconds, nbytes, 2.0) == pytest.approx(1.0)
    assert _cheapest_cover_s(seconds, nbytes, 3.0) == pytest.approx(1.0 + 1.0)
    assert _cheapest_cover_s(seconds, nbytes, 7.0) == pytest.approx(8.0)
    assert _cheapest_cover_s(seconds, nbytes, 7.5) == math.inf


def _two_units() -> Profile:
    """Two units at batch 4: forward 1 s and 3 s, 100 and 300 activation bytes, 10 parameter
    bytes each (1-byte parameters)."""
    units = [
        UnitProfile(name=f"u{i}", forward_s=f, backward_s=2 * f, parameter_count=10,
                    parameter_bytes=10, activation_bytes=a)
        for i, (f, a) in enumerate([(1.0, 100), (3.0, 300)])
    ]  # fmt: skip
    return Profile(units=units, cut_bytes=[0], batch_size=4, bytes_per_parameter=1)


def test_least_recompute_by_hand() -> None:
    """Replica batch 8, M = 2 (micro-batch 4: the profile's sizes), 1F1B on K = 2: stages
    hold 2 and 1 micro-batches; state 2 x 20 B (2 bytes per parameter byte) = 40 B, limit
    100 B: capacity (100 - 40) / 2 + 100 / 1 = 130 B, activations 400 B: 270 B to re-compute,
    cheapest per byte first (both 1/100 s per byte): 2.7 s. Unlimited: none."""
    p = _two_units()
    ms = np.array([2])
    got = least_recompute_s(
        p, 8, ms, schedule="1f1b", stages=2, limit_bytes=100.0, state_bytes_per_parameter=2.0
    )
    assert got[0] == pytest.approx(2.7)
    free = least_recompute_s(
        p, 8, ms, schedule="1f1b", stages=2, limit_bytes=math.inf, state_bytes_per_parameter=2.0
    )
    assert free[0] == 0.0
    full = least_recompute_s(
        p, 8, ms, schedule="1f1b", stages=2, limit_bytes=10.0, state_bytes_per_parameter=2.0
    )
    assert full[0] == math.inf  # 40 B of state on 2 stages of 10 B
    other = PipelineMemory("interleaved-1f1b", 100.0, 2.0).least_recompute_s(p, 8, 2, ms)
    assert other.tolist() == [0.0]


def _cluster(n: int, memory: int | None) -> Cluster:
    return Cluster([Device("gpu", memory, 1.0, 1e11, 0.0) for _ in range(n)])


def _request(n: int, memory: int | None, schedule: str) -> PlanRequest:
    return PlanRequest(
        cluster=_cluster(n, memory), batch_size=16, gpus_per_node=4,
        inter_node_bandwidth_bytes_per_s=1e9, checkpoint="auto", schedule=schedule,  # type: ignore[arg-type]
        tensor_parallel="auto", data_parallel="auto", shard="auto",
        context_parallel="auto", expert_parallel="auto",
    )  # fmt: skip


def _plan(p: Profile, req: PlanRequest) -> Plan | None:
    try:
        return plan(p, req)
    except PlanningError:
        return None


def _same(pruned: Plan | None, every: Plan | None) -> None:
    """The same predicted step, on a mesh the exhaustive search priced at that step (two
    meshes of one step are a tie either search may break its own way)."""
    assert (pruned is None) == (every is None)
    if pruned is None or every is None:
        return
    assert pruned.mesh is not None and every.mesh is not None
    assert pruned.iteration_time_s == every.iteration_time_s
    chosen = (*pruned.mesh_shape, pruned.context_parallel, pruned.expert_parallel, pruned.shard)
    steps = {(r.pp, r.dp, r.tp, r.cp, r.ep, r.shard): r.step_s for r in every.mesh.candidates}
    assert steps[chosen] == every.iteration_time_s


def _prune_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the mesh-level pruning off: every bound 0, and every M of every mesh allowed
    by the fill-and-drain test (mesh._fill_drain_beats: its ``ms`` is the fourth argument)."""
    monkeypatch.setattr(mesh_module, "mesh_lower_bound_s", lambda *a, **k: 0.0)
    monkeypatch.setattr(mesh_module, "_fill_drain_beats", lambda *a, **k: np.ones(len(a[3]), bool))


CASES = [
    (seed, memory, moe, schedule)
    for seed, (memory, moe, schedule) in enumerate(
        (memory, moe, schedule)
        for memory in [None, 1_500_000, 3_000_000]
        for moe in (False, True)
        for schedule in ("1f1b", "gpipe")
    )
]


@pytest.mark.parametrize(("seed", "memory", "moe", "schedule"), CASES)
def test_pruned_search_equals_searching_every_mesh(
    seed: int, memory: int | None, moe: bool, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same mesh, same predicted step with the lower bounds pruning as with every mesh
    searched (each mesh's bound 0: nothing skipped), 4 GPUs over (T, C, D, E, shard)."""
    p = long_profile(n_blocks=4, seed=seed, moe=moe)
    req = _request(4, memory, schedule)
    pruned = _plan(p, req)
    _prune_nothing(monkeypatch)
    every = _plan(p, req)
    _same(pruned, every)
    if every is not None and every.mesh is not None:
        assert all(r.searched for r in every.mesh.candidates if r.pp <= len(p.units))
    if pruned is not None and pruned.mesh is not None and memory is not None:
        assert sum(r.searched for r in pruned.mesh.candidates) < len(pruned.mesh.candidates)


@pytest.mark.parametrize(
    ("seed", "memory", "dp"), [(0, None, "auto"), (0, 4_000_000, 1), (1, 4_000_000, 1)]
)
def test_pruned_search_equals_searching_every_mesh_under_auto(
    seed: int, memory: int | None, dp: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above under ``schedule="auto"``, where a mesh on the mesh runtime searches no
    zero-bubble schedule (core.mesh_rules.mesh_schedules) and a plain one every schedule:
    the bounds (over every schedule) stay below each mesh's step, so pruning keeps the
    winner, and neither search returns a schedule ``autopipe run`` refuses on its mesh (seed
    0 at 4 MB, D = 1 chose interleaved-zb on C = 4, ZeRO-3, before the rule; 1f1b now)."""
    p = long_profile(n_blocks=4, seed=seed, moe=True)
    req = dataclasses.replace(_request(4, memory, "auto"), data_parallel=dp)
    pruned = _plan(p, req)
    _prune_nothing(monkeypatch)
    every = _plan(p, req)
    _same(pruned, every)
    for out in (pruned, every):
        assert out is not None and mesh_schedule_problem(out, out.schedule) is None


def _mesh_search(
    p: Profile, memory: int | None, schedule: str
) -> tuple[_MeshSearch, list[MeshCandidate]]:
    """The mesh search and every mesh (C and E auto) of ``p`` on 4 GPUs of one
    node at batch 16: the searches the tests below run one mesh at a time."""
    req = _request(4, memory, schedule)
    _, state_bpp = training_state(p, req.optimizer, req.bytes_per_parameter)
    template = req.cluster.devices[0]  # type: ignore[union-attr]
    topology = mesh_module._topology(req, 4, template)
    search = _MeshSearch(p, req, template, topology, 16, state_bpp)
    cands = mesh_candidates(
        p, 4, 16, gpus_per_node=4, shard="auto", context_parallel="auto", expert_parallel="auto"
    )
    return search, cands


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("memory", [2_500_000, 4_000_000])
def test_the_memory_bound_is_below_every_mesh_step(schedule: str, memory: int) -> None:
    """Each mesh searched alone (no cutoff): its step is at least its bound, and the memory
    term raises some bound above the one without it (the instance needs re-materialization)."""
    p = long_profile(n_blocks=4, seed=3, moe=True)
    search, cands = _mesh_search(p, memory, schedule)
    raised = 0
    planned = 0
    for c in cands:
        if c.pp > len(p.units):
            continue
        device, memory_of = search.device_of(c), search.memory_of(c)
        args = (p, device, c, 16, search.topology, search.microbatches, True)
        bound = mesh_lower_bound_s(*args, memory_of)
        raised += bound > mesh_lower_bound_s(*args)
        _search(
            c, plan_pipeline, search.context_of(c), device, search.base, search.template,
            search.topology, 16, search.state_bpp, search.microbatches,
        )  # fmt: skip
        if c.plan is not None:
            planned += 1
            assert bound <= c.step_s * (1 + 1e-12)  # the same sums, in another order
    assert planned > 0 and raised > 0


def test_the_memory_bound_searches_fewer_meshes() -> None:
    """The same best plan with fewer meshes searched than with the bound without memory."""
    p = long_profile(n_blocks=4, seed=3, moe=True)
    req = _request(4, 2_500_000, "1f1b")
    with_memory = plan(p, req)
    without_memory = lambda self, d, r, k, ms: np.zeros(np.asarray(ms).size)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PipelineMemory, "least_recompute_s", without_memory)
        without = plan(p, req)
    _same(with_memory, without)
    assert with_memory.mesh is not None and without.mesh is not None
    few = sum(r.searched for r in with_memory.mesh.candidates)
    many = sum(r.searched for r in without.mesh.candidates)
    assert few < many


# ----- the fill-and-drain test on the units' cuts (mesh_bound.fill_drain_within) ----------


def _least_fill_drain_s(
    unit_s: np.ndarray,
    forward_s: np.ndarray,
    m: float,
    k: int,
    memory: tuple[np.ndarray, np.ndarray, np.ndarray, float] | None,
) -> float:
    """Every cut of the units into at most ``k`` nonempty stages (one column): the least
    ``max_s (W_<s + M t_s)``, ``t_s`` with its forward again where the kept activations do
    not fit, ``inf`` where the state does not. Brute force, for tiny N."""
    import itertools

    n = unit_s.size
    work = np.concatenate([[0.0], np.cumsum(unit_s)])
    best = math.inf
    for parts in range(1, k + 1):
        for inner in itertools.combinations(range(1, n), parts - 1):
            ends = [0, *inner, n]
            worst = 0.0
            for s in range(parts):
                i, j = ends[s], ends[s + 1]
                t = work[j] - work[i]
                if memory is not None:
                    state, act, held, limit = memory
                    st = float(state[i:j].sum())
                    if st > limit:
                        t = math.inf
                    elif st + float(act[i:j].sum()) * held[s] > limit:
                        t += float(forward_s[i:j].sum())
                worst = max(worst, work[i] + m * t)
            best = min(best, worst)
    return best


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_the_fill_drain_greedy_is_exact_for_its_relaxation(
    n: int, k: int, m: int, limited: bool, seed: int
) -> None:
    """The greedy's answer at a limit just above / below the least maximum over every cut
    (brute force): yes above, no below; with and without a memory limit."""
    rng = np.random.default_rng(seed)
    forward = rng.uniform(0.1, 2.0, n)
    unit = forward + rng.uniform(0.1, 4.0, n)
    memory = None
    if limited:
        state, act = rng.uniform(0.0, 3.0, n), rng.uniform(0.0, 2.0, n)
        held = np.minimum(k - np.arange(k), m).astype(float)  # 1F1B's in-flight counts
        memory = (state, act, held, float(rng.uniform(1.0, 12.0)))
    least = _least_fill_drain_s(unit, forward, m, k, memory)
    held_arg = None
    if memory is not None:
        state, act, held, limit = memory
        held_arg = (state, act[:, None], held[:, None], limit)
    ms = np.array([m])

    def within(limit_s: float) -> bool:
        got = fill_drain_within(unit[:, None], forward[:, None], ms, k, limit_s, held_arg)
        return bool(got[0])

    if math.isinf(least):
        assert not within(1e12)
        return
    assert within(least * (1 + 1e-6))
    assert not within(least * (1 - 1e-6))


def test_fill_drain_by_hand() -> None:
    """Units of 1, 1, 2 s (forward + backward), M = 2, two stages: cut [0,2) [2,3) costs
    max(0 + 2 x 2, 2 + 2 x 2) = 6; cut [0,1) [1,3): max(2, 1 + 2 x 3) = 7; one stage 8:
    the least is 6. A memory limit that refuses to keep the last unit's activations adds
    its forward (1 s) to the second stage: [0,2) [2,3) becomes 2 + 2 x 3 = 8, [0,1) [1,3)
    1 + 2 x 4 = 9, one stage 2 x 9 = 18: the least is 8."""
    unit = np.array([[1.0], [1.0], [2.0]])
    forward = np.array([[0.5], [0.5], [1.0]])
    ms = np.array([2])
    assert fill_drain_within(unit, forward, ms, 2, 6.0).tolist() == [True]
    assert fill_drain_within(unit, forward, ms, 2, 5.99).tolist() == [False]
    state = np.zeros(3)
    act = np.array([[1.0], [1.0], [5.0]])
    held = np.array([[2.0], [1.0]])  # 1F1B, K = 2, M = 2
    memory = (state, act, held, 4.0)
    assert fill_drain_within(unit, forward, ms, 2, 8.0, memory).tolist() == [True]
    assert fill_drain_within(unit, forward, ms, 2, 7.99, memory).tolist() == [False]
    too_big = (np.array([0.0, 0.0, 5.0]), act, held, 4.0)  # the last unit's state alone
    assert fill_drain_within(unit, forward, ms, 2, 1e9, too_big).tolist() == [False]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("memory", [2_500_000, 3_000_000, None])
def test_fill_drain_allows_every_searched_mesh_plan(schedule: str, memory: int | None) -> None:
    """Each mesh searched alone (no cutoff): the fill-and-drain test at its plan's pipeline
    time, for its M, says yes (the plan is a cut within it), with the memory the search had."""
    p = long_profile(n_blocks=4, seed=5, moe=True)
    search, cands = _mesh_search(p, memory, schedule)
    planned = 0
    for c in cands:
        if c.pp > len(p.units):
            continue
        device, memory_of = search.device_of(c), search.memory_of(c)
        _search(
            c, plan_pipeline, search.context_of(c), device, search.base, search.template,
            search.topology, 16, search.state_bpp, search.microbatches,
        )  # fmt: skip
        if c.plan is None:
            continue
        planned += 1
        m = [c.plan.microbatches]
        replica = 16 // c.dp
        at = mesh_module._fill_drain_beats(device, replica, c.pp, m, 1.0, c.pipeline_s, memory_of)
        assert at.tolist() == [True]
        below = c.pipeline_s * 0.5  # the same test is not vacuous: half the time fails
        assert not mesh_module._fill_drain_beats(device, replica, c.pp, m, 1.0, below, memory_of)[0]
    assert planned > 0


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    st.integers(2, 6),
    st.sampled_from([4, 8]),
    st.sampled_from([None, 1_000_000, 1_500_000, 2_500_000, 4_000_000]),
    st.booleans(),
    st.sampled_from(["1f1b", "gpipe"]),
    st.integers(0, 1000),
)
def test_pruning_never_changes_the_optimum(
    n_blocks: int, gpus: int, memory: int | None, moe: bool, schedule: str, seed: int
) -> None:
    """Random small instances: the search with its pruning (bounds, fill and drain) finds the
    step of the search that prunes no mesh and no M, on a mesh that search priced at it."""
    p = long_profile(n_blocks=n_blocks, seed=seed, moe=moe)
    req = _request(gpus, memory, schedule)
    pruned = _plan(p, req)
    with pytest.MonkeyPatch.context() as patch:
        _prune_nothing(patch)
        every = _plan(p, req)
    _same(pruned, every)


# The mesh and step each instance gets from the search that prunes nothing (_prune_nothing;
# re-derived when CP's exchange was priced as torch's ring runs it, #34: the gather behind the
# local block only, the fp32 gradient ring: the first three keep their mesh at a longer step;
# the fourth's former D 8 x C 2 tied D 16 x C 1, which now wins at the same step; and again
# when a DP group across nodes was priced over all its ranks' network adapters
# (Topology.collective_bandwidth_bytes_per_s): the fourth, on 32 GPUs in nodes of 4, moves
# from D 16 x T 2 at 0.013965 s to D 32 at 0.013424 s, its gradient ring over 4 adapters a
# node, not 1): pruning changes what is searched, never what is found.
PINNED = [
    ((12, 16, 1_200_000, "1f1b", 6), (1, 1, 4, 4, 4, "parameters", 64), 0.570498295592544),
    ((12, 32, 1_000_000, "1f1b", 7), (2, 2, 4, 2, 1, "parameters", 32), 0.07327635157891216),
    ((12, 16, 1_400_000, "1f1b", 9), (2, 1, 4, 2, 2, "gradients", 64), 0.33598077954761996),
    ((8, 32, 3_000_000, "gpipe", 2), (1, 32, 1, 1, 1, "parameters", 2), 0.013423953651119647),
]


@pytest.mark.parametrize(("case", "mesh", "step_s"), PINNED)
def test_the_chosen_mesh_and_step_are_pinned(
    case: tuple[int, int, int, str, int], mesh: tuple[object, ...], step_s: float
) -> None:
    """MoE models of 8 and 12 blocks on 16 and 32 GPUs, batch 64: the same mesh (PP, D, T,
    C, E, shard, M) and the same predicted step, to the bit, as before the change."""
    n_blocks, gpus, memory, schedule, seed = case
    p = long_profile(n_blocks=n_blocks, seed=seed, moe=True)
    req = dataclasses.replace(_request(gpus, memory, schedule), batch_size=64)
    out = plan(p, req)
    got = (*out.mesh_shape, out.context_parallel, out.expert_parallel, out.shard, out.microbatches)
    assert got == mesh
    assert out.iteration_time_s == step_s
    assert out.mesh is not None
    searched = sum(r.searched for r in out.mesh.candidates)
    skipped = [r for r in out.mesh.candidates if "fill, work and drain" in r.reason]
    assert skipped and searched < len(out.mesh.candidates)
