"""Plots render from small real plans, are valid images, and draw what the plan says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from viz_plans import _check_png

from autopipe.core.plan import Plan, load_plan
from autopipe.core.profile import Profile
from autopipe.core.timeline import (
    Task,
    Timeline,
    TimelineFormatError,
    load_chrome_trace,
    to_chrome_trace,
)
from autopipe.viz import plot_all
from autopipe.viz.predict import predicted_timeline


def test_chrome_trace_round_trip(onefoneb_plan: Plan) -> None:
    tl = predicted_timeline(onefoneb_plan)
    back = load_chrome_trace(json.loads(json.dumps(to_chrome_trace(tl))))
    assert back.num_stages == tl.num_stages
    key = lambda t: (t.stage, t.microbatch, t.phase)  # noqa: E731
    for a, b in zip(sorted(tl.tasks, key=key), sorted(back.tasks, key=key), strict=True):
        assert key(a) == key(b)
        assert a.start_s == pytest.approx(b.start_s, abs=1e-9)
        assert a.end_s == pytest.approx(b.end_s, abs=1e-9)
    assert back.bubble_fraction == pytest.approx(tl.bubble_fraction, abs=1e-9)


def test_chrome_trace_from_events_and_errors(tmp_path: Path) -> None:
    # Executor-style events ("F3", "B0"), the task in args.
    def event(name: str, stage: int, phase: str, ts: int, dur: int) -> dict[str, object]:
        args = {"stage": stage, "microbatch": 0, "phase": phase}
        return {"ph": "X", "name": name, "tid": stage, "pid": 0, "ts": ts, "dur": dur, "args": args}

    events = [
        event("F0", 0, "forward", 0, 10),
        event("F0", 1, "forward", 10, 10),
        event("B0", 1, "backward", 20, 20),
        event("B0", 0, "backward", 40, 20),
        {"ph": "M", "name": "thread_name", "tid": 0, "pid": 0},
    ]
    tl = load_chrome_trace({"traceEvents": events})
    assert tl.num_stages == 2 and tl.iteration_s == pytest.approx(60e-6)
    assert tl.shared  # both stages in one trace process = one device
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TimelineFormatError, match="not valid JSON"):
        load_chrome_trace(bad)
    with pytest.raises(TimelineFormatError, match="no pipeline tasks"):
        load_chrome_trace({"traceEvents": [{"ph": "X", "name": "step", "ts": 0}]})


def test_plot_all_then_redraw_from_plan_alone(
    profile: Profile, gpipe_plan: Plan, tmp_path: Path
) -> None:
    from autopipe.viz import collect_plot_data

    p = Plan.from_dict(json.loads(json.dumps(gpipe_plan.to_dict())))
    before = json.dumps(p.to_dict(), sort_keys=True)
    paths = plot_all(p, tmp_path / "a", profile=profile)
    assert [x.name for x in paths] == [
        "timeline.png",
        "memory.png",
        "bubble.png",
        "balance.png",
        "scaling.png",
    ]
    for path in paths:
        _check_png(path)
    # Plotting never writes into the plan it draws.
    assert json.dumps(p.to_dict(), sort_keys=True) == before
    # The data stored in the plan by its owner (as `autopipe plan --plot` does): a saved plan
    # redraws all four without the profile.
    data = collect_plot_data(p, profile)
    again_from_data = plot_all(p, tmp_path / "d", plot_data=data)
    assert [x.name for x in again_from_data] == [x.name for x in paths]
    assert json.dumps(p.to_dict(), sort_keys=True) == before
    p.plot_data = data
    p.save(tmp_path / "plan.json")
    again = plot_all(load_plan(tmp_path / "plan.json"), tmp_path / "b", formats=("svg",))
    assert [x.name for x in again] == [
        "timeline.svg",
        "memory.svg",
        "bubble.svg",
        "balance.svg",
        "scaling.svg",
    ]
    # A plan without stored data still gets its timeline and balance.
    bare = plot_all(Plan.from_dict(gpipe_plan.to_dict()), tmp_path / "c")
    assert [x.name for x in bare] == ["timeline.png", "memory.png", "balance.png"]


def test_plot_all_compares_on_the_placement_that_ran(
    gpipe_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import autopipe.viz.gantt as gantt

    drawn: dict[str, tuple[Timeline, Timeline | None]] = {}

    def fake_plot(tl: Timeline, out: Path, *, compare=None, formats=("png",)) -> list[Path]:
        drawn[Path(out).name] = (tl, compare)
        return [Path(out)]

    monkeypatch.setattr(gantt, "plot_timeline", fake_plot)
    # A measured run with all four stages on one CPU.
    shared = predicted_timeline(gpipe_plan, devices=["cpu"] * 4)
    measured = Timeline(shared.tasks, 4, label="measured", device_names=["cpu"])
    plot_all(Plan.from_dict(gpipe_plan.to_dict()), tmp_path, timeline=measured)
    assert set(drawn) == {"timeline", "timeline_measured", "timeline_compare"}
    assert not drawn["timeline"][0].shared  # the plan's own prediction: dedicated devices
    predicted, compared = drawn["timeline_compare"]
    assert predicted.shared and compared is measured
    assert predicted.iteration_s == pytest.approx(shared.iteration_s)


def test_titles_print_seconds_without_exponents() -> None:
    from autopipe.viz.gantt import timeline_title

    tl = Timeline([Task(0, 0, "forward", 0.0, 2.0, 0), Task(0, 0, "backward", 2.0, 5.0, 0)], 1)
    assert "iteration 5 s" in timeline_title(tl)  # was "5e+03 ms"
    from autopipe.core.humanize import format_seconds

    assert [format_seconds(x) for x in (5e-5, 0.0123, 12.34, 1234.5)] == [
        "50 us",
        "12.3 ms",
        "12.3 s",
        "1234 s",
    ]


def test_malformed_chrome_traces_are_format_errors(tmp_path: Path) -> None:
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff")
    with pytest.raises(TimelineFormatError, match="not a JSON text file"):
        load_chrome_trace(binary)
    with pytest.raises(TimelineFormatError, match="not a Chrome trace"):
        load_chrome_trace({"traceEvents": 5})
    # Begin/end events are not tasks; the complete event counts.
    events = [
        {"ph": "B", "name": "F0", "tid": 0, "ts": 0},
        {"ph": "E", "tid": 0},
        {
            "ph": "X",
            "name": "F1",
            "tid": 0,
            "ts": 0,
            "dur": 5,
            "args": {"stage": 0, "microbatch": 1, "phase": "forward"},
        },
    ]
    tl = load_chrome_trace({"traceEvents": events, "otherData": 3})
    assert len(tl.tasks) == 1 and tl.iteration_s == pytest.approx(5e-6)
