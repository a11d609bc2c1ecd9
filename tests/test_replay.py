"""``autopipe replay``: a run's own durations through the planner's simulator.

A fake two-rank runtime runs each schedule's rank orders on an injected clock and records
them with the runtime's TimelineRecorder (known durations, dispatch, transfers, losses, step
start and end): replay must give back its step exactly, for every schedule. Then the real
thing: a 2-rank torchrun (gloo) of examples/gpt.py traced by ``autopipe run --trace`` and
replayed by the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from autopipe.planner.replay import ReplayError, replay, split_steps
from autopipe.runtime.recorder import TimelineRecorder
from distributed_cases import free_port, make_plan, tiny_gpt_files

from autopipe.cli import main
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_orders
from autopipe.core.timeline import Action, Timeline, load_chrome_trace, save_chrome_trace
from autopipe.core.vocabulary import PLAN_SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
V = {"gpipe": 1, "1f1b": 1}


@dataclass(frozen=True)
class Costs:
    """What the fake runtime spends (seconds): per chunk c, forward ``1 + c / 4``; backward
    2, its input part 1.25 and weight part 0.75; the loss 0.5; and around the actions."""

    dispatch_s: float = 0.125
    transfer_s: float = 0.375
    head_s: float = 0.25
    tail_s: float = 0.5
    loss_s: float = 0.5

    def seconds(self, a: Action) -> float:
        return {
            "forward": 1.0 + a.stage / 4,
            "backward": 2.0,
            "backward_input": 1.25,
            "backward_weight": 0.75,
        }[a.phase]


class Clock:
    """The injected clock: reads whatever the fake runtime set."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plan_for(schedule: str, k: int = 2, m: int = 4) -> Plan:
    v = V.get(schedule, 2)
    return make_plan([[f"u{c}"] for c in range(k * v)], m, 4 * m, schedule, virtual_stages=v)


def fake_run(plan: Plan, costs: Costs, steps: int = 1) -> tuple[Timeline, list[float]]:
    """Run ``plan``'s rank orders on two "ranks" of an injected clock, recorded by the
    runtime's TimelineRecorder, ``steps`` times; returns the timeline (device = rank) and
    each step's length: first rank's start to the last rank's end.

    A rank starts an action ``dispatch_s`` after its previous one ends (its first one
    ``head_s`` after its step starts) or, if later, when its input is there: at once from its
    own rank, ``transfer_s`` after the producer ends on the other. The last chunk's forward
    is followed by the loss; the step ends ``tail_s`` after the last action of any rank."""
    k, v, m = plan.num_stages, plan.virtual_stages, plan.microbatches
    last = k * v - 1
    ranks = chunk_ranks(plan.schedule, k, v)
    orders = rank_orders(plan.schedule, k, v, m)
    clock = Clock()
    recorders = [
        TimelineRecorder(["cpu"], num_stages=k * v, clocks={"wall": clock}, schedule=plan.schedule)
        for _ in range(k)
    ]
    lengths = []
    origin = 0.0
    for _ in range(steps):
        end: dict[Action, float] = {}
        free = [origin + r * 0.0625 for r in range(k)]  # the ranks start a little apart
        starts = list(free)
        ptr = [0] * k
        spans: list[tuple[int, str, Action, float, float]] = []
        while any(ptr[r] < len(orders[r]) for r in range(k)):
            moved = False
            for r in range(k):
                while ptr[r] < len(orders[r]):
                    a = orders[r][ptr[r]]
                    dep = _dependency(a, last, end)
                    if dep is False:
                        break
                    t = free[r] + (costs.head_s if ptr[r] == 0 else costs.dispatch_s)
                    if isinstance(dep, Action):
                        t = max(t, end[dep] + (costs.transfer_s if ranks[dep.stage] != r else 0))
                    e = t + costs.seconds(a)
                    spans.append((r, a.phase, a, t, e))
                    end[a] = e
                    if a.phase == "forward" and a.stage == last:
                        spans.append((r, "loss", a, e, e + costs.loss_s))
                        e += costs.loss_s
                    free[r] = e
                    ptr[r] += 1
                    moved = True
            assert moved, "the fake runtime deadlocked"
        step_end = max(free) + costs.tail_s
        for r in range(k):
            clock.now = starts[r]
            with recorders[r].mark("step", "cpu"):
                for rr, phase, a, t, e in spans:
                    if rr == r:
                        clock.now = t
                        with recorders[r].record(a.stage, a.microbatch, phase, "cpu"):
                            clock.now = e
                clock.now = step_end
        lengths.append(step_end - origin)
        origin = step_end + 1.0
    tasks, marks = [], []
    for r, rec in enumerate(recorders):
        one = rec.timeline()
        tasks += [replace(t, device=r) for t in one.tasks]
        marks += [replace(x, device=r) for x in one.marks]
    tasks.sort(key=lambda t: (t.start_s, t.stage))
    marks.sort(key=lambda x: (x.start_s, x.device))
    timeline = Timeline(tasks, k * v, label="measured", schedule=plan.schedule, marks=marks)
    return timeline, lengths


