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

from collections.abc import Sequence
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
from autopipe.viz.data import balance_data, bubble_data, scaling_data

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
    "plot_all": "autopipe.viz.plan_plots",
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
    return {
        "bubble": bubble_data(plan, profile, ks=bubble_ks),
        "balance": balance_data(plan, profile),
        "scaling": scaling_data(plan, profile, max_gpus=max_gpus),
    }
