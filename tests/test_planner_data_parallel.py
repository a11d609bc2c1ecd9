"""Choosing pipeline depth K and data-parallel degree D for G devices (torch-free model)."""

from __future__ import annotations

import pytest
from autopipe.planner.data_parallel import choose_pipeline_data_parallel, ring_allreduce_s

from autopipe.core.cluster import Cluster
from autopipe.core.plan import Plan, StagePlan
from autopipe.core.plan_report import PlanReport, StageReport
from autopipe.core.request import PlanRequest

PARAM_BYTES = 400e6  # the whole model's gradients
SAMPLE_S = 0.01  # forward + backward seconds per sample on one device


def gpipe_plan(stages: int, batch: int, microbatches: int = 8) -> Plan:
    """A balanced K-stage GPipe plan: (M + K - 1) x per-micro-batch stage time."""
    if stages > 4:
        raise ValueError("needs more memory than a device has")  # an infeasible K
    stage_s = SAMPLE_S * batch / microbatches / stages
    return Plan(
        num_stages=stages,
        microbatches=microbatches,
        microbatch_size=batch // microbatches,
        batch_size=batch,
        stages=[
            StagePlan(
                index=i,
                device="gpu",
                units=[f"u{i}"],
                report=StageReport(parameter_bytes=int(PARAM_BYTES / stages)),
            )
            for i in range(stages)
        ],
        report=PlanReport(iteration_time_s=(microbatches + stages - 1) * stage_s),
    )


def test_ring_allreduce_model() -> None:
    assert ring_allreduce_s(1e9, 1, 1e9) == 0.0
    assert ring_allreduce_s(1e9, 4, 1e9) == pytest.approx(2 * 3 / 4)
    assert ring_allreduce_s(1e9, 4, 1e9, latency_s=1e-3) == pytest.approx(1.5 + 6e-3)


def test_fast_links_favour_data_parallel_slow_links_favour_pipelines() -> None:
    fast = choose_pipeline_data_parallel(gpipe_plan, 8, 256, allreduce_bandwidth_bytes_per_s=1e13)
    assert (fast[0].stages, fast[0].replicas) == (1, 8)  # no bubble, all-reduce nearly free
    slow = choose_pipeline_data_parallel(gpipe_plan, 8, 256, allreduce_bandwidth_bytes_per_s=1e9)
    assert (slow[0].stages, slow[0].replicas) == (4, 2)  # the deepest feasible pipeline
    by_k = {c.stages: c for c in slow}
    # K = 2, D = 4: per-replica batch 64, pipeline (8 + 1) x 0.04 s, all-reduce of 200 MB.
    assert by_k[2].pipeline_s == pytest.approx(9 * SAMPLE_S * 64 / 8 / 2)
    assert by_k[2].allreduce_s == pytest.approx(2 * 3 / 4 * 200e6 / 1e9)
    assert by_k[2].throughput == pytest.approx(256 / (by_k[2].pipeline_s + by_k[2].allreduce_s))
    assert by_k[8].plan is None and "more memory" in by_k[8].reason
    assert [c.throughput for c in slow] == sorted((c.throughput for c in slow), reverse=True)


def test_no_feasible_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="no K x D split of 8 devices works"):
        choose_pipeline_data_parallel(lambda k, b: gpipe_plan(8, b), 8, 6, 1e9)


def _profile(n_units: int = 8):
    from planner_instances import random_profile

    return random_profile(n_units, seed=3, batch_size=64)


def test_plan_data_parallel_fixed_replicas() -> None:
    from autopipe.planner import plan, plan_data_parallel

    p = plan_data_parallel(_profile(), 8, replicas=2, allreduce_bandwidth_bytes_per_s=1e9)
    assert (p.num_stages, p.data_parallel, p.batch_size) == (4, 2, 32)
    # the pipeline's sends cross the same 1 GB/s link as the all-reduce (before, they were
    # priced on links of no cost while the all-reduce paid 1 GB/s)
    devices = Cluster.homogeneous(4, _profile().device, link_bandwidth_bytes_per_s=1e9)
    pipeline_only = plan(_profile(), PlanRequest(cluster=devices, batch_size=32))
    allreduce = max(ring_allreduce_s(s.parameter_bytes, 2, 1e9) for s in pipeline_only.stages)
    # and the optimizer step after it (a catalog GPU's memory bandwidth: docs/cost-model.md)
    assert p.report.optimizer_s > 0
    assert p.iteration_time_s == pytest.approx(
        pipeline_only.iteration_time_s + allreduce + p.report.optimizer_s
    )
    assert p.throughput == pytest.approx(64 / p.iteration_time_s)


def test_plan_data_parallel_auto_picks_the_fastest_layout() -> None:
    from autopipe.planner import plan_data_parallel

    for bandwidth in (1e7, 1e13):
        p = plan_data_parallel(_profile(), 8, allreduce_bandwidth_bytes_per_s=bandwidth)
        # every (K, D) weighed is a mesh row (T = 1, unsharded): the plan is the fastest
        assert p.mesh is not None and {(r.tp, r.shard) for r in p.mesh.candidates} == {(1, "none")}
        steps = [r.step_s for r in p.mesh.candidates if r.step_s is not None]
        assert p.throughput == pytest.approx(64 / min(steps))
        assert p.num_stages * p.data_parallel == 8
    slow = plan_data_parallel(_profile(), 8, allreduce_bandwidth_bytes_per_s=1e7)
    fast = plan_data_parallel(_profile(), 8, allreduce_bandwidth_bytes_per_s=1e13)
    assert slow.data_parallel <= fast.data_parallel  # a slow all-reduce favours deeper pipelines


def test_plan_data_parallel_rejects_a_non_divisor() -> None:
    from autopipe.planner import PlanningError, plan_data_parallel

    with pytest.raises(PlanningError, match="divisor"):
        plan_data_parallel(_profile(), 8, replicas=3, allreduce_bandwidth_bytes_per_s=1e9)


def test_rank_layout_checks_stages_times_replicas() -> None:
    from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout

    assert rank_layout(3, 4, 2, replicas=2).replicas == 2
    with pytest.raises(PlanWorldSizeError, match="2 stages x 3 replicas = 6"):
        rank_layout(0, 4, 2, replicas=3)


def test_fixed_replicas_name_only_their_own_layout() -> None:
    from autopipe.planner import PlanningError, plan_data_parallel

    # D = 2 of 32 GPUs is K = 16, more stages than the 8 units: the one layout D allows.
    with pytest.raises(PlanningError) as err:
        plan_data_parallel(_profile(), 32, replicas=2, allreduce_bandwidth_bytes_per_s=1e9)
    assert str(err.value) == (
        "mesh: 32 GPUs make at least 16 pipeline stages (D=2, T=1: the most the batch, the "
        "nodes and the model allow) but the model has 8 units; use at most 16 GPUs or a finer "
        "--granularity (module or node)"
    )


def test_fixed_replicas_must_divide_the_batch() -> None:
    from autopipe.planner import PlanningError, plan_data_parallel

    with pytest.raises(PlanningError) as err:
        plan_data_parallel(
            _profile(),
            32,
            PlanRequest(batch_size=16),
            replicas=32,
            allreduce_bandwidth_bytes_per_s=1e9,
        )
    message = str(err.value)
    assert "D=32 replicas do not divide the batch size 16" in message
    assert "(e.g. 1, 2, 4, 8, 16)" in message and "K=" not in message
