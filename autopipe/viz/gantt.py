"""Timeline (Gantt) plot: one row per stage, a box per task, idle time shaded as bubble.

Every task box is a ``Rectangle`` with ``gid`` ``"task:<phase>"`` and every idle span a
``Rectangle`` with ``gid`` ``"bubble"``, so tests (and users) can recover exactly what was
drawn from ``ax.patches``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autopipe.core.humanize import format_seconds
from autopipe.core.timeline import PHASES, Task, Timeline
from autopipe.viz.style import BUBBLE_COLOR, PHASE_COLORS, new_figure, save

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ROW_HEIGHT = 0.8
"""Height of a stage's row in y units (rows are 1 apart)."""
VIRTUAL_HATCHES = ("", "..", "xx", "oo")
"""Rows per rank: the hatch of a rank's first, second, ... virtual stage's boxes (white)."""
LABEL_SIZES_PT = (7.0, 6.0, 5.0)
"""Font sizes tried for the boxes' labels, largest first: the largest at which every label
of a row's phase fits its box is used for them all (:func:`draw_timeline`)."""
DIGIT_EM = 0.64
"""Width of a digit in ems (DejaVu Sans, matplotlib's default: 0.636)."""
WIDTH_IN = (11.0, 16.0)
"""A timeline figure's narrowest and widest width in inches: wider than the narrowest when
its shortest box needs it to hold a two-digit label."""


def idle_spans(timeline: Timeline, stages: list[int]) -> list[tuple[float, float]]:
    """Idle ``(start_s, end_s)`` gaps of the device running ``stages`` within the iteration.

    A gap is time when none of ``stages`` runs a task. O(n log n).
    """
    group = set(stages)
    spans = sorted((t.start_s, t.end_s) for t in timeline.tasks if t.stage in group)
    gaps, cursor = [], timeline.start_s
    for start, end in spans:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if timeline.end_s > cursor:
        gaps.append((cursor, timeline.end_s))
    return gaps


def timeline_detail(timeline: Timeline) -> str:
    """``"gpipe, K=4, M=8"``: the schedule, the placement and M, as titles show them."""
    groups = timeline.device_groups()
    if rows_by_device(timeline):
        v = timeline.num_stages // max(len(groups), 1)
        placement = f"K={len(groups)} ranks x V={v} virtual stages"
    elif timeline.shared:
        many = "s" if len(groups) > 1 else ""
        placement = f"K={timeline.num_stages} on {len(groups)} shared device{many}"
    else:
        placement = f"K={timeline.num_stages}"
    return ", ".join(
        x for x in (timeline.schedule, placement, f"M={timeline.num_microbatches}") if x
    )


def timeline_title(timeline: Timeline) -> str:
    """``"predicted (gpipe, K=4, M=8): iteration 12.3 ms, bubble 27.3%"``."""
    what = timeline.label or "timeline"
    idle = "device idle" if timeline.shared else "bubble"
    return (
        f"{what} ({timeline_detail(timeline)}): iteration "
        f"{format_seconds(timeline.iteration_s)}, {idle} {100 * timeline.bubble_fraction:.1f}%"
    )


def timeline_rows(timeline: Timeline) -> int:
    """Rows the chart of ``timeline`` has (devices or stages, see :func:`rows_by_device`)."""
    return len(timeline.device_groups()) if rows_by_device(timeline) else timeline.num_stages


def rows_by_device(timeline: Timeline) -> bool:
    """Whether the chart has one row per device (rank) rather than one per stage: a
    schedule that places several model chunks (virtual stages) on each rank. O(n)."""
    return timeline.shared and timeline.schedule not in ("", "gpipe", "1f1b")


@dataclass(frozen=True)
class _RowLayout:
    """Which row of the chart each stage's boxes go in: one row per stage, or one per
    device (rank) holding its virtual stages (:func:`rows_by_device`)."""

    by_device: bool
    groups: list[list[int]]
    """The timeline's device groups: the stages that run on each device."""
    row_of: dict[int, int]
    """Stage -> row (0 on top)."""
    chunk_of: dict[int, int]
    """Stage -> its place among its rank's chunks (0 on a row per stage): picks the hatch."""

    @property
    def rows(self) -> int:
        """How many rows the chart has."""
        return len(self.groups) if self.by_device else len(self.row_of)

    def names(self) -> list[str]:
        """The rows' tick labels: ``rank r (c0, c2)`` or ``stage s``."""
        if self.by_device:
            return [
                f"rank {r} (c{', c'.join(map(str, sorted(g)))})" for r, g in enumerate(self.groups)
            ]
        return [f"stage {s}" for s in range(self.rows)]


def _row_layout(timeline: Timeline, by_device: bool) -> _RowLayout:
    """The rows of ``timeline``'s chart: per device (rank) when ``by_device``, else per stage."""
    groups = timeline.device_groups()
    if by_device:
        row_of = {s: r for r, g in enumerate(groups) for s in g}
        chunk_of = {s: j for g in groups for j, s in enumerate(sorted(g))}
    else:
        row_of = {s: s for s in range(timeline.num_stages)}
        chunk_of = dict.fromkeys(range(timeline.num_stages), 0)
    return _RowLayout(by_device, groups, row_of, chunk_of)


