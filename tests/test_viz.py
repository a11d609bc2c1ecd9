"""Plots render from small real plans, are valid images, and draw what the plan says."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from autopipe.planner import Cluster, plan
from autopipe.planner.simulate import fill_drain_bubble

from autopipe.core.plan import Plan, load_plan
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest
from autopipe.core.timeline import (
    Task,
    Timeline,
    TimelineFormatError,
    load_chrome_trace,
    to_chrome_trace,
)
from autopipe.viz import plot_all
from autopipe.viz.balance import balance_figure
from autopipe.viz.data import balance_data, bubble_data, scaling_data
from autopipe.viz.gantt import plot_timeline, timeline_figure
from autopipe.viz.predict import predicted_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _profile(n: int = 12, batch: int = 32) -> Profile:
    """A small hand-made profile: uneven units, a heavy last unit (like an LM head)."""
    units = [
        UnitProfile(
            name=f"u{i}",
            forward_s=1e-3 * (1 + i % 3) * (3 if i == n - 1 else 1),
            backward_s=2e-3 * (1 + i % 3) * (3 if i == n - 1 else 1),
            forward_overhead_s=1e-4,
            backward_overhead_s=2e-4,
            parameter_count=1_000_000 * (6 if i == n - 1 else 1),
            parameter_bytes=4_000_000 * (6 if i == n - 1 else 1),
            activation_bytes=8_000_000,
            output_bytes=1_000_000,
        )
        for i in range(n)
    ]
    return Profile(units=units, cut_bytes=[1_000_000] * (n - 1), batch_size=batch, input_bytes=1000)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return _profile()


@pytest.fixture(scope="module")
def gpipe_plan(profile: Profile) -> Plan:
    return plan(
        profile, PlanRequest(gpus=4, batch_size=32, microbatches="auto", memory_per_device=2**30)
    )


@pytest.fixture(scope="module")
def onefoneb_plan(profile: Profile) -> Plan:
    # Finite links (sends on the timeline) and checkpointing (recompute boxes).
    cluster = Cluster.homogeneous(4, link_bandwidth_bytes_per_s=2e9)
    return plan(
        profile,
        PlanRequest(
            cluster=cluster, batch_size=32, microbatches=8, schedule="1f1b", checkpoint="always"
        ),
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _check_png(path: Path, min_w: int = 600, min_h: int = 250) -> None:
    width, height = _png_size(path)
    assert min_w <= width <= 4000 and min_h <= height <= 4000, (width, height)
    assert path.stat().st_size > 10_000  # a real drawing, not an empty canvas


def _drawn_idle_fraction(ax) -> float:
    """Idle share recovered from the drawn patches: row length x rows minus the task boxes."""
    tasks = [p for p in ax.patches if str(p.get_gid()).startswith("task:")]
    bubbles = [p for p in ax.patches if p.get_gid() == "bubble"]
    rows = {round(p.get_y() + p.get_height() / 2) for p in tasks + bubbles}
    x0, x1 = ax.get_xlim()
    area = len(rows) * (x1 - x0)
    # Task boxes of one row never overlap in a simulated timeline, so widths add up.
    busy = sum(p.get_width() for p in tasks)
    idle_drawn = sum(p.get_width() for p in bubbles)
    assert abs((area - busy) - idle_drawn) <= 1e-6 * area  # shading = complement of the boxes
    return (area - busy) / area


@pytest.mark.parametrize("which", ["gpipe_plan", "onefoneb_plan"])
def test_timeline_idle_area_matches_plan_bubble(which: str, request, tmp_path: Path) -> None:
    p: Plan = request.getfixturevalue(which)
    tl = predicted_timeline(p)
    assert tl.iteration_s == pytest.approx(p.iteration_time_s, rel=1e-9)
    fig = timeline_figure(tl)
    ax = fig.axes[0]
    assert abs(_drawn_idle_fraction(ax) - p.bubble_fraction) < 0.01
    phases = {str(x.get_gid()) for x in ax.patches}
    if p.schedule == "1f1b":
        assert {"task:forward", "task:backward", "task:recompute", "task:send"} <= phases
    # Micro-batch numbers are written in the boxes where they fit.
    assert any(t.get_text() == "0" for t in ax.texts)
    assert f"bubble {100 * p.bubble_fraction:.1f}%" in ax.get_title()
    paths = plot_timeline(tl, tmp_path / "timeline", formats=("png", "svg"))
    _check_png(paths[0])
    assert paths[1].read_text().lstrip().startswith("<?xml")


def test_gpipe_bubble_equals_closed_form_for_equal_stages(tmp_path: Path) -> None:
    k, m = 4, 8
    # Equal stages: the simulator's fill-drain bubble is exactly (K-1)/(M+K-1).
    from autopipe.planner.simulate import simulate

    sim = simulate([1.0] * k, [2.0] * k, m)
    tl = sim.timeline
    assert isinstance(tl, Timeline) and tl.num_stages == k
    assert tl.bubble_fraction == pytest.approx(fill_drain_bubble(m, k))
    ax = timeline_figure(tl).axes[0]
    assert _drawn_idle_fraction(ax) == pytest.approx(fill_drain_bubble(m, k), abs=1e-9)


def test_compare_shares_time_axis(gpipe_plan: Plan, tmp_path: Path) -> None:
    predicted = predicted_timeline(gpipe_plan)
    # A "measured" run 30% slower than predicted.
    measured = Timeline(
        [
            Task(t.stage, t.microbatch, t.phase, 1.3 * t.start_s, 1.3 * t.end_s, t.device)
            for t in predicted.tasks
        ],
        predicted.num_stages,
        label="measured",
    )
    fig = timeline_figure(predicted, compare=measured)
    top, bottom = fig.axes[:2]
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_xlim() == bottom.get_xlim()
    assert top.get_xlim()[1] == pytest.approx(1.3 * predicted.iteration_s * 1e3)
    assert "measured" in bottom.get_title()
    _check_png(plot_timeline(predicted, tmp_path / "cmp", compare=measured)[0], min_h=400)


def test_shared_device_timeline(gpipe_plan: Plan) -> None:
    shared = predicted_timeline(gpipe_plan, devices=["cpu"] * gpipe_plan.num_stages)
    # One device runs everything one task at a time: no overlap, no idle device time.
    spans = sorted((t.start_s, t.end_s) for t in shared.tasks)
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
    total = sum(s.time_s for s in gpipe_plan.stages) * gpipe_plan.microbatches
    assert shared.iteration_s == pytest.approx(total)
    assert shared.bubble_fraction == pytest.approx(0.0, abs=1e-9)
    assert shared.iteration_s > gpipe_plan.iteration_time_s
    assert "shared" in timeline_figure(shared).axes[0].get_title()


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


def test_bubble_plot_data_and_image(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.bubble import bubble_figure, plot_bubble

    data = bubble_data(gpipe_plan, profile, ks=[2, 4])
    k4 = next(c for c in data["curves"] if c["num_stages"] == 4)
    chosen = next(p for p in k4["points"] if p["microbatches"] == gpipe_plan.microbatches)
    assert chosen["bubble_fraction"] == pytest.approx(gpipe_plan.bubble_fraction)
    # M was chosen automatically, so no other M of the same K is faster.
    best = max(p["throughput"] for p in k4["points"] if p["feasible"])
    assert chosen["throughput"] == pytest.approx(best)
    assert [p["microbatches"] for p in k4["points"]] == [1, 2, 4, 8, 16, 32]
    fig = bubble_figure(data)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    stars = [ln for ax_ in fig.axes for ln in ax_.get_lines() if ln.get_marker() == "*"]
    assert stars and all(ln.get_xdata()[0] == gpipe_plan.microbatches for ln in stars)
    rule = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [16, 16]]
    assert rule, "GPipe's M >= 4K line is drawn at M = 16 for K = 4"
    _check_png(plot_bubble(data, tmp_path / "bubble")[0])


def test_balance_plot(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.balance import plot_balance

    data = balance_data(gpipe_plan, profile)
    names = [s["name"] for s in data["strategies"]]
    assert names == ["autopipe", "uniform", "parameters"]
    uniform = data["strategies"][1]
    assert [len(s) for s in [uniform["stages"]]] == [4]

    # autopipe's bottleneck is never worse than a baseline's at the same M.
    def bott(entry: dict) -> float:
        return max(
            s["forward_s"] + s["backward_s"] + s["recompute_s"] + s["send_s"]
            for s in entry["stages"]
        )

    assert all(bott(data["strategies"][0]) <= bott(e) + 1e-12 for e in data["strategies"][1:])
    fig = balance_figure(data)
    assert len(fig.axes) == 6
    # The red device-limit line is on every memory panel.
    assert fig.axes[3].get_ylabel() == "memory (GiB)"
    limit = gpipe_plan.memory_per_device / 2**30
    for ax in fig.axes[3:]:
        assert any(abs(ln.get_ydata()[0] - limit) < 1e-9 for ln in ax.get_lines())
    _check_png(plot_balance(data, tmp_path / "balance")[0])


def test_scaling_plot(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.scaling import plot_scaling

    data = scaling_data(gpipe_plan, profile, max_gpus=6)
    ks = [p["num_stages"] for p in data["points"]]
    assert ks == [1, 2, 3, 4, 5, 6]
    one = plan(
        profile, PlanRequest(gpus=1, batch_size=32, memory_per_device=2**30, baselines=False)
    )
    assert data["points"][0]["throughput"] == pytest.approx(one.throughput)
    _check_png(plot_scaling(data, tmp_path / "scaling")[0])


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


# -- what the figures say: units, labels, limits ---------------------------------------------


def _gpt_like_plan(microbatches: int = 16) -> Plan:
    """examples/gpt.py's shape on 8 stages: a light embedding, 24 equal blocks, a head."""
    names = ["tok_emb", *(f"blocks.{i}" for i in range(24)), "head"]
    units = [
        UnitProfile(
            name=n,
            forward_s=(0.3 if n == "tok_emb" else 1.0) * 1e-3,
            backward_s=(0.3 if n == "tok_emb" else 1.0) * 2e-3,
            parameter_bytes=2_000_000,
            activation_bytes=3_000_000,
        )
        for n in names
    ]
    profile = Profile(units=units, cut_bytes=[100_000] * (len(units) - 1), batch_size=32)
    return plan(profile, PlanRequest(gpus=8, microbatches=microbatches, baselines=False))


