"""Replay a measured run through the planner's simulator: is the schedule model right?

Torch-free. A run's :class:`~autopipe.core.timeline.Timeline` (``autopipe run --trace``:
every rank's chunk actions, losses and steps, device = rank) holds how long each forward,
backward, input- and weight-gradient took, and when. :func:`replay` gives exactly those
durations to :func:`autopipe.planner.simulate.simulate_schedule`, the simulator that prices
every plan, driven by the plan's rank orders (``plan.actions``), and compares the step it
simulates with the step that was measured: with the durations known, what is left is the
schedule model (which action waits for which, in what order).

What the runtime does between the timed actions is measured from the same trace, named,
and given to the simulator too:

- ``loss``: torch computes each micro-batch's loss right after the last chunk's forward,
  outside it, on the same rank: it is added to that forward (the profile's convention).
- ``dispatch``: the time between two actions of a rank when the second had nothing to
  wait for (the schedule's bookkeeping, posting sends and receives, the stage's input and
  output handling): each action's own, or (``medians=True``, and for an action that waited)
  its rank's median; charged in front of the action.
- ``transfer``: how long after a chunk's output (activations forward, the input gradient
  backward) was computed on one rank the waiting rank started on it, over the actions that
  did wait for it: each action's own or the median of its direction.
- ``head``: each rank's step start (mark ``"step"``) to its first action: splitting the
  batch into micro-batches, the schedule's set-up; it is when each simulated rank starts.
- ``tail``: the last action's end to the step's end: waiting for the last sends, the loss
  all-reduce, scaling the gradients.
- ``optimizer``: the optimizer step after ``pipe.step`` (mark ``"optimizer"``), reported,
  not part of the step.

The replayed step is ``origin -> max over ranks of the simulated end + tail``; the
remainder ``measured - replayed`` is what the model does not explain. ``medians=True``
gives every action of a chunk and phase the median of its recorded durations (and every
rank its median dispatch, every direction its median transfer): the figures the planner
itself works with, one per chunk. O(T log T) for T tasks.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopipe.planner.simulate import ChunkWork, Simulation, simulate_schedule

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.timeline import Action, Mark, Task, Timeline

__all__ = [
    "Overheads",
    "RankReplay",
    "ReplayError",
    "StepReplay",
    "replay",
    "replay_step",
    "split_steps",
]

COMPUTE_PHASES = ("forward", "backward", "backward_input", "backward_weight")
"""The phases the schedules order (what the simulator runs); ``loss`` joins the forward."""


class ReplayError(UsageError, ValueError):
    """The trace does not match the plan (other chunk count, schedule, placement, actions)."""


@dataclass(frozen=True)
class Overheads:
    """The runtime's work between the timed actions of one step, measured (seconds)."""

    head_s: list[float]
    """Per rank: its step's start to its first action."""
    dispatch_s: list[float]
    """Per rank: the median gap in front of an action that had nothing to wait for."""
    dispatch_total_s: list[float]
    """Per rank: the dispatch charged to its actions in the replay, summed."""
    transfer_s: dict[str, float]
    """``"activations"`` (forward) and ``"gradients"`` (backward): the median time from a
    chunk's output to the other rank starting on it, over the actions that waited for it
    (absent: none waited)."""
    loss_s: float
    """The losses, summed (on the last chunk's rank; added to its forwards)."""
    tail_s: float
    """The last action's end to the step's end."""
    optimizer_s: float
    """The optimizer step after the step, slowest rank (0: not recorded)."""


@dataclass(frozen=True)
class RankReplay:
    """One rank's idle time over the step (seconds): the step less its actions' time."""

    rank: int
    busy_s: float
    """Its actions' seconds (losses included) as measured."""
    idle_measured_s: float
    idle_replayed_s: float


