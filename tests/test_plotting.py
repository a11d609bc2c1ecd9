"""``autopipe.plotting.plot_plan``: what ``autopipe plot`` draws, from Python."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from autopipe.planner import plan

from autopipe.cli import main
from autopipe.core.errors import Failure, UsageError
from autopipe.core.plan import Plan, replace_plan
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest
from autopipe.core.timeline import Task, Timeline, to_chrome_trace
from autopipe.plotting import PlotRequest, PlotSources, plot_plan, plot_schedules_of


def _profile(names: list[str]) -> Profile:
    units = [
        UnitProfile(
            name=n,
            forward_s=1e-3 * (1 + i % 2),
            backward_s=2e-3 * (1 + i % 2),
            parameter_bytes=1_000_000,
            activation_bytes=2_000_000,
            output_bytes=100_000,
        )
        for i, n in enumerate(names)
    ]
    return Profile(units=units, cut_bytes=[100_000] * (len(units) - 1), batch_size=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Path, Profile, Path]:
    """A 2-stage plan (M = 4) of a 4-unit profile, saved without its profile."""
    folder = tmp_path_factory.mktemp("plotting")
    profile = _profile(["a", "b", "c", "d"])
    p = plan(profile, PlanRequest(gpus=2, batch_size=8, microbatches=4, baselines=False))
    p.profile = None
    p.save(folder / "plan.json")
    profile.save(folder / "profile.json")
    return p, folder / "plan.json", profile, folder / "profile.json"


def _measured(num_stages: int) -> Timeline:
    """A run of ``num_stages`` stages on one CPU: each stage's forward then its backward."""
    tasks = [Task(s, 0, "forward", 0.01 * s, 0.01 * (s + 1), 0) for s in range(num_stages)]
    tasks += [
        Task(s, 0, "backward", 0.1 + 0.02 * (num_stages - 1 - s), 0.1 + 0.02 * (num_stages - s), 0)
        for s in range(num_stages)
    ]
    return Timeline(tasks, num_stages, label="measured", device_names=["cpu"])


def test_plot_plan_writes_the_files_the_cli_writes(
    saved: tuple[Plan, Path, Profile, Path], tmp_path: Path
) -> None:
    p, plan_path, _, _ = saved
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(to_chrome_trace(_measured(2))))
    argv = ["plot", str(plan_path), "--timeline", str(trace), "--compare", "-q"]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 0
    from autopipe.core.timeline import load_chrome_trace

    measured = load_chrome_trace(trace, num_stages=2, label="measured")
    request = PlotRequest(p, tmp_path / "api", timeline=measured, compare=True)
    paths = plot_plan(request)
    names = ["timeline.png", "memory.png", "timeline_measured.png", "timeline_compare.png"]
    assert [x.name for x in paths] == [*names, "balance.png"]
    assert sorted(x.name for x in (tmp_path / "cli").iterdir()) == sorted(x.name for x in paths)
    for path in paths:  # the same figures, to the byte (Agg draws deterministically)
        assert path.read_bytes() == (tmp_path / "cli" / path.name).read_bytes(), path.name


def test_plot_plan_fails_when_no_schedule_has_a_plan(
    saved: tuple[Plan, Path, Profile, Path], tmp_path: Path
) -> None:
    p, _, profile, _ = saved
    tight = Plan.from_dict(p.to_dict())
    assert tight.request is not None
    tight.request = dataclasses.replace(tight.request, memory_per_device=1000)
    with pytest.raises(Failure, match="no schedule has a plan: .*memory"):
        plot_schedules_of(tight, profile, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_plot_plan_refuses_what_does_not_belong_together(
    saved: tuple[Plan, Path, Profile, Path], tmp_path: Path
) -> None:
    p, plan_path, _, _ = saved
    out = tmp_path / "never"
    other = _profile(["a", "b", "x", "d"])
    sources = PlotSources(plan=str(plan_path), profile="other.json", timeline="run.json")
    cases = [
        (PlotRequest(p, out, profile=other, sources=sources), "other.json does not match"),
        (PlotRequest(p, out, profile=other), "the profile does not match the plan"),
        (PlotRequest(p, out, timeline=_measured(3), sources=sources), "run.json has 3 stages"),
        (PlotRequest(p, out, schedules=True), "--schedules re-plans the plan's profile"),
    ]
    for request, message in cases:
        with pytest.raises(UsageError, match=message):
            plot_plan(request)
    # 10^4 micro-batches: more tasks than a timeline can show; replace_plan derives the
    # new M's actions (a file edited so, keeping the old ones, is refused on load).
    many = replace_plan(p, microbatches=10**4, microbatch_size=1, batch_size=10**4)
    with pytest.raises(UsageError, match="a timeline can show"):
        plot_plan(PlotRequest(many, out))
    assert not out.exists()  # refused before any folder is made
    with pytest.raises(UsageError, match=f"^out_dir {plan_path}/figures: {plan_path} is a file"):
        plot_plan(PlotRequest(p, plan_path / "figures"))
