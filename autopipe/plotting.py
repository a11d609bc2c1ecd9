"""Draw a saved plan's figures as ``autopipe plot`` does, for the CLI and the Python API alike.

:func:`plot_plan` checks that what it is given belongs together (a measured run of this plan,
the profile the plan was made from), then writes the figures of
:func:`autopipe.viz.plot_all` and, with ``schedules``, the plan's request planned once per
schedule and drawn side by side (``schedules.<fmt>``, ``schedules_memory.<fmt>``). What
does not belong together is a ``UsageError``, raised before any folder is made.

Typical use::

    paths = plot_plan(PlotRequest(load_plan("plan.json"), Path("out"), schedules=True))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from autopipe.core.errors import Failure, UsageError
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.core.timeline import Timeline
from autopipe.outputs import check_output
from autopipe.planner.sweep import plan_each_schedule
from autopipe.viz import too_many_tasks
from autopipe.viz.memory import plot_schedules
from autopipe.viz.plan_plots import plot_all

__all__ = ["PlotRequest", "PlotSources", "plot_plan", "plot_schedules_of"]


@dataclass(frozen=True)
class PlotSources:
    """Where a request's plan, profile and measured run were read from, as errors name them
    (``autopipe plot`` gives the files; a profile's or timeline's is named only when the
    request has one)."""

    plan: str = "the plan"
    profile: str = "the profile"
    timeline: str = "the timeline"


@dataclass(frozen=True)
class PlotRequest:
    """What to draw and where (the arguments of ``autopipe plot``)."""

    plan: Plan
    out_dir: Path
    """The folder for the images (created when missing)."""
    profile: Profile | None = None
    """The plan's profile, to (re)compute the bubble, balance and scaling data; None: the
    one the plan carries (``autopipe plan --json`` keeps it), if any."""
    timeline: Timeline | None = None
    """A measured run of the plan, drawn as ``timeline_measured``."""
    compare: bool = False
    """Also draw the prediction over ``timeline`` on one time axis (``timeline_compare``)."""
    schedules: bool = False
    """Also plan the profile with every schedule and draw them side by side (needs a profile)."""
    max_gpus: int | None = None
    """The scaling plot's largest device count (None: the plan's stages)."""
    formats: tuple[str, ...] = ("png",)
    """Image formats: ``png``, ``svg``."""
    progress: bool = False
    """Show a progress bar over the figures."""
    sources: PlotSources = field(default_factory=PlotSources)


def plot_plan(request: PlotRequest) -> list[Path]:
    """Write ``request``'s figures into ``request.out_dir``; returns the files written.
    Raises ``UsageError`` (before any folder is made) for a plan with too many tasks to draw,
    a timeline of another pipeline, a profile of another model, ``schedules`` without a
    profile, or an ``out_dir`` that cannot be written; ``Failure`` when no schedule has a plan."""
    profile = _checked_profile(request)
    check_output(request.out_dir, "out_dir", directory=True)
    paths = plot_all(
        request.plan,
        request.out_dir,
        profile=profile,
        timeline=request.timeline,
        formats=request.formats,
        compare=request.compare,
        max_gpus=request.max_gpus,
        progress=request.progress,
    )
    if request.schedules:
        assert profile is not None  # _checked_profile refused schedules without one
        paths += plot_schedules_of(request.plan, profile, request.out_dir, request.formats)
    return paths


def _checked_profile(request: PlotRequest) -> Profile | None:
    """Refuse what does not belong together; the profile to draw with (the request's, else
    the plan's own)."""
    plan, sources = request.plan, request.sources
    reason = too_many_tasks(plan)
    if reason is not None:
        raise UsageError(reason)
    timeline = request.timeline
    if timeline is not None and timeline.num_stages != plan.num_stages:
        raise UsageError(
            f"{sources.timeline} has {timeline.num_stages} stages but the plan has "
            f"{plan.num_stages}; pass the trace of a run of this plan"
        )
    profile = request.profile
    if profile is not None:
        planned = [u for s in plan.stages for u in s.units]
        if planned != profile.unit_names:
            raise UsageError(
                f"{sources.profile} does not match {sources.plan}: the plan's units are not "
                "the profile's; pass the profile the plan was made from"
            )
    else:
        profile = plan.profile
    if request.schedules and profile is None:
        raise UsageError(
            "--schedules re-plans the plan's profile: pass --profile PROFILE.json (plans "
            "written by `autopipe plan --json` carry it)"
        )
    return profile


def plot_schedules_of(
    plan: Plan, profile: Profile, out_dir: Path, formats: tuple[str, ...] = ("png",)
) -> list[Path]:
    """``plan``'s request planned once per schedule on ``profile``, drawn side by side into
    ``out_dir`` (``schedules.<fmt>``, ``schedules_memory.<fmt>``). Raises ``Failure`` when
    no schedule has a plan."""
    request = plan.request or PlanRequest(
        gpus=plan.num_stages,
        batch_size=plan.batch_size,
        memory_per_device=plan.memory_per_device,
    )
    # Each schedule picks its own V (and M, when the request let the planner choose it).
    request = dataclasses.replace(request, virtual_stages="auto")
    plans = plan_each_schedule(profile, request)
    if not any(not isinstance(p, str) for p in plans.values()):
        raise Failure("no schedule has a plan: " + "; ".join(map(str, plans.values())))
    return plot_schedules(plans, out_dir, formats=formats)