@dataclass
class StepReplay:
    """One step, measured and replayed (seconds)."""

    step: int
    """1-based index in the trace."""
    measured_s: float
    replayed_s: float
    span_measured_s: float
    """First action's start to last action's end, measured."""
    span_replayed_s: float
    ranks: list[RankReplay]
    overheads: Overheads
    simulation: Simulation
    medians: bool
    order_differs: list[str] = field(default_factory=list)
    """Ranks whose recorded order is not the plan's (``"rank 1 at action 3: ran 0B1, the
    plan says 0F2"``); the simulator follows the plan's."""

    @property
    def error(self) -> float:
        """(replayed - measured) / measured: the unexplained remainder as a fraction."""
        return (self.replayed_s - self.measured_s) / self.measured_s if self.measured_s else 0.0

    @property
    def remainder_s(self) -> float:
        """measured - replayed: what the model does not explain."""
        return self.measured_s - self.replayed_s

    @property
    def bubble_measured(self) -> float:
        """Mean idle share of the ranks over the measured step."""
        return _share(sum(r.idle_measured_s for r in self.ranks), len(self.ranks) * self.measured_s)

    @property
    def bubble_replayed(self) -> float:
        return _share(sum(r.idle_replayed_s for r in self.ranks), len(self.ranks) * self.replayed_s)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def split_steps(timeline: Timeline) -> list[Timeline]:
    """The timeline's steps, each a Timeline of its own: rank ``r``'s ``i``-th ``"step"``
    mark and its tasks and marks from that mark's start to the next one's. A timeline
    without step marks is one step. Raises ReplayError when the ranks' step counts differ."""
    steps = timeline.marked("step")
    if not steps:
        return [timeline]
    devices = sorted({k.device for k in steps} | {t.device for t in timeline.tasks})
    per_rank = {d: timeline.marked("step", d) for d in devices}
    counts = {d: len(v) for d, v in per_rank.items()}
    if len(set(counts.values())) != 1:
        raise ReplayError(
            "the ranks recorded different numbers of steps ("
            + ", ".join(f"rank {d}: {n}" for d, n in counts.items())
            + "); trace every rank of the run (autopipe run --trace)"
        )
    out = []
    for i in range(next(iter(counts.values()))):
        tasks: list[Task] = []
        marks: list[Mark] = []
        for d in devices:
            start = per_rank[d][i].start_s
            stop = per_rank[d][i + 1].start_s if i + 1 < counts[d] else float("inf")
            tasks += [t for t in timeline.tasks if t.device == d and start <= t.start_s < stop]
            marks += [k for k in timeline.marks if k.device == d and start <= k.start_s < stop]
        tasks.sort(key=lambda t: (t.start_s, t.stage, t.microbatch))
        marks.sort(key=lambda k: (k.start_s, k.device))
        out.append(
            Timeline(
                tasks,
                timeline.num_stages,
                label=timeline.label,
                schedule=timeline.schedule,
                device_names=list(timeline.device_names),
                marks=marks,
            )
        )
    return out


def replay(timeline: Timeline, plan: Plan, *, medians: bool = False) -> list[StepReplay]:
    """Every step of ``timeline`` (a trace of ``plan``'s run) replayed; see the module doc.
    Raises ReplayError when the trace does not match the plan."""
    _check_matches(timeline, plan)
    return [
        replay_step(one, plan, medians=medians, step=i + 1)
        for i, one in enumerate(split_steps(timeline))
    ]


def _check_matches(timeline: Timeline, plan: Plan) -> None:
    chunks = len(plan.stages)
    if timeline.num_stages != chunks:
        raise ReplayError(
            f"the trace has {timeline.num_stages} chunks, the plan {chunks} "
            f"({plan.num_stages} ranks x {plan.virtual_stages}); give the plan the run used"
        )
    if timeline.schedule and timeline.schedule != plan.schedule:
        raise ReplayError(
            f"the trace ran schedule {timeline.schedule}, the plan says {plan.schedule}; "
            "give the plan the run used"
        )
    ranks = chunk_ranks(plan.schedule, plan.num_stages, plan.virtual_stages)
    for c, device in enumerate(timeline.stage_devices()):
        if device is not None and device != ranks[c]:
            raise ReplayError(
                f"chunk {c} ran on device {device}, the plan places it on rank {ranks[c]}; "
                "replay needs a trace of `autopipe run --trace` (one device per rank)"
            )


def _producer(a: Action, last: int) -> Action | None:
    """The action whose output ``a`` waits for (the simulator's rules), or None."""
    c, mb, phase = a
    if phase == "forward":
        return Action(c - 1, mb, "forward") if c > 0 else None
    if phase in ("backward", "backward_input"):
        return None if c == last else Action(c + 1, mb, "")  # "" = B or I, as recorded
    return None  # backward_weight follows its input gradient on the same rank