def test_every_microbatch_is_labelled_on_the_timeline() -> None:
    """Before, the labels of an 8-stage plan at M=16 stopped at micro-batch 9: two digits
    were taken to need 18 px, and the boxes had 16."""
    p = _gpt_like_plan(16)
    timeline = predicted_timeline(p)
    ax = timeline_figure(timeline).axes[0]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "label"]
    assert len(labels) == len(timeline.tasks) == 2 * 8 * 16
    assert sorted(set(labels), key=int) == [str(m) for m in range(16)]
    assert {t.get_fontsize() for t in ax.texts} == {7.0}


def test_narrow_boxes_get_a_wider_figure_and_smaller_labels() -> None:
    """At M=32 the first stage's forwards are too narrow for two digits at 7 pt even 16 in
    wide: the figure takes the widest, and every box that holds two digits at 5 pt is
    labelled, in one size per row and phase where one fits them all."""
    from autopipe.viz.gantt import LABEL_SIZES_PT, WIDTH_IN, label_width_px

    timeline = predicted_timeline(_gpt_like_plan(32))
    fig = timeline_figure(timeline)
    ax = fig.axes[0]
    assert fig.get_figwidth() == WIDTH_IN[1]
    px_per_s = 0.85 * WIDTH_IN[1] * fig.dpi / timeline.iteration_s
    wide = [t for t in timeline.tasks if t.duration_s * px_per_s >= label_width_px("00", 5, 100)]
    labels = [t for t in ax.texts if t.get_gid() == "label"]
    assert len(labels) >= len(wide) > len(timeline.tasks) // 2
    assert {t.get_fontsize() for t in labels} <= set(LABEL_SIZES_PT)


