"""``autopipe.replay(trace, plan)``: a run's own durations through the planner's simulator.

The pure replay is :mod:`autopipe.planner.replay` (torch-free); this module opens the files,
summarises the steps and prints the report ``autopipe replay`` shows. Import is torch-free.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopipe.core.plan import Plan, load_plan
from autopipe.core.timeline import Timeline, load_chrome_trace
from autopipe.planner.replay import ReplayError, StepReplay
from autopipe.planner.replay import replay as replay_steps

__all__ = ["ReplayError", "ReplayReport", "replay"]


@dataclass
class ReplayReport:
    """Every step of a trace, measured and replayed; the summary skips step 1 when there
    are more (torch infers the stages' shapes in it, and first calls allocate)."""

    plan: Plan
    steps: list[StepReplay]
    medians: bool

    @property
    def steady(self) -> list[StepReplay]:
        """The steps the summary is over: all after the first, or the only one."""
        return self.steps[1:] or self.steps

    @property
    def measured_s(self) -> float:
        """Median measured step over :attr:`steady` (seconds)."""
        return statistics.median(s.measured_s for s in self.steady)

    @property
    def replayed_s(self) -> float:
        return statistics.median(s.replayed_s for s in self.steady)

    @property
    def errors(self) -> list[float]:
        """(replayed - measured) / measured of each steady step."""
        return [s.error for s in self.steady]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.plan.schedule,
            "num_stages": self.plan.num_stages,
            "virtual_stages": self.plan.virtual_stages,
            "microbatches": self.plan.microbatches,
            "durations": "chunk medians" if self.medians else "per action",
            "predicted_s": self.plan.iteration_time_s,
            "measured_s": self.measured_s,
            "replayed_s": self.replayed_s,
            "steps": [
                {
                    "step": s.step,
                    "measured_s": s.measured_s,
                    "replayed_s": s.replayed_s,
                    "error": s.error,
                    "span_measured_s": s.span_measured_s,
                    "span_replayed_s": s.span_replayed_s,
                    "bubble_measured": s.bubble_measured,
                    "bubble_replayed": s.bubble_replayed,
                    "ranks": [
                        {
                            "rank": r.rank,
                            "busy_s": r.busy_s,
                            "idle_measured_s": r.idle_measured_s,
                            "idle_replayed_s": r.idle_replayed_s,
                        }
                        for r in s.ranks
                    ],
                    "overheads": {
                        "head_s": s.overheads.head_s,
                        "dispatch_s": s.overheads.dispatch_s,
                        "dispatch_total_s": s.overheads.dispatch_total_s,
                        "transfer_s": s.overheads.transfer_s,
                        "loss_s": s.overheads.loss_s,
                        "tail_s": s.overheads.tail_s,
                        "optimizer_s": s.overheads.optimizer_s,
                    },
                    "order_differs": s.order_differs,
                }
                for s in self.steps
            ],
        }


def replay(
    timeline: Timeline | str | os.PathLike[str],
    plan: Plan | str | os.PathLike[str],
    *,
    medians: bool = False,
) -> ReplayReport:
    """Replay a run's trace (``autopipe run --trace``: a Timeline or its Chrome trace file)
    of ``plan`` (a Plan or its JSON file) through the planner's simulator, step by step.

    ``medians``: every action of a chunk and phase gets their median duration (the
    planner's view: one figure per chunk) instead of its own. Raises ReplayError (a
    ``ValueError``) when the trace is not of this plan; TimelineFormatError and
    PlanFormatError for unreadable files.
    """
    if not isinstance(timeline, Timeline):
        timeline = load_chrome_trace(timeline)
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    return ReplayReport(plan, replay_steps(timeline, plan, medians=medians), medians)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def format_report(report: ReplayReport, *, detail_step: int | None = None) -> str:
    """The text ``autopipe replay`` prints: a row per step, the summary, then one step in
    detail (default: the last): each rank's idle time and the runtime's work by name."""
    p = report.plan
    lines = [
        f"replay: {p.schedule}, {p.num_stages} ranks x {p.virtual_stages} chunks, "
        f"{p.microbatches} micro-batches; durations "
        + ("per chunk (medians)" if report.medians else "per action")
        + " through the planner's simulator",
        f"{'step':>4s} {'measured':>10s} {'replayed':>10s} {'error':>7s} "
        f"{'bubble: measured':>17s} {'replayed':>9s}",
    ]
    for s in report.steps:
        lines.append(
            f"{s.step:4d} {_ms(s.measured_s):>10s} {_ms(s.replayed_s):>10s} {_pct(s.error):>7s} "
            f"{s.bubble_measured * 100:16.1f}% {s.bubble_replayed * 100:8.1f}%"
        )
    errors = report.errors
    which = f"steps {report.steady[0].step}-{report.steady[-1].step}"
    lines.append(
        f"{which}: median measured {_ms(report.measured_s)}, replayed {_ms(report.replayed_s)}; "
        f"error median {_pct(statistics.median(errors))}, range {_pct(min(errors))} .. "
        f"{_pct(max(errors))}"
        + (
            f"; the plan predicted {_ms(p.iteration_time_s)} from its profile"
            if p.iteration_time_s > 0
            else ""
        )
    )
    s = _pick(report.steps, detail_step)
    o = s.overheads
    lines.append(f"step {s.step}:")
    lines.append(f"  {'rank':>4s} {'busy':>10s} {'idle: measured':>15s} {'replayed':>10s}")
    for r in s.ranks:
        lines.append(
            f"  {r.rank:4d} {_ms(r.busy_s):>10s} {_ms(r.idle_measured_s):>15s} "
            f"{_ms(r.idle_replayed_s):>10s}"
        )
    per_rank = ", ".join(
        f"rank {r}: {_ms(d)} median, {_ms(t)} in all"
        for r, (d, t) in enumerate(zip(o.dispatch_s, o.dispatch_total_s, strict=True))
    )
    transfers = ", ".join(f"{k} {_ms(v)}" for k, v in o.transfer_s.items()) or "no rank waited"
    lines += [
        "  runtime work outside the timed actions (measured; given to the simulator):",
        f"    loss (after the last chunk's forwards; joined to them): {_ms(o.loss_s)}",
        f"    dispatch between actions: {per_rank}",
        f"    transfers (output to the waiting rank's start): {transfers}",
        "    step start to first action (micro-batch split, set-up): "
        + ", ".join(f"rank {r}: {_ms(h)}" for r, h in enumerate(o.head_s)),
        f"    last action to step end (last sends, loss all-reduce, gradient scaling): "
        f"{_ms(o.tail_s)}",
        f"  unexplained remainder (measured - replayed): {_ms(s.remainder_s)} ({_pct(-s.error)})",
        "  not in the step: optimizer step "
        + (_ms(o.optimizer_s) if o.optimizer_s else "not recorded"),
    ]
    if s.order_differs:
        lines.append(
            "  the run's order differs from the plan's (the simulator follows the plan's): "
            + "; ".join(s.order_differs)
        )
    return "\n".join(lines)


def _pick(steps: Sequence[StepReplay], step: int | None) -> StepReplay:
    if step is None:
        return steps[-1]
    for s in steps:
        if s.step == step:
            return s
    raise ReplayError(f"--step {step}: the trace has steps 1..{len(steps)}")
