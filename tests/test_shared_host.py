"""Ranks that share one host's compute (``Cluster.host_throughput``): the simulator's
processor sharing, and the planner pricing every schedule with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from autopipe.planner import plan
from autopipe.planner.errors import PlanningError
from autopipe.planner.simulate import ChunkWork, simulate_plan, simulate_schedule
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import random_profile

from autopipe.core.cluster import Cluster
from autopipe.core.plan import load_plan
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.vocabulary import PLAN_SCHEDULES

# Every schedule a plan may name, at the fewest chunks per rank beyond one that all accept.
SCHEDULES_V = [(s, 1 if s in ("gpipe", "1f1b") else 2) for s in PLAN_SCHEDULES]


def _works(times: list[tuple[float, float, float]], send_s: float = 0.0) -> list[ChunkWork]:
    return [
        ChunkWork(forward_s=f, backward_s=b + w, backward_input_s=b, backward_weight_s=w,
                  send_s=send_s)
        for f, b, w in times
    ]  # fmt: skip


def test_two_ranks_gpipe_by_hand() -> None:
    """K = 2, M = 2, every task 1 s. Dedicated: 6 s. Sharing 1.5 ranks' worth, the two
    overlaps (F of chunk 0 with F of chunk 1, then the B's) run at 0.75 and take 4/3 s each:
    1 + 4/3 + 1 + 1 + 4/3 + 1 = 6.67 s. One rank's worth: all 8 s of work in turn."""
    works = [ChunkWork(forward_s=1.0, backward_s=1.0) for _ in range(2)]
    dedicated = simulate_schedule(works, "gpipe", 2, 2)
    assert dedicated.iteration_time_s == pytest.approx(6.0)
    assert simulate_schedule(works, "gpipe", 2, 2, host_throughput=1.5).iteration_time_s == (
        pytest.approx(6.0 + 2 / 3)
    )
    one = simulate_schedule(works, "gpipe", 2, 2, host_throughput=1.0)
    assert one.iteration_time_s == pytest.approx(8.0)
    # Busy is the ranks' time inside tasks: 4 s alone + 2 overlaps of 2 s on both ranks.
    assert sum(one.busy_s) == pytest.approx(12.0)


def test_sends_share_nothing() -> None:
    """A send is link time: it runs at full speed while the other rank computes."""
    works = _works([(1.0, 1.0, 0.0), (1.0, 1.0, 0.0)], send_s=0.5)
    ded = simulate_schedule(works, "1f1b", 2, 1)
    shared = simulate_schedule(works, "1f1b", 2, 1, host_throughput=1.0)
    # M = 1: nothing overlaps but the send, which is alone on the link.
    assert shared.iteration_time_s == pytest.approx(ded.iteration_time_s) == pytest.approx(4.5)


chunk_time = st.floats(0.01, 2.0)


@settings(max_examples=40, deadline=None)
@given(
    which=st.integers(0, len(SCHEDULES_V) - 1),
    m=st.sampled_from([4, 8]),  # every schedule's rules accept these at K = 2
    seed_times=st.lists(st.tuples(chunk_time, chunk_time, chunk_time), min_size=4, max_size=4),
    host=st.floats(0.5, 1.9),
)
def test_sharing_never_beats_dedicated_nor_the_hosts_capacity(
    which: int, m: int, seed_times: list[tuple[float, float, float]], host: float
) -> None:
    """Every task runs at most at full speed, so no task ends earlier than on dedicated
    ranks; and the host does at most ``host_throughput`` ranks' worth of work per second."""
    sched, v = SCHEDULES_V[which]
    works = _works(seed_times[: 2 * v])
    ded = simulate_schedule(works, sched, 2, m)
    shared = simulate_schedule(works, sched, 2, m, host_throughput=host)
    same = simulate_schedule(works, sched, 2, m, host_throughput=2.0)
    assert same.iteration_time_s == pytest.approx(ded.iteration_time_s, rel=1e-9)
    assert shared.iteration_time_s >= ded.iteration_time_s * (1 - 1e-9)
    work = sum(ded.busy_s)  # dedicated busy time is the compute work itself
    assert shared.iteration_time_s >= work / host * (1 - 1e-9)
    # Each task keeps its order and runs no faster than its profiled seconds.
    assert shared.timeline is not None and ded.timeline is not None
    by_key = {(t.stage, t.microbatch, t.phase): t for t in ded.timeline.tasks}
    for t in shared.timeline.tasks:
        d = by_key[(t.stage, t.microbatch, t.phase)]
        assert t.end_s - t.start_s >= (d.end_s - d.start_s) * (1 - 1e-9)
        assert t.end_s >= d.end_s * (1 - 1e-9)
        assert t.device == chunk_ranks(sched, 2, v)[t.stage]


def _cluster(host: float | None) -> Cluster:
    return Cluster.homogeneous(2, name="cpu", link_bandwidth_bytes_per_s=5e9, host_throughput=host)


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES_V)
def test_plans_on_a_shared_host_simulate_as_planned_and_keep_it_in_json(
    schedule: str, v: int, tmp_path: Path
) -> None:
    prof = random_profile(16, 3, batch_size=16)
    shared = plan(
        prof,
        PlanRequest(cluster=_cluster(1.2), microbatches=4, schedule=schedule, virtual_stages=v),
    )
    dedicated = plan(
        prof,
        PlanRequest(cluster=_cluster(None), microbatches=4, schedule=schedule, virtual_stages=v),
    )
    assert shared.iteration_time_s > dedicated.iteration_time_s
    # The plan's own figure is the shared-host simulation, and simulate_plan finds it again
    # from the request the plan keeps, also after a JSON round trip.
    assert simulate_plan(shared).iteration_time_s == pytest.approx(shared.iteration_time_s)
    shared.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again.request is not None and again.request.cluster is not None
    assert again.request.cluster.host_throughput == pytest.approx(1.2)
    assert simulate_plan(again).iteration_time_s == pytest.approx(shared.iteration_time_s)


