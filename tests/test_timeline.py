"""The one timeline: a torch-free Task/Timeline that the simulator returns, the runtime's
recorder produces and the plots draw, with one Chrome trace writer and one reader."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from autopipe.planner.simulate import fill_drain_bubble, simulate
from autopipe.runtime import GPipe
from autopipe.runtime.recorder import TimelineRecorder
from torch import nn

from autopipe.core.plan import Plan, StagePlan
from autopipe.core.plan_report import StageReport
from autopipe.core.timeline import (
    PHASES,
    Action,
    Task,
    Timeline,
    TimelineFormatError,
    load_chrome_trace,
    to_chrome_trace,
)

DATA = Path(__file__).parent / "data"


class Ticks:
    """A fake clock: every read is one second later than the last (thread-safe)."""

    def __init__(self) -> None:
        self.now = -1.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += 1.0
            return self.now


# -- the reader opens what earlier versions wrote ----------------------------------------------


def test_reader_opens_the_runtimes_old_F3_traces() -> None:
    """``trace_runtime_F3.json`` was written by the runtime's ``Timeline.save_chrome_trace``
    before the timelines were one: events named "F3", one process per device, named."""
    tl = load_chrome_trace(DATA / "trace_runtime_F3.json")
    assert tl.num_stages == 3 and tl.num_microbatches == 2
    assert Counter(t.phase for t in tl.tasks) == {"forward": 6, "backward": 6, "recompute": 2}
    assert [tl.device_name(d) for d in tl.stage_devices()] == ["cuda:0", "cuda:0", "cpu"]
    assert tl.device_groups() == [[0, 1], [2]] and tl.shared
    fwd = {(t.stage, t.microbatch): t for t in tl.of("forward")}
    assert fwd[(1, 1)].start_s == pytest.approx(2e-3) and fwd[(1, 1)].duration_s == pytest.approx(
        1e-3
    )
    bwd = {(t.stage, t.microbatch): t for t in tl.of("backward")}
    for rec in tl.of("recompute"):  # still nested in its backward
        outer = bwd[(rec.stage, rec.microbatch)]
        assert outer.start_s < rec.start_s < rec.end_s < outer.end_s
    # Overlaps count once: the stage is busy for its forwards and backwards only.
    assert tl.busy_s(0) == pytest.approx(2 * 1e-3 + 2 * 2e-3)


def test_reader_opens_the_plots_old_forward_3_traces() -> None:
    """``trace_viz_forward3.json`` was written by ``autopipe.viz``'s
    ``to_chrome_trace``: "forward 3" names, a process per device group (unnamed),
    label and schedule in ``otherData``; a 1F1B simulation plus a loss task."""
    tl = load_chrome_trace(DATA / "trace_viz_forward3.json")
    assert (tl.label, tl.schedule, tl.num_stages, tl.num_microbatches) == ("measured", "1f1b", 3, 3)
    assert Counter(t.phase for t in tl.tasks) == {
        "forward": 9,
        "backward": 9,
        "send": 6,
        "recompute": 3,
        "loss": 1,
    }
    (loss,) = tl.of("loss")
    assert loss.stage == 2 and loss.microbatch == -1
    assert tl.device_groups() == [[0, 1], [2]]
    # The simulation it was written from, task for task.
    sim = simulate(
        [1e-3, 2e-3, 1e-3],
        [2e-3, 3e-3, 2e-3],
        3,
        send_s=[2e-4, 2e-4, 0],
        recompute_s=[0, 1e-3, 0],
        schedule="1f1b",
    )
    read = {t.action: t for t in tl.tasks}
    for t in sim.tasks:
        assert read[t.action].start_s == pytest.approx(t.start_s, abs=1e-12)
        assert read[t.action].end_s == pytest.approx(t.end_s, abs=1e-12)


def test_reader_takes_tasks_from_args_only() -> None:
    """Events without ``stage``, ``microbatch`` and ``phase`` in ``args`` (names only, with
    ``tid`` as the stage, or begin/end pairs) are not tasks: the reader reads the one dialect
    the writer writes."""
    events = [
        {"ph": "X", "name": "F0", "pid": 0, "tid": 0, "ts": 0, "dur": 10},
        {"ph": "X", "name": "forward 0", "pid": 1, "tid": 1, "ts": 10, "dur": 10},
        {"ph": "B", "name": "backward mb 0", "pid": 1, "tid": 1, "ts": 20},
        {"ph": "E", "pid": 1, "tid": 1, "ts": 40},
        {"ph": "X", "name": "stage 0 B0", "pid": 0, "tid": 7, "ts": 40, "dur": 20},
        {"ph": "X", "name": "R0", "pid": 0, "tid": 0, "ts": 41, "dur": 5},
        {
            "ph": "X",
            "name": "fwd 1",
            "pid": 0,
            "tid": 0,
            "ts": 50,
            "dur": 5,
            "args": {"stage": 0, "microbatch": 1, "phase": "fwd"},
        },
        {"ph": "X", "name": "optimizer step", "pid": 0, "tid": 0, "ts": 60, "dur": 5},
    ]
    with pytest.raises(TimelineFormatError, match="no pipeline tasks"):
        load_chrome_trace({"traceEvents": events}, num_stages=3)
    events.append(
        {
            "ph": "X",
            "name": "F1",
            "pid": 0,
            "tid": 0,
            "ts": 70,
            "dur": 10,
            "args": {"stage": 0, "microbatch": 1, "phase": "forward"},
        }
    )
    tl = load_chrome_trace({"traceEvents": events}, num_stages=3)
    assert tl.num_stages == 3 and [(t.stage, t.microbatch, t.phase) for t in tl.tasks] == [
        (0, 1, "forward")
    ]
    with pytest.raises(TimelineFormatError, match="no pipeline tasks"):
        load_chrome_trace([{"ph": "X", "name": "step", "ts": 0}])


# -- the writer: one dialect -------------------------------------------------------------------


def _interleaved_zero_bubble() -> Timeline:
    """Every phase, and what the next schedules need: 4 stages (model chunks) on 2 ranks,
    stage s on rank s % 2, backward split into input and weight gradients."""
    tasks = []
    t = 0.0
    for m in range(2):
        for s in range(4):
            tasks.append(Task(s, m, "forward", t, t + 1.0, s % 2))
            tasks.append(Task(s, m, "send", t + 1.0, t + 1.25, s % 2))
            t += 1.25
    tasks.append(Task(3, -1, "loss", t, t + 0.5, 1))
    t += 0.5
    for m in range(2):
        for s in reversed(range(4)):
            tasks.append(Task(s, m, "recompute", t, t + 1.0, s % 2))
            tasks.append(Task(s, m, "backward_input", t + 1.0, t + 2.0, s % 2))
            tasks.append(Task(s, m, "backward_weight", t + 2.0, t + 2.5, s % 2))
            t += 2.5
    return Timeline(
        tasks, 4, label="measured", schedule="interleaved_zb", device_names=["rank 0", "rank 1"]
    )


def test_writer_writes_one_dialect_that_perfetto_opens() -> None:
    tl = _interleaved_zero_bubble()
    assert {t.phase for t in tl.tasks} == set(PHASES) - {"backward"}
    trace = json.loads(json.dumps(to_chrome_trace(tl), allow_nan=False))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert threads == {(s % 2, s): f"stage {s}" for s in range(4)}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(tl.tasks)
    letters = {"forward": "F", "send": "S", "recompute": "R"}
    letters |= {"backward_input": "I", "backward_weight": "W"}
    for e, t in zip(slices, tl.tasks, strict=True):
        expected = "loss" if t.microbatch < 0 else f"{letters[t.phase]}{t.microbatch}"
        assert e["name"] == expected and e["cat"] == t.phase
        assert e["args"] == {"stage": t.stage, "microbatch": t.microbatch, "phase": t.phase}
        assert (e["pid"], e["tid"]) == (t.device, t.stage)
        assert e["ts"] >= 0 and e["dur"] >= 0
    back = load_chrome_trace(trace)
    assert (back.label, back.schedule, back.num_stages) == (tl.label, tl.schedule, 4)
    assert back.device_names == tl.device_names
    assert [t.action for t in back.tasks] == [t.action for t in tl.tasks]
    assert [t.device for t in back.tasks] == [t.device for t in tl.tasks]
    assert [t.start_s for t in back.tasks] == pytest.approx([t.start_s for t in tl.tasks])
    assert back.bubble_fraction == pytest.approx(tl.bubble_fraction)
    assert tl.device_groups() == [[0, 2], [1, 3]] and tl.shared


def test_a_stage_without_tasks_keeps_its_row(tmp_path: Path) -> None:
    tl = Timeline([Task(0, 0, "forward", 0.0, 1.0, 0)], 3)
    path = tmp_path / "t.json"
    tl.save_chrome_trace(path)
    back = load_chrome_trace(path)
    assert back.num_stages == 3 and back.device_groups() == [[0], [1], [2]]


def test_tasks_and_timelines_check_their_fields() -> None:
    with pytest.raises(ValueError, match="unknown task phase 'fwd'"):
        Task(0, 0, "fwd", 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="do not fit a 2-stage timeline"):
        Timeline([Task(2, 0, "forward", 0.0, 1.0, 0)], 2)
    task = Task(2, 3, "backward_weight", 0.0, 1.0, 0)
    assert task.action == Action(2, 3, "backward_weight") and str(task.action) == "2W3"


# -- simulator, recorder and plots exchange the one type ---------------------------------------


def _tiny_plan(k: int, m: int) -> Plan:
    return Plan(
        num_stages=k,
        microbatches=m,
        microbatch_size=1,
        batch_size=m,
        stages=[
            StagePlan(
                index=s,
                device="cpu",
                units=[f"u{s}"],
                report=StageReport(forward_s=1e-3, backward_s=2e-3),
            )
            for s in range(k)
        ],
    )


def test_simulator_recorder_and_plots_exchange_one_timeline(tmp_path: Path) -> None:
    import autopipe.planner
    import autopipe.runtime

    import autopipe.viz
    from autopipe.viz.gantt import timeline_figure
    from autopipe.viz.predict import predicted_timeline

    assert autopipe.runtime.Timeline is autopipe.viz.Timeline is autopipe.planner.Timeline
    assert autopipe.runtime.Timeline is Timeline
    simulated = simulate([1.0, 2.0], [2.0, 3.0], 4).timeline
    recorder = TimelineRecorder(["cpu"], num_stages=2, clocks={"ticks": Ticks()})
    cpu = torch.device("cpu")
    for m in range(4):
        for s in range(2):
            with recorder.record(s, m, "forward", cpu):
                pass
    recorded = recorder.timeline()
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), [1, 1], ["cpu"] * 2, chunks=4)
    pipe(torch.randn(8, 4)).sum().backward()
    executed = pipe.last_timeline
    loaded = load_chrome_trace(recorded.to_chrome_trace())
    predicted = predicted_timeline(_tiny_plan(2, 4))
    for tl in (simulated, recorded, executed, loaded, predicted):
        assert type(tl) is Timeline and tl.num_stages == 2
        assert all(type(t) is Task for t in tl.tasks)
        ax = timeline_figure(tl).axes[0]
        boxes = [p for p in ax.patches if str(p.get_gid()).startswith("task:")]
        assert len(boxes) == len(tl.tasks)
    paths = autopipe.viz.plot_all(_tiny_plan(2, 4), tmp_path, timeline=executed, compare=False)
    assert [p.name for p in paths] == [
        "timeline.png",
        "memory.png",
        "timeline_measured.png",
        "balance.png",
    ]
    with pytest.raises(TypeError, match="must be a Timeline"):
        autopipe.viz.plot_all(_tiny_plan(2, 4), tmp_path, timeline=executed.tasks)


def test_recorder_reads_every_clock_it_is_given() -> None:
    a, b = Ticks(), Ticks()
    recorder = TimelineRecorder(["cpu"], num_stages=1, clocks={"a": a, "b": lambda: 10 * b()})
    cpu = torch.device("cpu")
    with recorder.record(0, 0, "forward", cpu):  # each clock read at start and end
        pass
    span = recorder.begin(0, -1, "loss", torch.device("meta"))  # a device not seen before
    recorder.end(span)
    on_a, on_b = recorder.timeline("a"), recorder.timeline("b")
    assert [(t.start_s, t.end_s) for t in on_a.tasks] == [(1.0, 2.0), (3.0, 4.0)]
    assert [(t.start_s, t.end_s) for t in on_b.tasks] == [(10.0, 20.0), (30.0, 40.0)]
    assert recorder.timeline().tasks == on_a.tasks  # the first clock by default
    assert on_a.device_names == ["cpu", "meta"] and [t.device for t in on_a.tasks] == [0, 1]
    with pytest.raises(KeyError, match="no clock 'c'"):
        recorder.timeline("c")
    with pytest.raises(ValueError, match="unknown task phase"):
        recorder.begin(0, 0, "F", cpu)


def test_pipeline_times_its_tasks_on_an_injected_clock() -> None:
    """All stages on one device run in the caller's thread, so a counting clock gives exact
    durations: one tick per task, three for a backward with its recompute nested inside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = GPipe(model, [2, 1], ["cpu"] * 2, chunks=3, checkpoint="always")
    pipe.timeline_clocks = {"ticks": Ticks(), "wall": None}
    pipe(torch.randn(6, 4)).sum().backward()
    tl = pipe.last_timeline
    assert {t.duration_s for t in tl.of("forward")} == {1.0} and len(tl.of("forward")) == 6
    assert {t.duration_s for t in tl.of("recompute")} == {1.0}
    assert {t.duration_s for t in tl.of("backward")} == {3.0}
    wall = pipe.last_recorder.timeline("wall")
    assert [t.action for t in wall.tasks] == [t.action for t in tl.tasks]
    assert all(0.0 <= t.duration_s < 1.0 for t in wall.tasks)