def _dependency(a: Action, last: int, end: dict[Action, float]) -> Action | bool | None:
    """The action ``a`` waits for (None: nothing; False: not done yet)."""
    if a.phase == "forward":
        dep = Action(a.stage - 1, a.microbatch, "forward") if a.stage > 0 else None
    elif a.phase in ("backward", "backward_input"):
        if a.stage == last:
            dep = Action(a.stage, a.microbatch, "forward")
        else:
            done = [
                Action(a.stage + 1, a.microbatch, p)
                for p in ("backward", "backward_input")
                if Action(a.stage + 1, a.microbatch, p) in end
            ]
            return done[0] if done else False
    else:
        dep = Action(a.stage, a.microbatch, "backward_input")
    if dep is None:
        return None
    return dep if dep in end else False


@pytest.mark.parametrize("schedule", PLAN_SCHEDULES)
@pytest.mark.parametrize("medians", [False, True])
def test_a_recorded_run_replays_to_its_own_step_for_every_schedule(
    schedule: str, medians: bool, tmp_path: Path
) -> None:
    plan = plan_for(schedule)
    timeline, lengths = fake_run(plan, Costs(), steps=2)
    # Through the Chrome trace file, as the CLI reads it.
    save_chrome_trace(timeline, tmp_path / "trace.json")
    steps = replay(load_chrome_trace(tmp_path / "trace.json"), plan, medians=medians)
    assert [s.step for s in steps] == [1, 2]
    for s, length in zip(steps, lengths, strict=True):
        assert s.measured_s == pytest.approx(length, abs=1e-9)
        assert s.replayed_s == pytest.approx(length, abs=1e-9)
        assert s.order_differs == []
        o = s.overheads
        assert o.dispatch_s == pytest.approx([0.125, 0.125])
        assert o.tail_s == pytest.approx(0.5)
        assert o.head_s[0] == pytest.approx(0.25)  # rank 0 waits for nobody
        assert o.loss_s == pytest.approx(0.5 * plan.microbatches)
        assert o.transfer_s["activations"] == pytest.approx(0.375)
        for r in s.ranks:  # idle = the step less the rank's actions (and losses)
            assert r.idle_replayed_s == pytest.approx(r.idle_measured_s, abs=1e-9)
            assert r.idle_measured_s == pytest.approx(length - r.busy_s, abs=1e-9)
        assert s.bubble_replayed == pytest.approx(s.bubble_measured, abs=1e-12)