def replay_step(
    timeline: Timeline, plan: Plan, *, medians: bool = False, step: int = 1
) -> StepReplay:
    """One step (a Timeline holding one step of every rank, e.g. from :func:`split_steps`)
    replayed through :func:`simulate_schedule` with the plan's orders. Raises ReplayError
    when its actions are not the plan's."""
    k, v, m = plan.num_stages, plan.virtual_stages, plan.microbatches
    ranks = chunk_ranks(plan.schedule, k, v)
    orders = plan.actions
    trace = _recorded_step(timeline, k, len(plan.stages) - 1, step)
    order_differs = _order_differences(trace, orders, plan)
    start, origin, last_end, end = _step_bounds(timeline, trace)
    gaps = _gaps(trace, start, ranks)
    dispatch, head, transfer = _dispatch_and_transfer(trace, gaps)
    dur = _durations(trace.spans, medians)
    action_s, delay_s, dispatch_total = _charges(
        trace, start, gaps, _Fronts(head, dispatch, transfer), dur, medians
    )
    works = [ChunkWork(forward_s=0.0, backward_s=0.0) for _ in plan.stages]
    sim = simulate_schedule(
        works,
        plan.schedule,
        k,
        m,
        orders=orders,
        action_s=action_s,
        arrival_delay_s=delay_s,
        rank_start_s=[start[r] - origin for r in range(k)],
    )
    tail = end - last_end
    replayed = sim.iteration_time_s + tail
    measured = end - origin
    optimizer = max((mk.duration_s for mk in timeline.marked("optimizer")), default=0.0)
    first_start = min(s for s, _ in trace.spans.values())
    return StepReplay(
        step=step,
        measured_s=measured,
        replayed_s=replayed,
        span_measured_s=last_end - first_start,
        span_replayed_s=sim.iteration_time_s - (first_start - origin),
        ranks=_rank_replays(timeline, trace, ranks, dur, measured, replayed),
        overheads=Overheads(
            head_s=head,
            dispatch_s=dispatch,
            dispatch_total_s=dispatch_total,
            transfer_s=transfer,
            loss_s=trace.loss_s,
            tail_s=tail,
            optimizer_s=optimizer,
        ),
        simulation=sim,
        medians=medians,
        order_differs=order_differs,
    )


def _rank_replays(
    timeline: Timeline,
    trace: _StepTrace,
    ranks: list[int],
    dur: dict[Action, float],
    measured_s: float,
    replayed_s: float,
) -> list[RankReplay]:
    """Each rank's busy seconds as measured, and its idle seconds measured and replayed."""
    k = len(trace.by_rank)
    busy_measured = [timeline.device_busy_s(_stages_on(ranks, r)) for r in range(k)]
    # (the durations hold the losses: joined to the last chunk's forwards)
    busy_replayed = [sum(dur[a] for a in trace.by_rank[r]) for r in range(k)]
    return [
        RankReplay(
            r,
            busy_measured[r],
            max(measured_s - busy_measured[r], 0.0),
            max(replayed_s - busy_replayed[r], 0.0),
        )
        for r in range(k)
    ]


@dataclass
class _StepTrace:
    """One step's recorded compute actions."""

    step: int
    """1-based, for the error messages."""
    last: int
    """The last chunk's index."""
    spans: dict[Action, list[float]]
    """Action -> ``[start_s, end_s]`` as recorded (a last-chunk forward ends with its loss)."""
    by_rank: list[list[Action]]
    """Each rank's actions in the order they started."""
    loss_s: float
    """The losses' seconds, summed."""

    def input_of(self, a: Action) -> Action | None:
        """The recorded action whose output ``a`` waits for (:func:`_producer`; an input
        gradient is the whole backward or the input-gradient pass, whichever ran), or None.
        ReplayError when that backward is not in the trace."""
        dep = _producer(a, self.last)
        if dep is None or dep.phase != "":
            return dep
        for phase in ("backward", "backward_input"):
            if Action(dep.stage, dep.microbatch, phase) in self.spans:
                return Action(dep.stage, dep.microbatch, phase)
        raise ReplayError(
            f"step {self.step}: chunk {dep.stage} has no backward of micro-batch {dep.microbatch}"
        )


