"""Planner properties: exactness against brute force, memory limits, checkpointing, errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from autopipe.planner import (  # noqa: E402
    Cluster,
    Device,
    PlanningError,
    load_plan,
    plan,
)
from autopipe.planner.partition import brute_force_partition, dp_partition  # noqa: E402
from autopipe.planner.probe import probe_partition  # noqa: E402
from autopipe.planner.simulate import gpipe_exact  # noqa: E402
from planner_instances import cost_model, random_cluster, random_profile  # noqa: E402

from autopipe.core.humanize import format_bytes  # noqa: E402
from autopipe.core.optimizer import OPTIMIZERS, optimizer_state_bytes  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402
from autopipe.core.vocabulary import PLAN_SCHEDULES  # noqa: E402

SETTINGS = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


instances = st.tuples(
    st.integers(1, 8),  # units
    st.integers(0, 10_000),  # seed
    st.sampled_from([None, 1e8, 2e8, 4e8, 1e9]),  # memory per device (bytes)
    st.sampled_from([1, 2, 4, 8, 32]),  # micro-batches
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "except_last", "auto"]),
    st.booleans(),  # heterogeneous cluster
    st.data(),
)


@SETTINGS
@given(instances)
def test_dp_and_probe_equal_brute_force(inst) -> None:
    n, seed, mem, m, schedule, checkpoint, hetero, data = inst
    k = data.draw(st.integers(1, n))
    profile = random_profile(n, seed, overhead=seed % 2 == 0)
    if hetero:
        cluster = random_cluster(k, seed, None if mem is None else int(mem))
    else:
        cluster = Cluster.homogeneous(k, memory_bytes=None if mem is None else int(mem))
    cm = cost_model(profile, cluster, m, schedule, checkpoint)
    brute = brute_force_partition(cm)
    for found in (dp_partition(cm), probe_partition(cm)):
        if brute is None:  # memory-infeasible: every exact algorithm must agree
            assert found is None
            continue
        assert found is not None
        assert found.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
        assert len(found.bounds) == k + 1 and found.bounds[0] == 0 and found.bounds[-1] == n
        assert all(a < b for a, b in zip(found.bounds, found.bounds[1:], strict=False))
        for c in cm.stage_costs(found.bounds):
            assert c.feasible


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(4, 30), st.integers(0, 10_000), st.sampled_from([3e8, 6e8, 2e9]))
def test_plan_never_exceeds_memory(n: int, seed: int, mem: float) -> None:
    profile = random_profile(n, seed)
    k = 1 + seed % min(n, 6)
    try:
        p = plan(
            profile,
            PlanRequest(
                gpus=k,
                memory_per_device=int(mem),
                checkpoint="auto",
                schedule="auto",
                baselines=False,
            ),
        )
    except PlanningError as exc:
        assert exc.min_memory_bytes is not None and exc.min_memory_bytes > mem / 1.1 * 0.99
        return
    for stage in p.stages:
        assert stage.memory_bytes * 1.1 <= mem
        assert (
            stage.memory_bytes
            == stage.parameter_bytes + stage.optimizer_bytes + stage.activation_bytes
        )


def test_heterogeneous_devices_exact_and_faster_devices_get_more_work() -> None:
    profile = random_profile(12, 7)
    cluster = Cluster(
        [
            Device("a100", 10**10, speed=2.0, link_bandwidth_bytes_per_s=5e9),
            Device("a100", 10**10, speed=2.0, link_bandwidth_bytes_per_s=1e9),
            Device("v100", 3 * 10**9, speed=1.0, link_bandwidth_bytes_per_s=5e9),
            Device("v100", 3 * 10**9, speed=1.0),
        ]
    )
    cm = cost_model(profile, cluster, 4, "gpipe", "auto")
    dp, brute = dp_partition(cm), brute_force_partition(cm)
    assert dp is not None and brute is not None
    assert dp.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
    p = plan(profile, PlanRequest(cluster=cluster, microbatches=4, checkpoint="auto"))
    assert [s.device for s in p.stages] == ["a100", "a100", "v100", "v100"]
    fast = sum(len(s.units) for s in p.stages[:2])
    assert fast > 6  # twice the speed: the fast half takes more than half of the units
    # Stage times are profile times divided by the device speed.
    first = profile.units[: len(p.stages[0].units)]
    assert p.stages[0].forward_s == pytest.approx(sum(u.forward_at(8, 32) for u in first) / 2.0)
    # Send time: cut bytes scaled to the micro-batch, over the link, plus latency (0 here).
    cut = profile.cut_bytes[len(p.stages[0].units) - 1]
    assert p.stages[0].send_s == pytest.approx(cut * (8 / 32) / 5e9)
    assert p.stages[-1].send_s == 0.0


def test_auto_checkpoint_only_where_needed() -> None:
    profile = random_profile(16, 11)
    cluster = Cluster.homogeneous(4, memory_bytes=8 * 10**7)
    p = plan(
        profile, PlanRequest(cluster=cluster, microbatches=8, checkpoint="auto", baselines=False)
    )
    assert any(s.checkpoint for s in p.stages) and not all(s.checkpoint for s in p.stages)
    cm = cost_model(profile, cluster, 8, "gpipe", "auto")
    for stage, cost in zip(p.stages, cm.stage_costs(p.boundaries + [16]), strict=True):
        without = cost.memory_without_checkpoint_bytes * 1.1
        assert stage.checkpoint == (without > 8 * 10**7)
        assert stage.recompute_s == (stage.forward_s if stage.checkpoint else 0.0)
        if stage.checkpoint:
            assert "checkpointed: without it" in stage.reason
    # auto is never slower than forcing either mode, at the same M.
    forced = [
        plan(
            profile,
            PlanRequest(cluster=cluster, microbatches=8, checkpoint="always", baselines=False),
        )
    ]
    assert p.bottleneck_s <= forced[0].bottleneck_s + 1e-15
    with pytest.raises(PlanningError):  # without checkpointing it does not fit at all
        plan(profile, PlanRequest(cluster=cluster, microbatches=8, checkpoint="never"))


def test_except_last_checkpoints_all_but_last_stage() -> None:
    p = plan(
        random_profile(10, 3),
        PlanRequest(gpus=4, microbatches=4, checkpoint="except_last", baselines=False),
    )
    assert [s.checkpoint for s in p.stages] == [True, True, True, False]


def test_infeasible_names_minimal_memory_and_it_is_tight() -> None:
    profile = random_profile(12, 2)
    kw = dict(microbatches=[2, 4], checkpoint="never", baselines=False)
    with pytest.raises(PlanningError) as info:
        plan(profile, PlanRequest(gpus=3, memory_per_device=10**6, **kw))
    msg = str(info.value)
    need = info.value.min_memory_bytes
    assert "smallest memory per device that fits is" in msg and "\n" not in msg
    assert format_bytes(need, fixed=True) in msg and "checkpoint=" in msg
    # one unit alone is larger than a device without checkpointing: more GPUs cannot help
    # (one unit per stage on 12 does not fit either), so the hint does not offer them
    assert "more GPUs" not in msg and "a smaller batch or finer units" in msg
    with pytest.raises(PlanningError):
        plan(profile, PlanRequest(gpus=12, memory_per_device=10**6, **kw))
    plan(profile, PlanRequest(gpus=3, memory_per_device=need, **kw))  # fits at the named memory
    with pytest.raises(PlanningError):
        plan(profile, PlanRequest(gpus=3, memory_per_device=int(need * (1 - 1e-5)), **kw))


def test_auto_m_picks_fastest_candidate_and_explains() -> None:
    profile = random_profile(24, 9, overhead=True)
    auto = plan(profile, PlanRequest(gpus=4, batch_size=64, microbatches="auto", schedule="auto"))
    from autopipe.core.schedule_rules import violations

    # 1F1B with M < K is one torch refuses: auto never tries it.
    fixed = [
        plan(
            profile, PlanRequest(gpus=4, batch_size=64, microbatches=m, schedule=s, baselines=False)
        ).iteration_time_s
        for m in (1, 2, 4, 8, 16, 32, 64)
        for s in ("gpipe", "1f1b")
        if not violations(s, 4, 1, m, 64)
    ]
    # auto also weighs the interleaved, looped and zero-bubble schedules: never slower.
    assert auto.iteration_time_s <= min(fixed) * (1 + 1e-12)
    rows = auto.candidates
    assert {r.schedule for r in rows} == set(PLAN_SCHEDULES)
    assert not any(r.schedule == "1f1b" and r.microbatches < 4 for r in rows)
    assert auto.microbatch_size * auto.microbatches == 64
    assert auto.throughput == pytest.approx(64 / auto.iteration_time_s)
    assert any(n.startswith(f"M={auto.microbatches}, schedule=") for n in auto.notes)
    assert any(n.startswith(("bottleneck: stage", "bottleneck: chunk")) for n in auto.notes)
    # Overheads make huge M pay per-call costs: the best M is interior here.
    assert 1 < auto.microbatches < 64


def test_baselines_recorded_and_not_better_than_dp() -> None:
    profile = random_profile(30, 4)
    p = plan(profile, PlanRequest(gpus=4, microbatches=8))
    from autopipe.planner.baselines import FRAMEWORK_DEFAULTS

    assert set(p.baselines) == {"uniform", "parameters", "greedy-time", *FRAMEWORK_DEFAULTS}
    for name, b in p.baselines.items():
        assert set(b) >= {"iteration_time_s", "bottleneck_s", "balance", "feasible"}
        if b["iteration_time_s"] is None:  # a layer-counting rule; these units have no
            # stack, or a framework without the plan's schedule (Megatron has no GPipe)
            assert name in FRAMEWORK_DEFAULTS, name
            assert "no single one" in b["reason"] or "no gpipe schedule" in b["reason"], name
            continue
        assert sum(b["balance"]) == 30 and len(b["balance"]) == 4, name
        if b.get("schedule", p.schedule) != p.schedule:
            assert name == "deepspeed-parameters" and b["schedule"] == "1f1b"
            continue  # DeepSpeed runs its own 1F1B: not the plan's problem
        assert b["bottleneck_s"] >= p.min_bottleneck_s - 1e-15
        # No sends, no recompute, equal devices: the planned GPipe time is optimal, so no
        # baseline partition is faster at the same M.
        assert b["iteration_time_s"] >= p.iteration_time_s * (1 - 1e-12), name
    for strategy in ("uniform", "parameters", "greedy-time"):
        q = plan(profile, PlanRequest(gpus=4, microbatches=8, strategy=strategy))
        assert q.balance == p.baselines[strategy]["balance"]
        assert "dp" in q.baselines


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(2, 8), st.integers(0, 10_000), st.sampled_from([1, 4, 16]))
def test_gpipe_iteration_time_optimal_over_all_partitions(n: int, seed: int, m: int) -> None:
    """Min-bottleneck partition + (max f, max q) frontier = the fastest GPipe partition."""
    profile = random_profile(n, seed)
    k = 1 + seed % n
    p = plan(profile, PlanRequest(gpus=k, microbatches=m, baselines=False))
    cm = cost_model(profile, Cluster.homogeneous(k), m, "gpipe", "never")
    best = min(
        gpipe_exact(
            [c.forward_s + c.send_s for c in costs],
            [c.recompute_s + c.backward_s for c in costs],
            m,
        )
        for cuts in itertools.combinations(range(1, n), k - 1)
        for costs in [cm.stage_costs([0, *cuts, n])]
    )
    assert p.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert p.min_bottleneck_s == pytest.approx(brute_force_partition(cm).bottleneck_s, rel=1e-12)


def test_optimizer_bytes_per_parameter() -> None:
    profile = random_profile(4, 0)
    params = sum(u.parameter_bytes for u in profile.units)
    for optimizer, factor in (("sgd", 2), ("sgd-momentum", 3), ("adam", 4)):
        p = plan(profile, PlanRequest(gpus=1, microbatches=1, optimizer=optimizer, baselines=False))
        assert p.stages[0].parameter_bytes == params
        assert p.stages[0].optimizer_bytes == (factor - 1) * params
    p = plan(profile, PlanRequest(gpus=1, microbatches=1, bytes_per_parameter=20, baselines=False))
    assert p.stages[0].optimizer_bytes == 4 * params


@pytest.mark.parametrize("size_bytes", [2, 4])
def test_planner_state_bytes_follow_the_profilers_convention(size_bytes: int) -> None:
    """A plan's parameter + optimizer bytes = the profiler's parameter + gradient + state."""
    profile = random_profile(4, 0)
    profile.bytes_per_parameter = size_bytes
    for u in profile.units:
        u.parameter_bytes = size_bytes * u.parameter_count
    count = sum(u.parameter_count for u in profile.units)
    params = sum(u.parameter_bytes for u in profile.units)
    for optimizer in OPTIMIZERS:
        p = plan(profile, PlanRequest(gpus=1, microbatches=1, optimizer=optimizer, baselines=False))
        profiler_bytes = 2 * params + optimizer_state_bytes(optimizer, count, params)
        assert p.stages[0].parameter_bytes + p.stages[0].optimizer_bytes == profiler_bytes
    # mixed precision Adam is 16 bytes per parameter whether parameters are 16-bit or fp32
    p = plan(profile, PlanRequest(gpus=1, microbatches=1, optimizer="mixed-adam", baselines=False))
    assert p.stages[0].parameter_bytes + p.stages[0].optimizer_bytes == 16 * count


def test_import_planner_does_not_import_torch() -> None:
    code = (
        "import sys, autopipe.planner, autopipe.planner.search, autopipe.planner.simulate; "
        "import autopipe.planner.ilp; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_unit_and_no_memory_limit_edge_cases() -> None:
    profile = random_profile(1, 0)
    p = plan(profile, PlanRequest(gpus=1, microbatches=1))
    assert p.num_stages == 1 and p.stages[0].units == ["layer0"] and p.bubble_fraction == 0.0
    assert math.isclose(p.speedup, 1.0)


def test_infeasible_baseline_names_its_own_memory_need() -> None:
    profile = random_profile(12, 2)
    with pytest.raises(PlanningError) as info:
        plan(
            profile,
            PlanRequest(gpus=3, memory_per_device=10**6, strategy="uniform", microbatches=4),
        )
    need = info.value.min_memory_bytes
    assert "strategy='dp'" in str(info.value)
    assert plan(
        profile, PlanRequest(gpus=3, memory_per_device=need, strategy="uniform", microbatches=4)
    ).balance == [
        4,
        4,
        4,
    ]
    with pytest.raises(PlanningError):
        plan(
            profile,
            PlanRequest(
                gpus=3, memory_per_device=int(need * (1 - 1e-6)), strategy="uniform", microbatches=4
            ),
        )


@SETTINGS
@given(
    n=st.integers(4, 12),
    k=st.integers(2, 4),
    seed=st.integers(0, 10_000),
    schedule=st.sampled_from(["gpipe", "1f1b", "auto"]),
)
def test_plan_is_never_slower_than_a_baseline(n: int, k: int, seed: int, schedule: str) -> None:
    """Under one cost model, the planned iteration time is <= every feasible baseline's at
    the plan's (schedule, V); a framework row priced under the schedule that framework runs
    (DeepSpeed's 1F1B, torchtitan's stages per rank) is another problem."""
    if k > n:
        return
    profile = random_profile(n, seed)
    p = plan(profile, PlanRequest(gpus=k, schedule=schedule))
    for name, b in p.baselines.items():
        own = (b.get("schedule", p.schedule), b.get("virtual_stages", p.virtual_stages))
        if b["feasible"] and own == (p.schedule, p.virtual_stages):
            assert p.iteration_time_s <= b["iteration_time_s"] * (1 + 1e-9), name


def test_replanning_is_the_recorded_request_with_one_field_replaced(tmp_path: Path) -> None:
    """A plan records its request; ``plan(profile, replace(p.request, microbatches=8))`` plans
    the same problem at M = 8, exactly as asking for M = 8 from the start does."""
    import dataclasses

    profile = random_profile(12, seed=7)
    first = plan(
        profile, PlanRequest(gpus=4, microbatches="auto", schedule="auto", checkpoint="auto")
    )
    assert isinstance(first.request, PlanRequest)
    assert first.request.gpus == 4 and first.request.schedule == "auto"
    assert first.granularity == profile.granularity
    again = plan(profile, dataclasses.replace(first.request, microbatches=8))
    direct = plan(profile, PlanRequest(gpus=4, microbatches=8, schedule="auto", checkpoint="auto"))
    assert again.microbatches == direct.microbatches == 8
    assert again.to_dict() == direct.to_dict()
    # The request survives the JSON round trip, and older files without it still load.
    path = tmp_path / "plan.json"
    first.save(path)
    loaded = load_plan(path)
    assert loaded.request == first.request and loaded.granularity == first.granularity
    old = json.loads(path.read_text())
    del old["report"]["request"], old["granularity"]
    old["report"]["meta"]["granularity"] = "module"
    path.write_text(json.dumps(old))
    legacy = load_plan(path)
    assert legacy.request is None and legacy.granularity == "module"
    with pytest.raises(TypeError, match="unexpected keyword argument 'microbatch'"):
        plan(profile, PlanRequest(gpus=4, microbatch=8))
    with pytest.raises(TypeError, match=r"takes a PlanRequest, not int"):
        plan(profile, 4)  # type: ignore[arg-type]


def test_the_refusal_offers_only_tries_the_request_has_not_made() -> None:
    """#36: M "auto" tried every count, so "more micro-batches" is not offered; GPipe holds
    all M micro-batches' activations, so 1F1B is; a device that one unit fits offers more
    GPUs. A fixed M at the largest tried does offer more micro-batches."""
    profile = random_profile(12, 2)
    auto = PlanRequest(gpus=3, memory_per_device=10**6, checkpoint="auto", baselines=False)
    with pytest.raises(PlanningError) as info:
        plan(profile, auto)
    tries = str(info.value).split("; try ")[1]
    assert "more micro-batches" not in tries and "schedule='1f1b' or 'auto'" in tries
    assert "shard='parameters' with data_parallel > 1" in tries  # names sharding (#36)
    assert "checkpoint" not in tries  # already auto (#36: it was offered anyway)
    fixed = dataclasses.replace(auto, microbatches=2)
    with pytest.raises(PlanningError) as info:
        plan(profile, fixed)
    assert "more micro-batches" in str(info.value).split("; try ")[1]
