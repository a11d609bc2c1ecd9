"""autopipe.viz: pictures of a pipeline plan (matplotlib, Agg backend, PNG and SVG).

``plot_all(plan, out_dir, profile=profile)`` writes the figures ``autopipe plan --plot``
promises: ``timeline`` (Gantt of the simulated iteration; one row per rank with its virtual
stages labelled when a rank runs several chunks, split backwards drawn as B and W), ``memory``
(each rank's replayed memory over the iteration), ``bubble`` (idle fraction and
throughput vs micro-batches), ``balance`` (per-stage time and memory beside the ``uniform`` and
``parameters`` baselines) and ``scaling`` (throughput and memory vs number of devices).

The data behind bubble/balance/scaling needs the profile (it re-plans the problem with one
knob changed): ``collect_plot_data(plan, profile)``. Plotting never changes the plan it draws;
a caller that wants a saved plan redrawn by ``autopipe plot PLAN.json`` without the profile
stores that data in ``plan.plot_data`` itself (``autopipe plan --plot`` does).

Timelines are the planner's one ``Timeline`` (``autopipe.core.timeline``): the simulator's,
the runtime's ``pipeline.last_timeline``, or a Chrome trace read by ``load_chrome_trace``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from autopipe.core.lazy import lazy_attributes
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.timeline import (
    Task,
    Timeline,
    TimelineFormatError,
    load_chrome_trace,
    to_chrome_trace,
)

__all__ = [
    "MAX_TIMELINE_TASKS",
    "PLOT_NAMES",
    "Task",
    "Timeline",
    "TimelineFormatError",
    "collect_plot_data",
    "load_chrome_trace",
    "plot_all",
    "plot_balance",
    "plot_bubble",
    "plot_memory",
    "plot_scaling",
    "plot_schedules",
    "plot_timeline",
    "predicted_timeline",
    "load_chrome_trace",
    "to_chrome_trace",
    "too_many_tasks",
]

log = logging.getLogger("autopipe")

PLOT_NAMES = ("timeline", "memory", "bubble", "balance", "scaling")

MAX_TIMELINE_TASKS = 20_000
"""Most forward and backward tasks (2 x K x M) a timeline is drawn (or benchmarked) with:
each is a box, about 1 ms of matplotlib time apiece, so M = 10^6 would take hours."""


def too_many_tasks(plan: Plan) -> str | None:
    """Why ``plan`` has too many tasks to draw or benchmark (one line), or None."""
    tasks = 2 * plan.num_stages * plan.microbatches
    if tasks <= MAX_TIMELINE_TASKS:
        return None
    fewer = max(MAX_TIMELINE_TASKS // (2 * plan.num_stages), 1)
    return (
        f"the plan's {plan.num_stages} stages x {plan.microbatches} micro-batches make "
        f"{tasks:,} tasks, more than the {MAX_TIMELINE_TASKS:,} a timeline can show; re-plan "
        f"with --microbatches {fewer} or fewer"
    )


# Plot functions import matplotlib; load them only when asked for.
_LAZY = {
    "plot_timeline": "autopipe.viz.gantt",
    "plot_bubble": "autopipe.viz.bubble",
    "plot_balance": "autopipe.viz.balance",
    "plot_scaling": "autopipe.viz.scaling",
    "plot_memory": "autopipe.viz.memory",
    "plot_schedules": "autopipe.viz.memory",
    "predicted_timeline": "autopipe.viz.predict",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


def collect_plot_data(
    plan: Plan,
    profile: Profile,
    *,
    max_gpus: int | None = None,
    bubble_ks: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The bubble, balance and scaling data for ``plan`` (JSON-able; re-plans via the planner).

    Cost: about |divisors(B)| x |K values| + K + 2 planner calls.
    """
    from autopipe.viz.data import balance_data, bubble_data, scaling_data

    return {
        "bubble": bubble_data(plan, profile, ks=bubble_ks),
        "balance": balance_data(plan, profile),
        "scaling": scaling_data(plan, profile, max_gpus=max_gpus),
    }