# -- bench: measure (runtime) and compare (pure) -----------------------------------------------


def test_bench_compare_is_pure_arithmetic_on_timelines() -> None:
    from autopipe.runtime.step_measurement import Measurement, StepMeasurement

    from autopipe.bench_report import compare

    plan = _tiny_plan(2, 2)

    def step(scale: float) -> StepMeasurement:
        tasks = [
            Task(0, 0, "forward", 0.0, 1.0 * scale, 0),
            Task(0, 1, "forward", 1.0 * scale, 2.0 * scale, 0),
            Task(1, 0, "forward", 2.0 * scale, 3.0 * scale, 0),
            Task(1, 1, "forward", 3.0 * scale, 4.0 * scale, 0),
            Task(1, -1, "loss", 4.0 * scale, 4.5 * scale, 0),
            Task(1, -1, "loss", 4.5 * scale, 5.5 * scale, 0),
            Task(1, 0, "backward", 5.5 * scale, 7.5 * scale, 0),
            Task(1, 1, "backward", 7.5 * scale, 9.5 * scale, 0),
            Task(0, 0, "backward", 9.5 * scale, 11.5 * scale, 0),
            Task(0, 1, "backward", 11.5 * scale, 13.5 * scale, 0),
        ]
        tl = Timeline(tasks, 2, label="measured", device_names=["cpu"])
        return StepMeasurement(tl, tl, iteration_s=13.5 * scale, step_wall_s=14 * scale)

    measurement = Measurement(["cpu", "cpu"], "wall", [step(1e-3), step(3e-3), step(2e-3)])
    result = compare(plan, measurement, executor_overhead_s=(1e-4, 2e-4))
    s0, s1 = result.stages
    assert s0.forward_measured_s == pytest.approx(2e-3) and s0.backward_measured_s == pytest.approx(
        4e-3
    )
    # The loss (0.5 and 1 units, run once) is charged to the last stage per micro-batch.
    assert s1.forward_measured_s == pytest.approx(2e-3 + 1e-3 / 2)
    assert s1.backward_measured_s == pytest.approx(4e-3 + 2e-3 / 2)
    assert s0.forward_predicted_s == pytest.approx(1e-3 + 1e-4)
    assert s0.backward_predicted_s == pytest.approx(2e-3 + 2e-4)
    assert result.iteration_measured_s == pytest.approx(13.5 * 2e-3)
    assert result.iteration_wall_s == pytest.approx(13.5 * 2e-3)
    assert result.step_measured_s == pytest.approx(14 * 2e-3)
    # Both stages on one CPU: the prediction is every task one after another.
    assert result.predicted.shared
    assert result.iteration_predicted_s == pytest.approx(2 * 2 * (1.1e-3 + 2.2e-3))
    assert result.measured.label == "measured (wall clock)"
    assert measurement.steps[-1].timeline.label == "measured"  # compare changed nothing


def test_timeline_and_compare_modules_import_without_torch() -> None:
    code = (
        "import sys, autopipe.bench_report, autopipe.core.timeline; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- one bubble formula, one colour per phase --------------------------------------------------


def test_one_bubble_formula() -> None:
    import autopipe.runtime.schedule as schedule

    import autopipe.viz.bubble as bubble

    # One formula under its one name: the plots import it, no module renames it.
    assert bubble.fill_drain_bubble is fill_drain_bubble
    assert not hasattr(schedule, "bubble_fraction") and not hasattr(bubble, "closed_form_bubble")
    assert fill_drain_bubble(8, 4) == pytest.approx(3 / 11)
    from autopipe.explain import explain

    plan = _tiny_plan(4, 8)
    assert f"(K-1)/(M+K-1) = {100 * 3 / 11:.1f}%" in explain(plan)


def test_every_phase_has_a_colour() -> None:
    from autopipe.viz.style import PHASE_COLORS

    assert set(PHASE_COLORS) == set(PHASES)
