"""Memory over time per rank, and every schedule side by side for one profile.

``memory_figure``: one panel per rank, its replayed bytes over the simulated iteration as a
step line (training state plus in-flight activations, plus the activations that zero-bubble
schedules hold until each weight gradient has run), with the rank's peak and, when known, its
memory limit. ``schedules_figure``: the timelines of several plans of one profile (one per
schedule) stacked on one time axis, each titled with its iteration time, bubble and peak
memory, the fastest first: which schedule wins here, and why. Matplotlib on the Agg canvas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe.core.humanize import format_bytes, format_seconds
from autopipe.core.plan import Plan
from autopipe.planner.simulate import Simulation, simulate_plan
from autopipe.viz.gantt import _legend, draw_timeline, timeline_rows
from autopipe.viz.style import HEADROOM, PHASE_COLORS, byte_unit, new_figure, save

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MemorySteps = Sequence[Sequence[tuple[float, float]]]
"""Per rank, ``(time_s, bytes)`` steps: the bytes hold from that time to the next step."""


def largest_bytes(steps: MemorySteps, limits: Sequence[float | None] = ()) -> float:
    """The most bytes any rank holds (or may hold: ``limits``), to pick the axes' unit."""
    held = [b for rank in steps for _, b in rank]
    return max([*held, *(x for x in limits if x is not None), 0.0])


def draw_memory(
    ax: Axes,
    steps: Sequence[tuple[float, float]],
    end_s: float,
    *,
    limit_bytes: float | None = None,
    label: str = "",
    unit: tuple[str, int] | None = None,
) -> None:
    """One rank's memory over time on ``ax`` (time in ms; bytes in ``unit``, a
    ``(name, bytes)`` pair, default the one :func:`~autopipe.viz.style.byte_unit` picks
    for this rank). O(steps)."""
    if not steps:
        return
    unit_name, unit_bytes = unit or byte_unit(largest_bytes([steps], [limit_bytes]))
    xs = [t * 1e3 for t, _ in steps] + [end_s * 1e3]
    ys = [b / unit_bytes for _, b in steps]
    ys.append(ys[-1])
    ax.step(xs, ys, where="post", color=PHASE_COLORS["forward"], linewidth=1.2, gid="memory")
    peak = max(b for _, b in steps)
    ax.axhline(peak / unit_bytes, color=PHASE_COLORS["backward"], linewidth=0.8, linestyle="--")
    text = f"{label}peak {format_bytes(peak)}"
    top = peak
    if limit_bytes is not None:
        ax.axhline(limit_bytes / unit_bytes, color="#C44E52", linewidth=1.0, gid="limit")
        text += f" of {format_bytes(limit_bytes)}"
        top = max(top, limit_bytes)
    ax.set_ylabel(unit_name, fontsize=8)
    ax.set_title(text, fontsize=8, loc="left")
    ax.set_xlim(0, max(end_s, 1e-12) * 1e3)
    ax.set_ylim(0, max(top, 1.0) * HEADROOM / unit_bytes)
    ax.grid(color="#EEEEEE", linewidth=0.5)


def memory_figure(
    sim: Simulation,
    *,
    limits_bytes: Sequence[float | None] | None = None,
    title: str = "",
) -> Figure:
    """Each rank's replayed memory over ``sim``'s iteration, one panel per rank.

    ``sim.memory`` must be recorded (``simulate_schedule`` / ``simulate_plan`` with
    ``record_tasks``); ``limits_bytes`` per rank draws each memory limit. O(steps)."""
    if not sim.memory:
        raise ValueError("the simulation recorded no memory; simulate with record_tasks=True")
    k = len(sim.memory)
    fig = new_figure(9.0, 0.6 + 1.1 * k)
    axes = fig.subplots(k, 1, sharex=True, squeeze=False)[:, 0]
    unit = byte_unit(largest_bytes(sim.memory, limits_bytes or ()))  # one unit for all ranks
    for r, (ax, steps) in enumerate(zip(axes, sim.memory, strict=True)):
        limit = limits_bytes[r] if limits_bytes is not None else None
        draw_memory(
            ax, steps, sim.iteration_time_s, limit_bytes=limit, label=f"rank {r}: ", unit=unit
        )
    axes[-1].set_xlabel("time (ms)")
    fig.suptitle(title or "memory per rank over one iteration", fontsize=10)
    return fig


def plan_memory_figure(plan: Plan) -> Figure:
    """:func:`memory_figure` of ``plan``'s simulated iteration. O(T)."""

    sim = simulate_plan(plan)
    limits = [plan.memory_per_device] * plan.num_stages if plan.memory_per_device else None
    title = (
        f"memory per rank ({plan.schedule}, K={plan.num_stages}, V={plan.virtual_stages}, "
        f"M={plan.microbatches})"
    )
    return memory_figure(sim, limits_bytes=limits, title=title)