def plot_all(
    plan: Plan,
    out_dir: str | Path,
    profile: Profile | None = None,
    *,
    timeline: Timeline | None = None,
    plot_data: dict[str, Any] | None = None,
    formats: Sequence[str] = ("png",),
    compare: bool = True,
    max_gpus: int | None = None,
    progress: bool = False,
) -> list[Path]:
    """Write the plan's figures into ``out_dir``; returns the files written.

    ``timeline.<fmt>``: the simulated (predicted) iteration. With ``timeline`` (a measured
    ``Timeline``: the executor's ``pipeline.last_timeline``, or a Chrome trace read with
    ``load_chrome_trace``) also ``timeline_measured.<fmt>`` and, with ``compare``,
    ``timeline_compare.<fmt>`` (predicted over measured on one time axis; stages that shared
    a device in the measured run are simulated as sharing it). ``bubble``, ``balance`` and
    ``scaling`` are drawn from ``plot_data`` (:func:`collect_plot_data`'s dict), else from
    ``profile``, else from data stored in ``plan.plot_data``; without any they are skipped
    with a warning. ``plan`` and ``timeline`` are not modified. ``max_gpus`` bounds the
    scaling plot (default: the plan's K). ``progress``: a tqdm bar on stderr, one step per
    figure and one for the re-planning behind bubble/balance/scaling (seconds on a real model).
    Raises ValueError, before any work, for more than ``MAX_TIMELINE_TASKS`` tasks.
    """
    too_many = too_many_tasks(plan)
    if too_many is not None:
        raise ValueError(too_many)
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(
            f"timeline must be a Timeline, not {type(timeline).__name__}; read a Chrome trace "
            "with autopipe.viz.load_chrome_trace(path)"
        )
    from tqdm import tqdm

    from autopipe.viz.balance import balance_figure
    from autopipe.viz.bubble import bubble_figure
    from autopipe.viz.gantt import plot_timeline
    from autopipe.viz.memory import plan_memory_figure
    from autopipe.viz.predict import predicted_timeline
    from autopipe.viz.scaling import scaling_figure
    from autopipe.viz.style import save

    stored = plan.plot_data
    have_data = bool(plot_data) or profile is not None or bool(stored)
    steps = (5 if have_data else 3) + (0 if timeline is None else 1 + int(compare))
    bar = tqdm(total=steps, desc="plots", unit="step", disable=not progress, leave=False)
    if plot_data:
        data = plot_data
    elif profile is not None:
        data = collect_plot_data(plan, profile, max_gpus=max_gpus)
    else:
        data = stored
    bar.update()
    # The figures drawn from that data (possibly hand-edited in a plan file) are drawn before
    # anything is written: bad data fails with no partial set of files.
    if data:
        figures = [
            ("bubble", bubble_figure(data["bubble"])),
            ("balance", balance_figure(data["balance"])),
            ("scaling", scaling_figure(data["scaling"])),
        ]
    else:
        from autopipe.viz.data import balance_data

        log.warning(
            "no profile and no plot data stored in the plan: drawing the timeline and this "
            "plan's balance only; for the bubble and scaling plots pass the profile "
            "(`autopipe plot --profile PROFILE.json`) or plot a plan saved by "
            "`autopipe plan --plot DIR --json PLAN.json`"
        )
        figures = [("balance", balance_figure(balance_data(plan, None)))]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    predicted = predicted_timeline(plan)
    paths += plot_timeline(predicted, out / "timeline", formats=formats)
    paths += save(plan_memory_figure(plan), out / "memory", formats)
    bar.update()
    if timeline is not None:
        measured = timeline
        if timeline.num_stages < plan.num_stages or not timeline.label:
            # A row per planned stage and a title, on a copy: the caller's stays as it is.
            measured = replace(
                timeline,
                num_stages=max(timeline.num_stages, plan.num_stages),
                label=timeline.label or "measured",
            )
        paths += plot_timeline(measured, out / "timeline_measured", formats=formats)
        bar.update()
        if compare:
            # Predict the placement that ran: stages that shared a device are simulated so.
            same_place = predicted
            if measured.shared:
                placement = [
                    f"stage {s} alone" if d is None else measured.device_name(d)
                    for s, d in enumerate(measured.stage_devices())
                ]
                same_place = predicted_timeline(plan, devices=placement)
            paths += plot_timeline(
                same_place, out / "timeline_compare", compare=measured, formats=formats
            )
            bar.update()
    for stem, figure in figures:
        paths += save(figure, out / stem, formats)
        bar.update()
    bar.close()
    return paths