def test_labels_shrink_before_they_go() -> None:
    from autopipe.viz.gantt import LABEL_SIZES_PT, box_label_size, label_size, label_width_px

    assert label_size([(20.0, "15")], 100.0) == LABEL_SIZES_PT[0]
    narrow = label_width_px("15", LABEL_SIZES_PT[-1], 100.0)
    # One size for the chart while one fits every box; else each box its own.
    assert label_size([(20.0, "15"), (narrow, "15")], 100.0) == LABEL_SIZES_PT[-1]
    assert label_size([(20.0, "15"), (narrow - 1, "15")], 100.0) is None
    assert box_label_size(20.0, "15", 100.0) == LABEL_SIZES_PT[0]
    assert box_label_size(narrow - 1, "15", 100.0) is None  # unlabelled


def test_memory_axes_read_in_the_titles_unit() -> None:
    """Before, the memory of a plan of a few MiB per rank was drawn on a "GiB" axis with
    ticks at 0.025 under titles in MiB."""
    from autopipe.viz.memory import plan_memory_figure

    p = _gpt_like_plan(16)
    fig = plan_memory_figure(p)
    for ax in fig.axes:
        unit = ax.get_title(loc="left").split()[-1]  # "rank 0: peak 44.3 MiB"
        assert unit == "MiB" and ax.get_ylabel() == "MiB"
        peak = float(ax.get_title(loc="left").split()[-2])
        low, high = ax.get_ylim()
        assert low == 0 and 1.05 * peak <= high <= 1.1 * peak  # the peak clears the frame
        (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "memory"]
        assert max(line.get_ydata()) == pytest.approx(peak, rel=1e-3)