def draw_timeline(
    ax: Axes,
    timeline: Timeline,
    *,
    width_px: float | None = None,
    by_device: bool | None = None,
) -> None:
    """Draw ``timeline`` on ``ax``: stage 0 (or rank 0) on top, time in ms on x.

    ``width_px`` is the axes' width in pixels, used to decide whether a micro-batch number
    fits inside its box (estimated from the figure size if not given); the labels (``gid``
    ``"label"``) of one row and phase take the largest of :data:`LABEL_SIZES_PT` at which
    all of them fit, else each the largest at which it fits its box. ``by_device``: one row
    per device, each box labelled ``c<chunk>:<micro-batch>`` and hatched for each later
    virtual stage of its rank (:data:`VIRTUAL_HATCHES`) (default :func:`rows_by_device`); else one row per stage.
    Split backwards are drawn apart: ``backward_input`` and ``backward_weight`` have their own
    colours. O(n) in tasks.
    """
    if width_px is None:
        fig = ax.get_figure(root=True)
        assert fig is not None
        width_px = 0.85 * fig.get_figwidth() * fig.dpi
    layout = _row_layout(timeline, rows_by_device(timeline) if by_device is None else by_device)
    px_per_s = width_px / max(timeline.iteration_s, 1e-12)
    _draw_tasks(ax, timeline, layout, px_per_s)
    _shade_idle(ax, timeline, layout)
    _frame(ax, timeline, layout)


def _draw_tasks(ax: Axes, timeline: Timeline, layout: _RowLayout, px_per_s: float) -> None:
    """A box per task (``gid`` ``"task:<phase>"``), labelled where the label fits
    (``px_per_s``: pixels per second of the time axis)."""
    from matplotlib.patches import Rectangle

    t0 = timeline.start_s
    # Thin white edges separate back-to-back boxes; thinner when there are many.
    edge_w = 0.5 if len(timeline.tasks) <= 400 else 0.3
    tasks = sorted(timeline.tasks, key=lambda t: (t.stage, t.start_s))
    labels = [task_label(task, layout.by_device) for task in tasks]
    dpi = float(ax.get_figure(root=True).dpi)  # type: ignore[union-attr]
    sizes = _row_label_sizes(tasks, labels, layout, px_per_s, dpi)
    for task, label in zip(tasks, labels, strict=True):
        x = (task.start_s - t0) * 1e3
        w = task.duration_s * 1e3
        row = layout.row_of[task.stage]
        ax.add_patch(
            Rectangle(
                (x, row - ROW_HEIGHT / 2),
                w,
                ROW_HEIGHT,
                facecolor=PHASE_COLORS[task.phase],
                hatch=VIRTUAL_HATCHES[min(layout.chunk_of[task.stage], len(VIRTUAL_HATCHES) - 1)],
                edgecolor="white",
                linewidth=edge_w,
                gid=f"task:{task.phase}",
            )
        )
        fits = sizes.get((row, task.phase)) or box_label_size(
            task.duration_s * px_per_s, label, dpi
        )
        if (
            label
            and fits is not None
            and task.duration_s * px_per_s >= label_width_px(label, fits, dpi)
        ):
            ax.text(
                x + w / 2,
                row,
                label,
                ha="center",
                va="center",
                fontsize=fits,
                color="white",
                clip_on=True,
                gid="label",
            )


def _row_label_sizes(
    tasks: Sequence[Task],
    labels: Sequence[str],
    layout: _RowLayout,
    px_per_s: float,
    dpi: float,
) -> dict[tuple[int, str], float | None]:
    """One label size per row and phase (a row's forwards read alike), the largest at which
    all of them fit; None where none does (then each box its own)."""
    boxes: dict[tuple[int, str], list[tuple[float, str]]] = {}
    for t, lab in zip(tasks, labels, strict=True):
        if lab and t.phase != "loss":  # the loss box is labelled where it fits
            key = (layout.row_of[t.stage], t.phase)
            boxes.setdefault(key, []).append((t.duration_s * px_per_s, lab))
    return {key: label_size(group, dpi) for key, group in boxes.items()}


def _shade_idle(ax: Axes, timeline: Timeline, layout: _RowLayout) -> None:
    """Shade (``gid`` ``"bubble"``) the time each stage's *device* is idle: with dedicated
    devices that is the stage's bubble; stages sharing a device wait (unshaded) while it
    runs another stage."""
    from matplotlib.patches import Rectangle

    t0 = timeline.start_s
    for group in layout.groups:
        targets = (
            [layout.row_of[group[0]]] if layout.by_device else [layout.row_of[s] for s in group]
        )
        for row, (start, end) in ((r, gap) for gap in idle_spans(timeline, group) for r in targets):
            ax.add_patch(
                Rectangle(
                    ((start - t0) * 1e3, row - ROW_HEIGHT / 2),
                    (end - start) * 1e3,
                    ROW_HEIGHT,
                    facecolor=BUBBLE_COLOR,
                    edgecolor="#A0A0A0",
                    hatch="///",
                    linewidth=0.0,
                    gid="bubble",
                )
            )


