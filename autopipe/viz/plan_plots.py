"""Every figure of a plan into one folder (:func:`plot_all`): what ``autopipe plan --plot``
and ``autopipe plot`` write.

The steps, in order: check the plan can be drawn, find the data behind bubble, balance and
scaling, draw those figures (before anything is written: bad data fails with no partial set
of files), then write the predicted timeline and memory, the measured timeline and its
comparison, and the figures drawn first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.timeline import Timeline
from autopipe.viz import collect_plot_data, gantt, too_many_tasks
from autopipe.viz.balance import balance_figure
from autopipe.viz.bubble import bubble_figure
from autopipe.viz.data import balance_data
from autopipe.viz.memory import plan_memory_figure
from autopipe.viz.predict import predicted_timeline
from autopipe.viz.scaling import scaling_figure
from autopipe.viz.style import save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_all"]

log = logging.getLogger("autopipe")


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
    _check_drawable(plan, timeline)
    have_data = bool(plot_data) or profile is not None or bool(plan.plot_data)
    steps = (5 if have_data else 3) + (0 if timeline is None else 1 + int(compare))
    bar = tqdm(total=steps, desc="plots", unit="step", disable=not progress, leave=False)
    data = _plot_data(plan, profile, plot_data, max_gpus)
    bar.update()
    figures = _data_figures(plan, data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    predicted = predicted_timeline(plan)
    paths = gantt.plot_timeline(predicted, out / "timeline", formats=formats)
    paths += save(plan_memory_figure(plan), out / "memory", formats)
    bar.update()
    if timeline is not None:
        paths += _plot_measured(plan, predicted, timeline, out, formats, compare, bar)
    for stem, figure in figures:
        paths += save(figure, out / stem, formats)
        bar.update()
    bar.close()
    return paths


def _check_drawable(plan: Plan, timeline: Timeline | None) -> None:
    """Refuse, before any work, a plan with too many tasks to draw (ValueError) or a
    measured timeline that is no ``Timeline`` (TypeError)."""
    too_many = too_many_tasks(plan)
    if too_many is not None:
        raise ValueError(too_many)
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(
            f"timeline must be a Timeline, not {type(timeline).__name__}; read a Chrome trace "
            "with autopipe.viz.load_chrome_trace(path)"
        )


def _plot_data(
    plan: Plan,
    profile: Profile | None,
    plot_data: dict[str, Any] | None,
    max_gpus: int | None,
) -> dict[str, Any] | None:
    """The bubble, balance and scaling data: ``plot_data``, else collected from ``profile``
    (re-planning), else what the plan stores (None or empty: none)."""
    if plot_data:
        return plot_data
    if profile is not None:
        return collect_plot_data(plan, profile, max_gpus=max_gpus)
    return plan.plot_data


def _data_figures(plan: Plan, data: dict[str, Any] | None) -> list[tuple[str, Figure]]:
    """``(file stem, figure)`` for bubble, balance and scaling from ``data`` (possibly
    hand-edited in a plan file); without data, the plan's own balance only, with a warning."""
    if data:
        return [
            ("bubble", bubble_figure(data["bubble"])),
            ("balance", balance_figure(data["balance"])),
            ("scaling", scaling_figure(data["scaling"])),
        ]
    log.warning(
        "no profile and no plot data stored in the plan: drawing the timeline and this "
        "plan's balance only; for the bubble and scaling plots pass the profile "
        "(`autopipe plot --profile PROFILE.json`) or plot a plan saved by "
        "`autopipe plan --plot DIR --json PLAN.json`"
    )
    return [("balance", balance_figure(balance_data(plan, None)))]


def _plot_measured(
    plan: Plan,
    predicted: Timeline,
    timeline: Timeline,
    out: Path,
    formats: Sequence[str],
    compare: bool,
    bar: tqdm[Any],
) -> list[Path]:
    """``timeline_measured`` and, with ``compare``, ``timeline_compare``: ``predicted``
    re-simulated on the placement that ran, over the measured run."""
    measured = timeline
    if timeline.num_stages < plan.num_stages or not timeline.label:
        # A row per planned stage and a title, on a copy: the caller's stays as it is.
        measured = replace(
            timeline,
            num_stages=max(timeline.num_stages, plan.num_stages),
            label=timeline.label or "measured",
        )
    paths = gantt.plot_timeline(measured, out / "timeline_measured", formats=formats)
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
        paths += gantt.plot_timeline(
            same_place, out / "timeline_compare", compare=measured, formats=formats
        )
        bar.update()
    return paths
