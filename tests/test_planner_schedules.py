"""Planning every schedule: memory replay, pre-flight, the (schedule, V, M) search, the lower
bound, the CLI flags and the plots. Torch-free (the planner never imports torch)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from autopipe.planner import RuleViolation, load_plan, plan, plan_each_schedule, preflight
from autopipe.planner.candidate import Candidate
from autopipe.planner.chunks import ScheduleShape, cost_model_for
from autopipe.planner.errors import PlanningError
from autopipe.planner.partition import brute_force_partition
from autopipe.planner.simulate import (
    ChunkWork,
    replay_memory,
    simulate,
    simulate_plan,
    simulate_schedule,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_instances import random_profile

from autopipe.cli import main
from autopipe.core.cluster import Cluster
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_orders
from autopipe.core.vocabulary import PLAN_SCHEDULES, SPLIT_BACKWARD_SCHEDULES

# -- memory replay -------------------------------------------------------------------------


def _works(act: list[float], state: list[float], **kw: float) -> list[ChunkWork]:
    return [
        ChunkWork(
            forward_s=1.0,
            backward_s=2.0,
            backward_input_s=1.0,
            backward_weight_s=1.0,
            activation_bytes=a,
            state_bytes=s,
            **kw,  # type: ignore[arg-type]
        )
        for a, s in zip(act, state, strict=True)
    ]


def test_memory_replay_1f1b_by_hand() -> None:
    """K=2, M=3. Rank 0: F0 F1 B0 F2 B1 B2, two activations live at most: 100 + 2 x 10.
    Rank 1: F B F B F B, one at a time: 200 + 20."""
    works = _works([10, 20], [100, 200])
    orders = rank_orders("1f1b", 2, 1, 3)
    assert replay_memory(orders, works, [0, 1]) == [120, 220]


def test_memory_replay_holds_activations_until_the_weight_gradient() -> None:
    """Interleaved zero bubble, K=2, V=1, M=2. Rank 1 runs F0 I0 F1 I1 W0 W1: the input
    gradient I0 does not free micro-batch 0's activations (W0 still reads them), so both are
    live before W0: 200 + 2 x 20, where 1F1B's rank 1 holds one (200 + 20)."""
    works = _works([10, 20], [100, 200])
    orders = rank_orders("interleaved-zb", 2, 1, 2)
    assert [(a.microbatch, a.phase) for a in orders[1]] == [
        (0, "forward"),
        (0, "backward_input"),
        (1, "forward"),
        (1, "backward_input"),
        (0, "backward_weight"),
        (1, "backward_weight"),
    ]
    assert replay_memory(orders, works, [0, 1]) == [120, 240]
    one_f = replay_memory(rank_orders("1f1b", 2, 1, 2), works, [0, 1])
    assert one_f == [120, 220]


def test_memory_replay_checkpointed_chunk_by_hand() -> None:
    """A checkpointed chunk keeps its input (3 B) per micro-batch from its forward, and its
    re-computed activations (10 B) from its input gradient to its weight gradient. Rank 0 of
    interleaved-zb K=2, M=2: F0 F1 I0 W0 I1 W1 -> 3, 6, 16 (peak), 3, 13, 0."""
    works = [
        ChunkWork(1.0, 2.0, 1.0, 1.0, recompute_s=1.0, activation_bytes=10, input_bytes=3,
                  checkpoint=True, state_bytes=50),
        ChunkWork(1.0, 2.0, 1.0, 1.0, activation_bytes=20, state_bytes=0),
    ]  # fmt: skip
    orders = rank_orders("interleaved-zb", 2, 1, 2)
    assert replay_memory(orders, works, [0, 1])[0] == 50 + 16