def plot_memory(plan: Plan, out: str | Path, *, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Write :func:`plan_memory_figure` to ``out.<fmt>`` (``out`` without suffix)."""
    return save(plan_memory_figure(plan), out, formats)


def _summary(name: str, plan: Plan, peak: float) -> str:
    return (
        f"{name} (V={plan.virtual_stages}, M={plan.microbatches}): "
        f"{format_seconds(plan.iteration_time_s)}, bubble {100 * plan.bubble_fraction:.1f}%, "
        f"peak {format_bytes(peak)}"
    )


def schedules_figure(plans: Mapping[str, Plan | str]) -> tuple[Figure, Figure]:
    """Two figures for one profile planned with each schedule (``plan_each_schedule``'s
    dict; a string is why that schedule has no plan): the timelines on one time axis,
    fastest first, and each plan's memory per rank over time (every rank one line).
    O(sum of tasks)."""

    ok = sorted(
        ((n, p) for n, p in plans.items() if isinstance(p, Plan)),
        key=lambda item: item[1].iteration_time_s,
    )
    if not ok:
        raise ValueError("no schedule has a plan: " + "; ".join(map(str, plans.values())))
    sims = {n: simulate_plan(p) for n, p in ok}
    fig = _timelines_figure(plans, ok, sims)
    mem = _memory_over_time_figure(ok, sims)
    return fig, mem


def _timelines_figure(
    plans: Mapping[str, Plan | str],
    ok: Sequence[tuple[str, Plan]],
    sims: Mapping[str, Simulation],
) -> Figure:
    """:func:`schedules_figure`'s first figure: each plan of ``ok`` (fastest first) one
    timeline panel on one time axis; the title counts the schedules without a plan."""
    timelines = {n: s.timeline for n, s in sims.items()}
    rows = [timeline_rows(t) for t in timelines.values() if t is not None]
    fig = new_figure(12.0, 0.9 + sum(0.9 + 0.32 * r for r in rows))
    axes = fig.subplots(len(ok), 1, sharex=True, squeeze=False)[:, 0]
    longest = max(p.iteration_time_s for _, p in ok)
    phases: set[str] = set()
    for ax, (name, p) in zip(axes, ok, strict=True):
        tl = timelines[name]
        assert tl is not None
        draw_timeline(ax, tl, width_px=0.85 * 12.0 * fig.dpi * tl.iteration_s / longest)
        peak = max(sims[name].peak_bytes, default=0.0)
        ax.set_title("")  # draw_timeline's own title: this panel's summary replaces it
        ax.set_title(_summary(name, p, peak), fontsize=9, loc="left")
        ax.set_xlabel("")
        phases |= {t.phase for t in tl.tasks}
    axes[0].set_xlim(0, longest * 1e3)
    axes[-1].set_xlabel("time (ms)")
    skipped = [f"{n}: {why}" for n, why in plans.items() if not isinstance(why, Plan)]
    head = f"schedules for one profile, fastest first: {ok[0][0]} wins"
    fig.suptitle(head + ("" if not skipped else f" ({len(skipped)} without a plan)"), fontsize=10)
    _legend(fig, phases)
    return fig


def _memory_over_time_figure(
    ok: Sequence[tuple[str, Plan]], sims: Mapping[str, Simulation]
) -> Figure:
    """:func:`schedules_figure`'s second figure: each plan's memory per rank over one
    iteration, one panel per plan of ``ok``, the legend below the panels."""
    mem = new_figure(9.0, 1.0 + 1.3 * len(ok))
    maxes = mem.subplots(len(ok), 1, sharex=True, squeeze=False)[:, 0]
    unit_name, unit_bytes = byte_unit(
        max(largest_bytes(sims[n].memory, [p.memory_per_device]) for n, p in ok)
    )
    for ax, (name, p) in zip(maxes, ok, strict=True):
        _draw_rank_memory(ax, name, p, sims[name], unit_name, unit_bytes)
    maxes[-1].set_xlabel("time (ms)")
    # Below the panels, not on one: inside, it covered the first schedule's lines.
    handles: dict[str, Any] = {}
    for ax in maxes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    mem.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncol=min(len(handles), 8),
        fontsize=7,
    )
    mem.suptitle("memory per rank over one iteration, each schedule", fontsize=10)
    return mem


def _draw_rank_memory(
    ax: Axes, name: str, p: Plan, sim: Simulation, unit_name: str, unit_bytes: float
) -> None:
    """One panel of :func:`_memory_over_time_figure`: plan ``p``'s memory per rank over time
    (every rank one line, in ``unit_name``) and its memory limit."""
    for r, steps in enumerate(sim.memory):
        xs = [t * 1e3 for t, _ in steps] + [sim.iteration_time_s * 1e3]
        ys = [b / unit_bytes for _, b in steps]
        ys.append(ys[-1] if ys else 0.0)
        ax.step(xs, ys, where="post", linewidth=1.0, label=f"rank {r}", gid="memory")
    top = largest_bytes(sim.memory, [p.memory_per_device])
    if p.memory_per_device:
        ax.axhline(
            p.memory_per_device / unit_bytes,
            color="#C44E52",
            linewidth=1.0,
            gid="limit",
            label="memory limit",
        )
    ax.set_title(_summary(name, p, max(sim.peak_bytes, default=0.0)), fontsize=8, loc="left")
    ax.set_ylabel(unit_name, fontsize=8)
    ax.set_ylim(0, max(top, 1.0) * HEADROOM / unit_bytes)
    ax.grid(color="#EEEEEE", linewidth=0.5)


def plot_schedules(
    plans: Mapping[str, Plan | str], out_dir: str | Path, *, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """Write ``schedules.<fmt>`` and ``schedules_memory.<fmt>`` into ``out_dir``."""
    timelines, memory = schedules_figure(plans)
    out = Path(out_dir)
    return save(timelines, out / "schedules", formats) + save(
        memory, out / "schedules_memory", formats
    )