@pytest.mark.parametrize(("schedule", "step_s"), [("gpipe", 10.0), ("1f1b", 10.0)])
def test_hand_computed_steps(schedule: str, step_s: float) -> None:
    """K = 2, M = 2, forward 1 s on both chunks (+ 0.5 s loss), backward 2 s, nothing
    between actions: GPipe rank 1 ends its backwards at 8, rank 0 its last at 10; 1F1B
    rank 0's second backward waits for rank 1's, which ends at 8."""
    plan = make_plan([["a"], ["b"]], 2, 4, schedule)
    costs = Costs(dispatch_s=0.0, transfer_s=0.0, head_s=0.0, tail_s=0.0)

    class Flat(Costs):
        def seconds(self, a: Action) -> float:
            return 1.0 if a.phase == "forward" else 2.0

    flat = Flat(**{f: getattr(costs, f) for f in costs.__dataclass_fields__})
    timeline, lengths = fake_run(plan, flat)
    # (rank 1 starts its step 0.0625 s late, but waits for rank 0's first forward anyway)
    assert lengths == [pytest.approx(step_s)]
    (s,) = replay(timeline, plan)
    assert s.replayed_s == pytest.approx(step_s)
    busy = sorted(r.busy_s for r in s.ranks)
    assert busy == pytest.approx([6.0, 7.0])  # rank 0: 2 F + 2 B; rank 1: also 2 losses


def test_replay_follows_the_plans_order_and_reports_a_different_one() -> None:
    plan = plan_for("1f1b")
    timeline, _ = fake_run(plan, Costs())
    # Swap two forwards' times on rank 0: the recorded order is no longer the plan's.
    f = [t for t in timeline.tasks if t.device == 0 and t.phase == "forward"][:2]
    swapped = [
        replace(t, start_s=o.start_s, end_s=o.end_s) if t in f else t
        for t, o in ((t, f[1] if t == f[0] else f[0]) for t in timeline.tasks)
    ]
    (s,) = replay(replace(timeline, tasks=swapped), plan)
    assert s.order_differs and s.order_differs[0].startswith("rank 0 at action 0")


def test_marks_round_trip_and_steps_split(tmp_path: Path) -> None:
    timeline, _ = fake_run(plan_for("zbv"), Costs(), steps=3)
    save_chrome_trace(timeline, tmp_path / "t.json")
    back = load_chrome_trace(tmp_path / "t.json")
    assert back.marks == pytest.approx(timeline.marks) or back.marks == timeline.marks
    assert [x.name for x in back.marked("step", 0)] == ["step"] * 3
    parts = split_steps(back)
    assert len(parts) == 3 and sum(len(p.tasks) for p in parts) == len(back.tasks)
    assert back.bubble_fraction == pytest.approx(timeline.bubble_fraction)  # marks not busy


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_trace_of_another_plan_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline, _ = fake_run(plan_for("interleaved-1f1b"), Costs())
    trace = tmp_path / "trace.json"
    save_chrome_trace(timeline, trace)
    plans = {
        "stages": make_plan([["a"], ["b"]], 4, 16, "gpipe"),
        "schedule": plan_for("looped-bfs"),
        "microbatches": make_plan([[f"u{c}"] for c in range(4)], 8, 32, "interleaved-1f1b", virtual_stages=2),
    }  # fmt: skip
    words = {
        "stages": "the trace has 4 chunks, the plan 2",
        "schedule": "the trace ran schedule interleaved-1f1b, the plan says looped-bfs",
        "microbatches": "lacks 16 of the plan's actions",
    }
    for name, plan in plans.items():
        path = tmp_path / f"{name}.json"
        plan.save(path)
        _one_line_exit_2(capsys, ["replay", str(trace), "--plan", str(path)], words[name])
    # A missing action.
    plan = tmp_path / "plan.json"
    plan_for("interleaved-1f1b").save(plan)
    gone = replace(
        timeline, tasks=[t for t in timeline.tasks if t.action != Action(1, 2, "forward")]
    )
    save_chrome_trace(gone, tmp_path / "gone.json")
    _one_line_exit_2(
        capsys, ["replay", str(tmp_path / "gone.json"), "--plan", str(plan)], "lacks 1 of the plan's actions (first: 1F2)"
    )  # fmt: skip
    _one_line_exit_2(
        capsys, ["replay", str(tmp_path / "nope.json"), "--plan", str(plan)], "trace file not found"
    )  # fmt: skip
    (tmp_path / "bad.json").write_text("{")
    _one_line_exit_2(
        capsys, ["replay", str(tmp_path / "bad.json"), "--plan", str(plan)], "not valid JSON"
    )