def test_byte_units_follow_the_data() -> None:
    from autopipe.viz.style import byte_unit

    assert byte_unit(44.3 * 2**20) == ("MiB", 2**20)
    assert byte_unit(80e9) == ("GiB", 2**30)
    assert byte_unit(512) == ("B", 1) and byte_unit(3 * 2**10) == ("KiB", 2**10)


def test_schedules_memory_legend_sits_below_the_panels() -> None:
    """Before, the rank legend sat inside the first panel, over its lines (zbv's, there)."""
    from autopipe.planner import plan_each_schedule

    from autopipe.viz.memory import schedules_figure

    plans = plan_each_schedule(_profile(), PlanRequest(gpus=4, microbatches=8))
    _, mem = schedules_figure(plans)
    assert all(ax.get_legend() is None for ax in mem.axes)
    (legend,) = mem.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"rank {r}" for r in range(4)]
    for ax in mem.axes:
        unit = ax.get_title(loc="left").split()[-1]  # "... peak 67.5 MiB"
        assert ax.get_ylabel() == unit == "MiB"
        drawn = max(max(ln.get_ydata()) for ln in ax.get_lines() if ln.get_gid() == "memory")
        assert ax.get_ylim()[1] >= 1.05 * drawn


def test_the_tallest_bars_clear_the_frame(gpipe_plan: Plan, profile: Profile) -> None:
    """Before, the first column fixed each row's shared y axis: a taller bar in a later
    column (uniform's first stage on examples/gpt.py) was cut off by the frame."""
    import copy

    data = copy.deepcopy(balance_data(gpipe_plan, profile))
    data["memory_limit_bytes"] = None  # no limit line above the bars
    for stage in data["strategies"][1]["stages"]:  # uniform: twice as tall as the rest
        for key in ("forward_s", "backward_s", "parameter_bytes", "activation_bytes"):
            stage[key] *= 2
    fig = balance_figure(data)
    for row in (fig.axes[:3], fig.axes[3:]):
        tallest = max(b.get_y() + b.get_height() for ax in row for b in ax.patches)
        lines = [ln.get_ydata()[0] for ax in row for ln in ax.get_lines()]
        assert row[0].get_ylim()[1] >= 1.05 * max([tallest, *lines])


def test_bench_titles_compare_like_with_like(gpipe_plan: Plan) -> None:
    """Before, the measured panel gave the drawn step's wall time (4.95 s) beside a 2.2 s
    prediction that the text, on thread-CPU time, found 0.4% off."""
    from dataclasses import replace

    from autopipe.bench_report import BenchResult
    from autopipe.core.humanize import format_seconds

    predicted = predicted_timeline(gpipe_plan, devices=["cpu"] * gpipe_plan.num_stages)
    wall = Timeline(
        [
            Task(t.stage, t.microbatch, t.phase, 2.25 * t.start_s, 2.25 * t.end_s, t.device)
            for t in predicted.tasks
        ],
        predicted.num_stages,
        label="measured (wall clock)",
        schedule=predicted.schedule,
        device_names=predicted.device_names,
    )
    result = BenchResult(
        plan=gpipe_plan,
        devices=["cpu"] * gpipe_plan.num_stages,
        steps=10,
        clock="thread_cpu",
        predicted=predicted,
        measured=wall,
        stages=[],
        iteration_predicted_s=predicted.iteration_s,
        iteration_measured_s=predicted.iteration_s / 0.996,
        iteration_wall_s=wall.iteration_s,
        step_measured_s=wall.iteration_s,
        loss_forward_s=0.0,
        loss_backward_s=0.0,
    )
    top, bottom = result.compare_titles()
    assert top == timeline_figure(predicted).axes[0].get_title()
    cpu = format_seconds(result.iteration_measured_s)
    assert f"iteration {cpu} CPU time (median of 10 steps; predicted -0.4%)" in bottom
    assert bottom.endswith(f"drawn on the wall clock: {format_seconds(wall.iteration_s)}")
    fig = timeline_figure(predicted, compare=wall, titles=(top, bottom))
    assert [ax.get_title() for ax in fig.axes[:2]] == [top, bottom]
    on_wall = replace(result, clock="wall", iteration_measured_s=wall.iteration_s)
    assert "wall clock (median of 10 steps; predicted -55.6%)" in on_wall.compare_titles()[1]
