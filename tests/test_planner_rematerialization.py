"""Per-unit re-materialization in the cost model: the formula, the DP's matrices agreeing with
the scalar segment to the bit, the exact partitioners equal to brute force when per-unit
checkpointing decides feasibility, and the plan recording the granularity."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from autopipe.planner import Cluster, PlanningError, load_plan, plan  # noqa: E402
from autopipe.planner.costs import CostModel  # noqa: E402
from autopipe.planner.ilp import ilp_partition  # noqa: E402
from autopipe.planner.partition import (  # noqa: E402
    brute_force_partition,
    dp_partition,
    exact_partition,
)
from autopipe.planner.probe import min_memory_needed, probe_partition  # noqa: E402
from planner_instances import cost_model, random_cluster, random_profile  # noqa: E402

from autopipe.core.plan import Plan, PlanFormatError  # noqa: E402
from autopipe.core.profile import Profile, UnitProfile  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

SETTINGS = settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def deep_profile(n: int, seed: int) -> Profile:
    """Units whose activations dwarf the cuts between them (transformer blocks: a block saves
    many times its input), so per-unit checkpointing needs far less than per-stage."""
    p = random_profile(n, seed)
    rng = np.random.default_rng(seed)
    for u in p.units:  # long sequences: activations, not the training state, fill memory
        u.activation_bytes = int(rng.integers(5_000_000, 40_000_000))
        u.parameter_count //= 10
        u.parameter_bytes = 4 * u.parameter_count
    p.cut_bytes = [int(c) for c in rng.integers(100_000, 2_000_000, size=n - 1)]
    return p


def stage_only_bytes(cm, s: int, i: int, j: int) -> float:
    """The per-stage checkpointed activation bytes (the model before per-unit existed)."""
    act_one = (cm.act_prefix[j] - cm.act_prefix[i]) * cm.ratio
    return act_one * cm.full_inflight[s] + cm.cut_bytes_at[i] * cm.ratio * cm.inflight[s]


def test_per_unit_memory_by_hand() -> None:
    # 4 units, activations 10, 40, 20, 30 MB; inputs (model input, then cuts) 1, 2, 3, 4 MB.
    units = [
        UnitProfile(name=f"u{i}", kind="Linear", forward_s=1e-3, backward_s=2e-3,
                    activation_bytes=a * 10**6)
        for i, a in enumerate([10, 40, 20, 30])
    ]  # fmt: skip
    profile = Profile(units=units, cut_bytes=[2 * 10**6, 3 * 10**6, 4 * 10**6], batch_size=8,
                      input_bytes=10**6)  # fmt: skip
    cm = cost_model(profile, Cluster.homogeneous(1), 4, "gpipe", "always")  # b = 8: ratio 1
    c = cm.segment(0, 0, 4)
    # per stage: all 100 MB re-computed at once + the stage input of each of 4 micro-batches
    assert stage_only_bytes(cm, 0, 0, 4) == 100e6 + 1e6 * 4
    # per unit: (1 + 2 + 3 + 4) MB of unit inputs x 4 in flight + the largest unit (40 MB)
    assert c.checkpoint and c.checkpoint_granularity == "unit"
    assert c.activation_bytes == 10e6 * 4 + 40e6
    assert c.recompute_s == c.forward_s  # the same single extra forward
    # one unit: per unit keeps the same input and re-computes the same unit: a tie -> stage
    one = cm.segment(0, 1, 2)
    assert one.checkpoint_granularity == "stage" and one.activation_bytes == 40e6 + 2e6 * 4
    # not checkpointed: the granularity says nothing
    assert cm.segment(0, 0, 4, checkpoint=False).checkpoint_granularity == "stage"


instances = st.tuples(
    st.integers(1, 9),  # units
    st.integers(0, 10_000),  # seed
    st.sampled_from([None, 1e8, 2e8, 4e8, 1e9]),  # memory per device (bytes)
    st.sampled_from([1, 2, 4, 8, 32]),  # micro-batches
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "except_last", "auto"]),
    st.booleans(),  # deep profile (per unit wins) or the generic random one
    st.booleans(),  # heterogeneous cluster
    st.data(),
)


def _drawn_cost_model(inst: tuple) -> tuple[Profile, CostModel, int, int]:
    """The profile, cost model, unit count N and stage count K of one drawn instance."""
    n, seed, mem, m, schedule, checkpoint, deep, hetero, data = inst
    k = data.draw(st.integers(1, n))
    profile = deep_profile(n, seed) if deep else random_profile(n, seed)
    mem_i = None if mem is None else int(mem)
    cluster = (
        random_cluster(k, seed, mem_i) if hetero else Cluster.homogeneous(k, memory_bytes=mem_i)
    )
    cm = cost_model(profile, cluster, m, schedule, checkpoint)
    return profile, cm, n, k


@SETTINGS
@given(instances)
def test_vectorised_costs_agree_with_segment_to_the_bit(inst) -> None:
    profile, cm, n, k = _drawn_cost_model(inst)
    ii, jj = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    for s in range(k):
        matrix = cm.cost_matrix(s)
        times = cm.segment_times(s, ii, jj)
        scalar = np.array([[cm.segment_time(s, i, j) if j > i else math.inf
                            for j in range(n + 1)] for i in range(n + 1)])  # fmt: skip
        assert np.array_equal(matrix, scalar) and np.array_equal(times, scalar)
        assert np.array_equal(cm.unit_activation_max(ii, jj), cm.unit_activation_max_matrix())
        for i in range(n):
            for j in range(i + 1, n + 1):
                c = cm.segment(s, i, j)
                if c.checkpoint:  # the granularity needing less memory, never more than before
                    assert c.activation_bytes <= round(stage_only_bytes(cm, s, i, j))
                    per_unit = (
                        max(u.activation_bytes for u in profile.units[i:j]) * cm.ratio
                        * cm.full_inflight[s]
                        + sum(cm.cut_bytes_at[i:j]) * cm.ratio * cm.inflight[s]
                    )  # fmt: skip
                    stage = stage_only_bytes(cm, s, i, j)
                    assert c.activation_bytes == pytest.approx(min(per_unit, stage), abs=1)
                    if c.checkpoint_granularity == "unit":
                        assert per_unit <= stage * (1 + 1e-12)
                    else:
                        assert per_unit >= stage * (1 - 1e-12)
                need = cm.segment_memory_need(s, i, j)
                if c.feasible and math.isfinite(need):
                    assert need <= cm.capacity_bytes[s] * (1 + 1e-12)


@SETTINGS
@given(instances)
def test_exact_partitioners_equal_brute_force_with_per_unit(inst) -> None:
    cm = _drawn_cost_model(inst)[1]
    brute = brute_force_partition(cm)
    for found in (dp_partition(cm), probe_partition(cm), exact_partition(cm)):
        if brute is None:
            assert found is None
            continue
        assert found is not None
        assert found.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
        assert all(c.feasible for c in cm.stage_costs(found.bounds))


def stage_only_need(cm, n: int, k: int) -> float:
    """The smallest memory per device (headroom included) that some cut fits in with
    re-materialization per stage only, by brute force over every cut."""
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        worst = 0.0
        for s in range(k):
            i, j = b[s], b[s + 1]
            state = cm.state_prefix[j] - cm.state_prefix[i]
            act_a = (cm.act_prefix[j] - cm.act_prefix[i]) * cm.ratio * cm.inflight[s]
            worst = max(worst, state + min(act_a, stage_only_bytes(cm, s, i, j)))
        best = min(best, worst)
    return best * (1.0 + cm.headroom)


def test_per_unit_decides_feasibility_and_the_ilp_agrees() -> None:
    """Memory between the per-unit and the per-stage need: only per-unit checkpointing fits,
    and DP, probe, ILP and brute force find the same optimum."""
    profile = deep_profile(12, 3)
    unbounded = cost_model(profile, Cluster.homogeneous(2), 8, "gpipe", "auto")
    need, stage_need = min_memory_needed(unbounded), stage_only_need(unbounded, 12, 2)
    assert need < 0.8 * stage_need
    mem = int((need + stage_need) / 2)
    cm = cost_model(profile, Cluster.homogeneous(2, memory_bytes=mem), 8, "gpipe", "auto")
    brute = brute_force_partition(cm)
    dp, probe, ilp = dp_partition(cm), probe_partition(cm), ilp_partition(cm, time_limit_s=20)
    assert brute is not None and dp is not None and probe is not None and ilp is not None
    assert dp.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
    assert probe.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
    assert ilp.optimality_gap == 0.0 and ilp.bottleneck_s == pytest.approx(
        dp.bottleneck_s, rel=1e-6
    )
    assert any(c.checkpoint_granularity == "unit" for c in cm.stage_costs(dp.bounds))
    # the ILP also proves a memory below the need infeasible
    tight = cost_model(profile, Cluster.homogeneous(2, memory_bytes=int(need * 0.999)), 8,
                       "gpipe", "auto")  # fmt: skip
    assert ilp_partition(tight, time_limit_s=20) is None and brute_force_partition(tight) is None


def test_plan_records_granularity_and_old_plans_mean_stage(tmp_path: Path) -> None:
    profile = deep_profile(12, 3)
    unbounded = cost_model(profile, Cluster.homogeneous(2), 8, "gpipe", "auto")
    mem = int((min_memory_needed(unbounded) + stage_only_need(unbounded, 12, 2)) / 2)
    kw: dict[str, Any] = dict(
        memory_per_device=mem, microbatches=8, schedule="gpipe", baselines=False
    )
    p = plan(profile, PlanRequest(gpus=2, checkpoint="auto", **kw))
    assert "unit" in {s.checkpoint_granularity for s in p.stages}
    assert "per unit" in str(p) and any("one unit re-computed" in s.reason for s in p.stages)
    path = tmp_path / "plan.json"
    p.save(path)
    loaded = load_plan(path)
    assert [s.checkpoint_granularity for s in loaded.stages] == [
        s.checkpoint_granularity for s in p.stages
    ]
    data = json.loads(path.read_text())
    for s in data["stages"]:
        del s["checkpoint_granularity"]  # a plan written before the field existed
    assert {s.checkpoint_granularity for s in Plan.from_dict(data).stages} == {"stage"}
    data["stages"][0]["checkpoint_granularity"] = "layer"
    with pytest.raises(PlanFormatError, match=r"stages\[0\].checkpoint_granularity"):
        Plan.from_dict(data)
    with pytest.raises(PlanningError):  # nor without re-materialization
        plan(profile, PlanRequest(gpus=2, checkpoint="never", **kw))


def test_per_unit_optima_are_common_and_exact() -> None:
    """Over seeds, memory between the per-unit and the per-stage need: every instance fits
    only thanks to per-unit checkpointing, and DP, probe and the banded DP equal brute force."""
    exercised = 0
    for seed in range(12):
        n, k = 8, 2 + seed % 2
        profile = deep_profile(n, seed)
        unbounded = cost_model(profile, Cluster.homogeneous(k), 4, "1f1b", "auto")
        need, stage_need = min_memory_needed(unbounded), stage_only_need(unbounded, n, k)
        if need >= stage_need * 0.98:
            continue
        mem = int((need + stage_need) / 2)
        cm = cost_model(profile, Cluster.homogeneous(k, memory_bytes=mem), 4, "1f1b", "auto")
        brute = brute_force_partition(cm)
        assert brute is not None
        for found in (dp_partition(cm), probe_partition(cm), exact_partition(cm)):
            assert found is not None
            assert found.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
        assert any(c.checkpoint_granularity == "unit" for c in cm.stage_costs(brute.bounds))
        exercised += 1
    assert exercised >= 8