def test_a_host_with_room_for_every_rank_is_dedicated() -> None:
    prof = random_profile(12, 4, batch_size=8)
    a = plan(prof, PlanRequest(cluster=_cluster(2.0), microbatches=4, schedule="zbv"))
    b = plan(prof, PlanRequest(cluster=_cluster(None), microbatches=4, schedule="zbv"))
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_host_throughput_must_be_positive(bad: float) -> None:
    prof = random_profile(8, 5, batch_size=8)
    with pytest.raises(PlanningError, match="host_throughput"):
        plan(prof, PlanRequest(cluster=dataclasses.replace(_cluster(None), host_throughput=bad)))


def test_cli_host_throughput_prices_the_plan_as_the_python_api_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autopipe plan --host-throughput N`` plans as ``Cluster(host_throughput=N)`` does,
    keeps N in the plan's request and says it in the report; a bad N, or N with the flags
    that plan other layouts, is refused with exit 2 and writes nothing."""
    from autopipe.cli import main

    prof = random_profile(12, 6, batch_size=8)
    saved = tmp_path / "profile.json"
    prof.save(saved)
    out = tmp_path / "plan.json"
    args = [str(saved), "--gpus", "2", "--microbatches", "4", "--schedule", "1f1b"]
    assert main(["plan", *args, "--host-throughput", "1.2", "--json", str(out)]) == 0
    assert "share one host that runs 1.2 of them" in capsys.readouterr().out
    got = load_plan(out)
    assert got.request is not None and got.request.cluster is not None
    assert got.request.cluster.host_throughput == pytest.approx(1.2)
    cluster = Cluster.homogeneous(2, name=prof.device, host_throughput=1.2)
    expected = plan(prof, PlanRequest(cluster=cluster, microbatches=4, schedule="1f1b"))
    assert got.iteration_time_s == pytest.approx(expected.iteration_time_s)
    dedicated = plan(prof, PlanRequest(gpus=2, microbatches=4, schedule="1f1b"))
    assert got.iteration_time_s > dedicated.iteration_time_s
    refused = tmp_path / "refused.json"
    with pytest.raises(SystemExit) as exc:  # argparse refuses the value: a usage error
        main(["plan", *args, "--host-throughput", "0", "--json", str(refused)])
    assert exc.value.code == 2
    for other in ("--scaling", "--data-parallel=1"):
        assert main(["plan", *args, "--host-throughput", "1.2", other, "--json", str(refused)]) == 2
        assert "--host-throughput cannot be combined" in capsys.readouterr().err
    assert not refused.exists()
