"""Check, at build time, that torch's schedule runs the plan's per-rank order.

The plan's timings and memory were simulated on its own orders
(``Plan.actions``, one list of ``Action(chunk, micro-batch, phase)`` per pipeline rank,
``autopipe.core.schedules.rank_orders``); ``autopipe run`` executes torch.distributed.pipelining's class of
the same name, which generates its own order. :func:`check_torch_order` reads torch's order
off the built schedule object and refuses, in one line naming the schedule, the rank and the
first differing action, anything other than the plan's.

What torch exposes (2.13): the multi-stage classes (interleaved 1F1B, looped BFS,
interleaved zero bubble, ZB-V, DualPipeV) keep every rank's actions in ``pipeline_order``
(``{rank: [_Action | None]}``; an overlapped forward+backward is one action with
``sub_actions``, listed forward first as the plan lists them; communication actions are
skipped). ``ScheduleGPipe`` and ``Schedule1F1B`` run a fixed loop in ``_step_microbatches``
and keep no order worth reading (1F1B's ``_get_pipeline_order`` is off by one micro-batch on
later ranks), so for them the check is the class and the micro-batch count. O(K V M).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.timeline import Action
from autopipe.core.vocabulary import TORCH_CLASSES

__all__ = ["ScheduleOrderMismatchError", "check_torch_order", "torch_rank_orders"]

_PHASES = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
"""torch's ``_ComputationType`` values of the compute actions, as the plan's phases."""


class ScheduleOrderMismatchError(UsageError, ValueError):
    """torch's schedule would run another order than the plan's (whose timings and memory
    were predicted for its own)."""


def torch_rank_orders(schedule: Any) -> list[list[Action]] | None:
    """Each rank's compute actions in the order torch's ``schedule`` object runs them (rank
    ascending), or None for a class that keeps no readable order (GPipe, 1F1B)."""
    if not isinstance(schedule, PipelineScheduleMulti):
        return None  # GPipe, 1F1B: their pipeline_order is not what they run
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict):
        return None
    out = []
    for rank in sorted(order):
        actions = []
        for action in order[rank]:
            if action is None:
                continue
            subs = getattr(action, "sub_actions", None)
            for sub in subs if subs is not None else (action,):
                phase = _PHASES.get(str(sub.computation_type.value))
                if phase is not None:
                    actions.append(Action(sub.stage_index, sub.microbatch_index, phase))
        out.append(actions)
    return out


def check_torch_order(schedule: Any, plan: Plan, orders: Sequence[Sequence[Action]]) -> None:
    """Raise :class:`ScheduleOrderMismatchError` unless ``schedule`` (torch's built object)
    runs ``orders`` (the plan's, ``plan.actions``): the class the
    plan names, its micro-batch count, and every rank's compute actions where torch exposes
    them (see the module docstring)."""
    name = plan.schedule
    where = f"{name}, {plan.num_stages} ranks x {plan.virtual_stages} chunks, M={plan.microbatches}"
    expected_class = TORCH_CLASSES[name]
    if type(schedule).__name__ != expected_class:
        raise ScheduleOrderMismatchError(
            f"the plan's schedule is {name} ({expected_class}) but torch built "
            f"{type(schedule).__name__} ({where}); re-plan or rebuild"
        )
    microbatches = getattr(schedule, "_n_microbatches", plan.microbatches)
    if microbatches != plan.microbatches:
        raise ScheduleOrderMismatchError(
            f"torch's {expected_class} runs {microbatches} micro-batches where the plan has "
            f"{plan.microbatches} ({where})"
        )
    torch_orders = torch_rank_orders(schedule)
    if torch_orders is None:
        return
    if len(torch_orders) != len(orders):
        raise ScheduleOrderMismatchError(
            f"torch's {expected_class} orders {len(torch_orders)} ranks where the plan has "
            f"{len(orders)} ({where})"
        )
    for rank, (theirs, ours) in enumerate(zip(torch_orders, orders, strict=True)):
        if list(theirs) == list(ours):
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
            min(len(theirs), len(ours)),
        )
        got = str(theirs[at]) if at < len(theirs) else "nothing"
        want = str(ours[at]) if at < len(ours) else "nothing"
        raise ScheduleOrderMismatchError(
            f"torch's {expected_class} runs rank {rank}'s compute action {at} as {got} where "
            f"the plan's order has {want} ({where}): the plan's timings and memory are for "
            "another order; re-plan with this torch"
        )