def _frame(ax: Axes, timeline: Timeline, layout: _RowLayout) -> None:
    """Axes limits (the iteration in ms; row 0 on top), row names, title and grid."""
    ax.set_xlim(0, max(timeline.iteration_s, 1e-12) * 1e3)
    ax.set_ylim(layout.rows - 0.5, -0.5)
    ax.set_yticks(range(layout.rows), layout.names())
    ax.set_xlabel("time (ms)")
    ax.set_title(timeline_title(timeline), fontsize=10)
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.5)
    ax.set_axisbelow(True)


def task_label(task: Task, by_device: bool) -> str:
    """What a task's box says: its micro-batch (``c<chunk>:<micro-batch>`` on a row per
    rank), ``loss``; nothing for a transfer."""
    if task.phase == "send":
        return ""
    if task.phase == "loss":
        return "loss"
    return f"c{task.stage}:{task.microbatch}" if by_device else str(task.microbatch)


def label_width_px(label: str, size_pt: float, dpi: float) -> float:
    """Pixels ``label`` needs inside a box at ``size_pt``, with a pixel of margin each side."""
    return len(label) * DIGIT_EM * size_pt * dpi / 72 + 2


def label_size(boxes: Sequence[tuple[float, str]], dpi: float) -> float | None:
    """The largest of :data:`LABEL_SIZES_PT` at which every ``(width_px, label)`` box holds
    its label, so that boxes of a kind read in one size; None when no size fits them all
    (then each box takes its own, :func:`box_label_size`)."""
    for size in LABEL_SIZES_PT:
        if all(w >= label_width_px(lab, size, dpi) for w, lab in boxes):
            return size
    return None


def box_label_size(width_px: float, label: str, dpi: float) -> float | None:
    """The largest of :data:`LABEL_SIZES_PT` at which ``label`` fits a box ``width_px``
    wide; None when even the smallest does not (the box goes unlabelled)."""
    return label_size([(width_px, label)], dpi)


def timeline_width_in(timelines: Sequence[Timeline]) -> float:
    """Inches wide a figure of ``timelines`` (one time axis) is drawn: wide enough that its
    shortest labelled box holds two digits at the largest label size, within
    :data:`WIDTH_IN` (past the widest, smaller labels fit more boxes). Before, labels stopped at micro-batch 9 on an 8-stage GPT at M=16."""
    longest_s = max((t.iteration_s for t in timelines), default=0.0)
    shortest_s = min(
        (t.duration_s for tl in timelines for t in tl.tasks if t.phase not in ("send", "loss")),
        default=0.0,
    )
    if longest_s <= 0 or shortest_s <= 0:
        return WIDTH_IN[0]
    need_px = label_width_px("00", LABEL_SIZES_PT[0], 100.0)
    width = need_px * longest_s / shortest_s / (0.85 * 100.0)
    return min(max(width, WIDTH_IN[0]), WIDTH_IN[1])


def _legend(fig: Figure, timeline_phases: set[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=PHASE_COLORS[p], label=p) for p in PHASES if p in timeline_phases]
    handles.append(Patch(facecolor=BUBBLE_COLOR, edgecolor="#A0A0A0", hatch="///", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)


def timeline_figure(
    timeline: Timeline,
    compare: Timeline | None = None,
    *,
    titles: Sequence[str] | None = None,
) -> Figure:
    """The Gantt figure; with ``compare`` a second panel below sharing the time axis.

    Use it for predicted (``timeline``) over measured (``compare``) so the cost model's error
    is visible at a glance: both panels span the longer of the two iterations. ``titles``:
    one per panel instead of :func:`timeline_title` (``BenchResult.compare_titles`` names
    the clock each figure was read on).
    """
    timelines = [timeline] if compare is None else [timeline, compare]
    height = sum(1.0 + 0.38 * timeline_rows(t) for t in timelines) + 0.6
    width = timeline_width_in(timelines)
    fig = new_figure(width, height)
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    longest_s = max(t.iteration_s for t in timelines)
    for ax, tl in zip(axes, timelines, strict=True):
        draw_timeline(ax, tl, width_px=0.85 * width * fig.dpi * tl.iteration_s / longest_s)
        if tl is not timelines[-1]:
            ax.set_xlabel("")
    for ax, title in zip(axes, titles or (), strict=False):
        ax.set_title(title, fontsize=10)
    axes[0].set_xlim(0, longest_s * 1e3)
    _legend(fig, {t.phase for tl in timelines for t in tl.tasks})
    return fig


def plot_timeline(
    timeline: Timeline,
    out: str | Path,
    *,
    compare: Timeline | None = None,
    formats: Sequence[str] = ("png",),
    titles: Sequence[str] | None = None,
) -> list[Path]:
    """Write the Gantt chart to ``out.<fmt>`` (``out`` without suffix). Returns the paths."""
    fig = timeline_figure(timeline, compare, titles=titles)
    return save(fig, out, formats)