@dataclass(frozen=True)
class _Gaps:
    """What was in front of each recorded action (seconds)."""

    gap: dict[Action, float]
    """An action that did not wait for another rank: its start less its rank's previous end
    (or the rank's step start)."""
    waited: dict[Action, float]
    """An action that waited for another rank's output: its start less that output's end."""
    direction: dict[Action, str]
    """An action whose input comes from another rank: ``"activations"`` or ``"gradients"``."""


@dataclass(frozen=True)
class _Fronts:
    """The overheads charged in front of actions (seconds): per rank its ``head`` and
    median ``dispatch``; per direction the median ``transfer``."""

    head: list[float]
    dispatch: list[float]
    transfer: dict[str, float]


def _recorded_step(timeline: Timeline, num_ranks: int, last: int, step: int) -> _StepTrace:
    """The step's compute actions, each recorded once, on ranks ``0..num_ranks - 1``, with
    the losses joined to the last chunk's forwards. ReplayError otherwise. O(T log T)."""
    spans: dict[Action, list[float]] = {}
    loss_s = 0.0
    by_rank: list[list[Action]] = [[] for _ in range(num_ranks)]
    for t in sorted(timeline.tasks, key=lambda t: t.start_s):
        if t.phase == "loss":
            f = spans.get(Action(t.stage, t.microbatch, "forward"))
            if f is None:
                raise ReplayError(
                    f"step {step}: a loss of micro-batch {t.microbatch} comes before the "
                    "last chunk's forward of it; not a trace of this plan"
                )
            f[1] = max(f[1], t.end_s)
            loss_s += t.duration_s
            continue
        if t.phase not in COMPUTE_PHASES:
            continue  # a recompute nests in its backward; sends are not recorded by ranks
        a = t.action
        if a in spans:
            raise ReplayError(
                f"step {step}: action {a} was recorded twice; split the trace into steps "
                "(record with autopipe run --trace, which marks each step)"
            )
        spans[a] = [t.start_s, t.end_s]
        if not 0 <= t.device < num_ranks:
            raise ReplayError(
                f"step {step}: a task ran on device {t.device}; the plan has ranks "
                f"0..{num_ranks - 1}"
            )
        by_rank[t.device].append(a)
    return _StepTrace(step, last, spans, by_rank, loss_s)


def _order_differences(
    trace: _StepTrace, orders: Sequence[Sequence[Action]], plan: Plan
) -> list[str]:
    """Per rank whose recorded order is not the plan's, where it first differs. ReplayError
    when a rank ran other actions than the plan's."""
    differs = []
    for r, order in enumerate(orders):
        want = set(order)
        got = set(trace.by_rank[r])
        if want != got:
            missing, extra = sorted(want - got), sorted(got - want)
            what = (
                f"lacks {len(missing)} of the plan's actions (first: {missing[0]})"
                if missing
                else f"ran {len(extra)} actions the plan does not have (first: {extra[0]})"
            )
            raise ReplayError(
                f"step {trace.step}: rank {r} {what}; the trace is not of this plan "
                f"({plan.schedule}, {plan.microbatches} micro-batches, "
                f"{plan.num_stages} x {plan.virtual_stages} chunks)"
            )
        for i, (ran, planned) in enumerate(zip(trace.by_rank[r], order, strict=True)):
            if ran != planned:
                differs.append(f"rank {r} at action {i}: ran {ran}, the plan says {planned}")
                break
    return differs


def _step_bounds(timeline: Timeline, trace: _StepTrace) -> tuple[list[float], float, float, float]:
    """Each rank's step start (its ``"step"`` mark, else its first action), the earliest of
    them (the origin), the last action's end and the step's end (the last mark's or action's
    end), in the trace's seconds."""
    step_marks = {mk.device: mk for mk in timeline.marked("step")}
    start = [
        step_marks[r].start_s if r in step_marks else trace.spans[actions[0]][0]
        for r, actions in enumerate(trace.by_rank)
    ]
    last_end = max(e for _, e in trace.spans.values())
    end = max((mk.end_s for mk in step_marks.values()), default=last_end)
    return start, min(start), last_end, max(end, last_end)