@pytest.mark.parametrize("name", PLAN_SCHEDULES)
def test_memory_over_time_peaks_at_the_replayed_peak(name: str) -> None:
    k, m = 4, 8
    v = 1 if name in ("gpipe", "1f1b") else 2
    chunks = k * v
    works = _works([float(10 + c) for c in range(chunks)], [100.0] * chunks)
    sim = simulate_schedule(works, name, k, m)
    assert len(sim.memory) == k
    for steps, peak in zip(sim.memory, sim.peak_bytes, strict=True):
        assert max(b for _, b in steps) == pytest.approx(peak)
        assert steps[0][1] == pytest.approx(sum(100.0 for c in range(chunks)) / k)
        assert steps[-1][1] == pytest.approx(steps[0][1])  # everything freed at the end


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_schedule_engine_agrees_with_the_classic_one(name: str) -> None:
    fwd, bwd, snd = [1.0, 2.0, 1.5], [2.0, 3.5, 2.5], [0.1, 0.2, 0.0]
    works = [ChunkWork(f, b, send_s=s) for f, b, s in zip(fwd, bwd, snd, strict=True)]
    for m in (3, 5, 8):
        a = simulate_schedule(works, name, 3, m)
        b = simulate(fwd, bwd, m, send_s=snd, schedule=name)
        assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)


# -- pre-flight and refusals ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,rule",
    [
        ({"schedule": "1f1b", "microbatches": 2}, "microbatches-vs-stages"),
        ({"schedule": "dualpipev", "microbatches": 4}, "microbatches-vs-stages"),
        ({"schedule": "zbv", "virtual_stages": 3}, "stages-per-rank"),
        ({"schedule": "gpipe", "virtual_stages": 2}, "stages-per-rank"),
        ({"schedule": "interleaved-1f1b", "microbatches": 9, "batch_size": 36}, "rounds"),
        ({"schedule": "zbv", "compile": True}, "no-compile-with-zero-bubble"),
    ],
)
def test_a_forced_rule_breaking_request_is_refused_naming_the_rule(
    kw: dict[str, object], rule: str
) -> None:
    with pytest.raises(RuleViolation) as info:
        plan(random_profile(16, 1), PlanRequest(gpus=4, baselines=False, **kw))  # type: ignore[arg-type]
    msg = str(info.value)
    assert msg.startswith(rule + ":") and "\n" not in msg
    assert isinstance(info.value, PlanningError)


@pytest.mark.parametrize("name", PLAN_SCHEDULES)
def test_forced_schedule_is_honoured(name: str) -> None:
    profile = random_profile(16, 2)
    p = plan(
        profile, PlanRequest(gpus=4, schedule=name, batch_size=32, microbatches=16, baselines=False)
    )
    v = 1 if name in ("gpipe", "1f1b") else 2
    assert p.schedule == name and p.virtual_stages == v and p.microbatches == 16
    assert len(p.stages) == 4 * v
    assert [s.rank for s in p.stages] == chunk_ranks(name, 4, v)
    assert [u for s in p.stages for u in s.units] == profile.unit_names
    assert preflight(p) == []
    assert 0 < p.lower_bound_s <= p.iteration_time_s * (1 + 1e-12)
    assert p.lower_bound_gap == pytest.approx(p.iteration_time_s / p.lower_bound_s - 1)
    assert p.method and len(p.rank_peak_bytes) == 4
    # The saved plan simulates back to its own prediction.
    assert simulate_plan(p).iteration_time_s == pytest.approx(p.iteration_time_s, rel=1e-9)
    if name in ("interleaved-zb", "zbv", "dualpipev"):
        assert all(
            s.backward_input_s + s.backward_weight_s == pytest.approx(s.backward_s)
            for s in p.stages
        )


def test_forced_virtual_stages_on_a_looped_schedule() -> None:
    p = plan(
        random_profile(16, 3),
        PlanRequest(
            gpus=2, schedule="interleaved-1f1b", virtual_stages=4, microbatches=8, baselines=False
        ),
    )
    assert p.virtual_stages == 4 and [s.rank for s in p.stages] == [0, 1] * 4