def test_a_single_process_trace_is_refused(tmp_path: Path) -> None:
    plan = plan_for("gpipe")
    timeline, _ = fake_run(plan, Costs())
    one_device = replace(timeline, tasks=[replace(t, device=0) for t in timeline.tasks])
    with pytest.raises(ReplayError, match="chunk 1 ran on device 0"):
        replay(one_device, plan)


def test_replay_of_a_real_two_rank_torchrun_trace(tmp_path: Path) -> None:
    """examples/gpt.py (test size) on 2 ranks (gloo, 1F1B, M = 2), traced by
    ``autopipe run --trace``, replayed by ``autopipe replay``."""
    model, plan = tiny_gpt_files(tmp_path, "1f1b")
    trace = tmp_path / "trace.json"
    run = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()),
            "-m", "autopipe", "run", str(model), "--plan", str(plan),
            "--steps", "3", "--timeout", "60", "-q", "--trace", str(trace),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    timeline = load_chrome_trace(trace)
    assert timeline.device_names == ["rank 0 (cpu)", "rank 1 (cpu)"]
    assert len(timeline.marked("step")) == 6 and len(timeline.marked("optimizer")) == 6
    per_step = {(t.device, t.action) for t in split_steps(timeline)[-1].tasks}
    assert per_step == {
        *((0, Action(0, mb, p)) for mb in (0, 1) for p in ("forward", "backward")),
        *((1, Action(1, mb, p)) for mb in (0, 1) for p in ("forward", "backward", "loss")),
    }
    out = tmp_path / "replay.json"
    cli = subprocess.run(
        [sys.executable, "-m", "autopipe", "replay", str(trace), "--plan", str(plan), "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    text = cli.stdout
    assert "replay: 1f1b, 2 ranks x 1 chunks, 2 micro-batches" in text
    for words in (
        "bubble",
        "idle",
        "dispatch between actions",
        "loss",
        "optimizer step",
        "unexplained remainder",
    ):
        assert words in text, text
    data = json.loads(out.read_text())
    assert [s["step"] for s in data["steps"]] == [1, 2, 3]
    for s in data["steps"]:
        assert math.isfinite(s["measured_s"]) and math.isfinite(s["replayed_s"])
        assert 0 < s["measured_s"] < 60 and 0 < s["replayed_s"] < 60
        # Its own durations, in the plan's order, which torch ran: the step comes back.
        assert s["order_differs"] == []
        assert abs(s["error"]) < 1e-6, s
        assert len(s["ranks"]) == 2
        assert all(0 <= r["idle_measured_s"] <= s["measured_s"] for r in s["ranks"])
        assert 0 <= s["bubble_measured"] < 1 and s["overheads"]["optimizer_s"] > 0


def test_run_refuses_a_trace_path_over_its_plan_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, plan = tiny_gpt_files(tmp_path, "gpipe")
    before = plan.read_text()
    _one_line_exit_2(
        capsys,
        ["run", str(model), "--plan", str(plan), "--trace", str(plan)],
        "--trace " + str(plan) + " is the input",
    )
    assert plan.read_text() == before


def test_the_python_function_takes_files_or_objects(tmp_path: Path) -> None:
    import autopipe

    plan = plan_for("looped-bfs")
    timeline, lengths = fake_run(plan, Costs(), steps=3)
    save_chrome_trace(timeline, tmp_path / "trace.json")
    plan.save(tmp_path / "plan.json")
    from_files = autopipe.replay(tmp_path / "trace.json", tmp_path / "plan.json", medians=True)
    from_objects = autopipe.replay(timeline, plan)
    for report in (from_files, from_objects):
        assert [s.replayed_s for s in report.steps] == pytest.approx(lengths)
        assert report.measured_s == pytest.approx(lengths[1])  # steps 2-3 (1 is warm-up)
        assert report.errors == pytest.approx([0.0, 0.0], abs=1e-12)
    data = from_files.to_dict()
    assert data["durations"] == "chunk medians" and len(data["steps"]) == 3