def _gaps(trace: _StepTrace, start: Sequence[float], ranks: Sequence[int]) -> _Gaps:
    """The gap in front of each action, and the transfer lag of those that waited for
    another rank. O(T)."""
    gap: dict[Action, float] = {}
    waited: dict[Action, float] = {}
    direction: dict[Action, str] = {}
    for r, actions in enumerate(trace.by_rank):
        prev_end = start[r]
        for a in actions:
            s, e = trace.spans[a]
            dep = trace.input_of(a)
            if dep is not None and ranks[dep.stage] != r:
                direction[a] = "activations" if a.phase == "forward" else "gradients"
                dep_end = trace.spans[dep][1]
                if dep_end > prev_end:
                    waited[a] = max(s - dep_end, 0.0)
            if a not in waited:
                gap[a] = max(s - prev_end, 0.0)
            prev_end = e
    return _Gaps(gap, waited, direction)


def _dispatch_and_transfer(
    trace: _StepTrace, gaps: _Gaps
) -> tuple[list[float], list[float], dict[str, float]]:
    """Per rank its median dispatch (over the actions after its first that did not wait)
    and its head; per direction the median transfer lag (absent: none waited)."""
    dispatch = []
    for actions in trace.by_rank:
        samples = [gaps.gap[a] for a in actions[1:] if a in gaps.gap]
        dispatch.append(statistics.median(samples) if samples else 0.0)
    # A rank whose first action waited for another rank shows no set-up of its own: it is
    # charged its median dispatch.
    head = [gaps.gap.get(actions[0], dispatch[r]) for r, actions in enumerate(trace.by_rank)]
    transfer = {}
    for name in ("activations", "gradients"):
        samples = [w for a, w in gaps.waited.items() if gaps.direction[a] == name]
        if samples:
            transfer[name] = statistics.median(samples)
    return dispatch, head, transfer


def _durations(spans: dict[Action, list[float]], medians: bool) -> dict[Action, float]:
    """Each action's recorded seconds, or (``medians``) its chunk and phase's median."""
    dur = {a: e - s for a, (s, e) in spans.items()}
    if medians:
        groups: dict[tuple[int, str], list[float]] = {}
        for a, d in dur.items():
            groups.setdefault((a.stage, a.phase), []).append(d)
        med = {key: statistics.median(ds) for key, ds in groups.items()}
        dur = {a: med[(a.stage, a.phase)] for a in dur}
    return dur


def _charges(
    trace: _StepTrace,
    start: Sequence[float],
    gaps: _Gaps,
    fronts: _Fronts,
    dur: dict[Action, float],
    medians: bool,
) -> tuple[dict[Action, float], dict[Action, float], list[float]]:
    """What the simulator is given: each action's seconds (its dispatch in front of its
    duration), the arrival delay of each output another rank waits for, and per rank the
    dispatch charged (its head left out). O(T)."""
    action_s: dict[Action, float] = {}
    delay_s: dict[Action, float] = {}
    dispatch_total = [0.0] * len(trace.by_rank)
    spans = trace.spans
    for r, actions in enumerate(trace.by_rank):
        prev_end = start[r]
        for i, a in enumerate(actions):
            if i == 0:
                front = fronts.head[r]
            elif medians or a not in gaps.gap:
                front = fronts.dispatch[r]
            else:
                front = gaps.gap[a]
            if not medians:
                # Its own: an action that waited had at most the time it waited for dispatch.
                front = min(front, max(spans[a][0] - prev_end, 0.0))
            prev_end = spans[a][1]
            if i > 0:
                dispatch_total[r] += front
            action_s[a] = front + dur[a]
            if a in gaps.direction:  # what it waits for comes from another rank
                dep = trace.input_of(a)
                assert dep is not None
                lag = fronts.transfer.get(gaps.direction[a], 0.0)
                if not medians:
                    # Its own: measured when it waited; else at most what it was.
                    lag = gaps.waited.get(a, min(lag, max(spans[a][0] - spans[dep][1], 0.0)))
                # The simulator starts a task when its input is there and charges ``front``
                # first: the input must be there ``front`` before the compute starts.
                delay_s[dep] = lag - front
    return action_s, delay_s, dispatch_total


def _stages_on(ranks: Sequence[int], r: int) -> list[int]:
    return [c for c, rank in enumerate(ranks) if rank == r]