def test_old_plan_files_load_without_the_new_fields(tmp_path: Path) -> None:
    p = plan(random_profile(10, 1), PlanRequest(gpus=3, schedule="1f1b", microbatches=8))
    data = p.to_dict()
    for key in ("lower_bound_s", "lower_bound_gap", "method", "rank_peak_bytes"):
        del data["report"][key]
    del data["virtual_stages"]
    for s, r in zip(data["stages"], data["report"]["stages"], strict=True):
        del s["rank"]
        for key in ("backward_input_s", "backward_weight_s",
                    "microbatch_activation_bytes", "microbatch_input_bytes"):  # fmt: skip
            del r[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_plan(path)
    assert old.virtual_stages == 1 and old.lower_bound_s == 0 and old.rank_peak_bytes == []
    assert [s.rank for s in old.stages] == [0, 1, 2]
    assert simulate_plan(old).iteration_time_s == pytest.approx(p.iteration_time_s, rel=1e-9)


# -- the search ----------------------------------------------------------------------------


@settings(
    max_examples=16,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.integers(4, 12),
    st.integers(0, 10_000),
    st.integers(1, 4),
    st.sampled_from([8, 12, 16]),
    st.sampled_from([None, 2e8, 6e8]),
    st.sampled_from(["never", "auto"]),
    st.booleans(),
)
def test_auto_never_returns_a_rule_breaking_plan(
    n: int, seed: int, k: int, batch: int, mem: float | None, checkpoint: str, compile: bool
) -> None:
    k = min(k, n)
    profile = random_profile(n, seed, batch_size=batch)
    try:
        p = plan(
            profile,
            PlanRequest(
                gpus=k,
                schedule="auto",
                virtual_stages="auto",
                microbatches="auto",
                checkpoint=checkpoint,
                memory_per_device=None if mem is None else int(mem),
                baselines=False,
                compile=compile,
            ),
        )
    except PlanningError as exc:
        assert not isinstance(exc, RuleViolation)  # auto skips, never refuses
        assert mem is not None
        return
    assert preflight(p) == []
    if compile:  # torch.compile'd stages: never a schedule that splits backward
        assert p.schedule not in SPLIT_BACKWARD_SCHEDULES
    assert p.lower_bound_s <= p.iteration_time_s * (1 + 1e-12)
    if mem is not None:
        assert all(b * 1.1 <= mem * (1 + 1e-9) for b in p.rank_peak_bytes)
    # The plan's memory is the schedule's own replay of its chunks.
    sim = simulate_plan(p)
    assert max(sim.peak_bytes) == pytest.approx(max(p.rank_peak_bytes), rel=1e-6, abs=8 * k * 4)


def test_auto_weighs_every_schedule_and_is_never_slower_than_any_forced_one() -> None:
    profile = random_profile(16, 5)
    auto = plan(profile, PlanRequest(gpus=4, schedule="auto", microbatches=16, baselines=False))
    seen = {(r.schedule, r.virtual_stages) for r in auto.candidates}
    assert {s for s, _ in seen} == set(PLAN_SCHEDULES)
    assert ("interleaved-1f1b", 4) in seen
    for name in PLAN_SCHEDULES:
        forced = plan(profile, PlanRequest(gpus=4, schedule=name, microbatches=16, baselines=False))
        assert auto.iteration_time_s <= forced.iteration_time_s * (1 + 1e-12)


def _brute_force_time(profile, cluster, shape, **kw) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The fastest simulated iteration and the smallest bottleneck over every cut."""
    cm = cost_model_for(profile, cluster, shape, **kw)
    cand = Candidate(shape.microbatches, shape.schedule, cm, shape=shape, cluster=cluster)
    n, chunks = len(profile.units), shape.num_chunks
    best_t = best_b = math.inf
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = [0, *cuts, n]
        ev = cand.evaluate(bounds)
        if ev.fits:
            best_t = min(best_t, ev.iteration_time_s)
            best_b = min(best_b, max(c.time_s for c in ev.costs))
    return best_t, best_b


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_v1_optimum_equals_brute_force(name: str) -> None:
    """V = 1 stays exact: the plan's bottleneck is the smallest of every cut, and GPipe's
    iteration (the frontier walk) the fastest of every cut."""
    profile = random_profile(8, 11)
    cluster = Cluster.homogeneous(3, memory_bytes=None)
    m = 8
    p = plan(
        profile,
        PlanRequest(gpus=3, schedule=name, microbatches=m, baselines=False, checkpoint="never"),
    )
    shape = ScheduleShape.of(name, 3, 1, m)
    kw = dict(batch_size=32, checkpoint="never", state_bytes_per_parameter=16.0, headroom=0.1)
    best_t, best_b = _brute_force_time(profile, cluster, shape, **kw)
    assert p.min_bottleneck_s == pytest.approx(best_b, rel=1e-12)
    cm = cost_model_for(profile, cluster, shape, **kw)
    assert brute_force_partition(cm).bottleneck_s == pytest.approx(best_b, rel=1e-12)
    if name == "gpipe":
        assert p.iteration_time_s == pytest.approx(best_t, rel=1e-12)
    else:
        assert p.iteration_time_s >= best_t * (1 - 1e-12)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv", "dualpipev"])
def test_lower_bound_holds_for_every_cut(name: str) -> None:
    """The recorded lower bound is below the simulated time of every cut into K x V chunks,
    and the plan is within its stated gap of it."""
    profile = random_profile(7, 4)
    cluster = Cluster.homogeneous(2, memory_bytes=None)
    m = 4
    p = plan(
        profile,
        PlanRequest(
            gpus=2,
            schedule=name,
            virtual_stages=2,
            microbatches=m,
            baselines=False,
            checkpoint="never",
        ),
    )
    shape = ScheduleShape.of(name, 2, 2, m)
    kw = dict(batch_size=32, checkpoint="never", state_bytes_per_parameter=16.0, headroom=0.1)
    best_t, _ = _brute_force_time(profile, cluster, shape, **kw)
    assert p.lower_bound_s <= best_t * (1 + 1e-12)
    assert best_t <= p.iteration_time_s * (1 + 1e-12)
    assert p.iteration_time_s <= p.lower_bound_s * (1 + p.lower_bound_gap) * (1 + 1e-9)


# -- CLI and plots ---------------------------------------------------------------------------


def test_cli_schedule_names_are_the_plans() -> None:
    from autopipe.cli import build_parser

    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    choices = next(a.choices for a in plan_parser._actions if a.dest == "schedule")
    assert tuple(c for c in choices if c != "auto") == PLAN_SCHEDULES


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    random_profile(12, 6).save(path)
    return path


def test_cli_plans_a_forced_schedule_and_explains_its_bound(
    profile_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", str(profile_json), "--gpus", "3", "--schedule", "zbv", "--virtual-stages", "2"]
    assert main([*args, "--microbatches", "8", "--json", str(out), "-q"]) == 0
    p = load_plan(out)
    assert p.schedule == "zbv" and p.virtual_stages == 2 and len(p.stages) == 6
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Lower bound:" in text and "gap of at most" in text and "V = 2" in text


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--schedule", "zbv", "--virtual-stages", "3"], "stages-per-rank:"),
        (["--schedule", "1f1b", "--microbatches", "2"], "microbatches-vs-stages:"),
    ],
)
def test_cli_refuses_a_rule_breaking_request_with_one_line(
    profile_json: Path, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(profile_json), "--gpus", "3", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_cli_bad_schedule_or_v_value_exits_2(profile_json: Path) -> None:
    for extra in (["--schedule", "zb-h2"], ["--virtual-stages", "0"]):
        with pytest.raises(SystemExit) as info:
            main(["plan", str(profile_json), "--gpus", "3", *extra])
        assert info.value.code == 2


def test_plots_every_schedule_and_memory(tmp_path: Path) -> None:
    from autopipe.viz.gantt import timeline_figure
    from autopipe.viz.memory import plot_memory, plot_schedules

    profile = random_profile(12, 8)
    plans = plan_each_schedule(profile, PlanRequest(gpus=3, microbatches=4))
    assert isinstance(plans["1f1b"], type(plans["gpipe"]))
    assert isinstance(plans["dualpipev"], str) and "microbatches-vs-stages" in plans["dualpipev"]
    paths = plot_schedules(plans, tmp_path)
    assert [p.name for p in paths] == ["schedules.png", "schedules_memory.png"]
    for name, p in plans.items():
        if isinstance(p, str):
            continue
        (mem,) = plot_memory(p, tmp_path / f"memory_{name}")
        paths.append(mem)
        sim = simulate_plan(p)
        ax = timeline_figure(sim.timeline).axes[0]
        phases = {str(x.get_gid()) for x in ax.patches}
        labels = [t.get_text() for t in ax.get_yticklabels()]
        if p.virtual_stages > 1:  # one row per rank, its chunks named
            assert len(labels) == 3 and labels[0].startswith("rank 0 (c0, ")
        if name in ("interleaved-zb", "zbv"):  # B and W drawn apart
            assert {"task:backward_input", "task:backward_weight"} <= phases
    for path in paths:
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_cli_plot_draws_every_schedule_side_by_side(
    profile_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(profile_json), "--gpus", "3", "--microbatches", "8",
                 "--json", str(out), "-q"]) == 0  # fmt: skip
    plots = tmp_path / "plots"
    assert main(["plot", str(out), "--schedules", "--out", str(plots), "-q"]) == 0
    for name in ("timeline", "memory", "schedules", "schedules_memory"):
        path = plots / f"{name}.png"
        assert path.stat().st_size > 1000, name
    # Without a profile there is nothing to re-plan: one line, exit 2.
    bare = json.loads(out.read_text())
    bare["report"]["profile"] = None
    out.write_text(json.dumps(bare))
    capsys.readouterr()
    assert main(["plot", str(out), "--schedules", "--out", str(tmp_path / "p2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--schedules" in err[0]


# -- the zero-bubble chunks as the runtime runs them ----------------------------------------


def test_split_backward_is_priced_as_run() -> None:
    """A measured B + W above the whole backward (two autograd passes) is what a split chunk
    costs; the first chunk runs all of its backward in W (torch's is_first) and a
    re-materialized chunk all of it in B (the runtime runs it unsplit)."""
    prof = random_profile(8, seed=3)
    for u in prof.units:
        u.backward_input_s, u.backward_weight_s = 0.7 * u.backward_s, 0.5 * u.backward_s
    p = plan(prof, PlanRequest(gpus=2, microbatches=4, schedule="interleaved-zb", virtual_stages=2))
    first, *rest = p.stages
    assert first.backward_input_s == 0 and first.backward_weight_s == pytest.approx(
        first.backward_s
    )
    for s in rest:
        assert s.backward_input_s + s.backward_weight_s == pytest.approx(1.2 * s.backward_s)
        assert s.backward_input_s == pytest.approx(0.7 * s.backward_s)
    ckpt = plan(
        prof,
        PlanRequest(
            gpus=2, microbatches=4, schedule="interleaved-zb", virtual_stages=2, checkpoint="always"
        ),
    )
    for s in ckpt.stages:
        assert s.checkpoint
        assert (s.backward_input_s, s.backward_weight_s) == (pytest.approx(s.backward_s), 0.0)
    # Counted (or unsplit) profiles: B + W is the backward exactly.
    for u in prof.units:
        u.backward_input_s, u.backward_weight_s = 0.5 * u.backward_s, 0.5 * u.backward_s
    even = plan(
        prof, PlanRequest(gpus=2, microbatches=4, schedule="interleaved-zb", virtual_stages=2)
    )
    for s in even.stages[1:]:
        assert s.backward_input_s + s.backward_weight_s == pytest.approx(s.backward_s)


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_a_chunk_without_backward_splits_into_nothing(schedule: str) -> None:
    """A unit with no backward at all (a Llama's parameter-free rotary embedding, cut into a
    chunk of its own) is a chunk whose B and W are both 0, not a missing split."""
    prof = random_profile(8, seed=5)
    for u in prof.units:
        u.backward_input_s, u.backward_weight_s = 0.6 * u.backward_s, 0.4 * u.backward_s
    idle = prof.units[1]
    idle.backward_s = idle.backward_input_s = idle.backward_weight_s = 0.0
    p = plan(prof, PlanRequest(gpus=4, microbatches=8, schedule=schedule, virtual_stages=2))
    assert p.balance == [1] * 8
    assert p.stages[1].backward_s == 0 and p.iteration_time_s > 0
