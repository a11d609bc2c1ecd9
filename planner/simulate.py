"""The schedule simulator: every schedule's per-rank order, timed with the profile's costs,
and each rank's memory replayed over the iteration.

Torch-free. Two engines:

* :func:`simulate_schedule` (the planner's): a plan's ``K x V`` chunks on ``K`` dedicated
  ranks. Each rank runs its actions in the order torch's schedule class runs them
  (:func:`autopipe.core.schedules.rank_orders`), one task at a time, each as soon as the
  rank is free and its input is there: ``forward(c, m)`` waits for chunk ``c - 1``'s output
  of micro-batch ``m`` (its forward, plus the blocking ``send`` when chunk ``c - 1`` is on
  another rank); the whole ``backward`` or the input gradient ``backward_input`` of ``(c, m)``
  waits for the input gradient of ``(c + 1, m)`` (the last chunk: for its own forward; a
  checkpointed chunk re-computes its forward just before); ``backward_weight`` follows its
  ``backward_input`` on the same rank. Memory per rank is replayed over the same tasks (see
  :func:`replay_memory`). Cost: O(T) for T = tasks (about 2-3 per chunk and micro-batch).
* :func:`simulate` (GPipe fill-drain and 1F1B, one stage per device, optionally several
  stages list-scheduled on one shared device, which is how ``autopipe bench`` predicts a
  single-process run): each stage runs a fixed program of tasks, one at a time, per
  micro-batch m: ``forward`` -> ``send`` ... later ``recompute`` -> ``backward``, with the same
  dependencies; stages listed together in ``shared_device_groups`` share one physical
  device and at most one of their tasks runs at a time (earliest possible start first, then
  backward work before forward work, then lower stage). O(T log K). On dedicated devices it
  gives the same times as :func:`simulate_schedule` (tested).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_order, rank_orders
from autopipe.core.timeline import PHASES, Action, Task, Timeline

__all__ = [
    "PHASES",
    "ChunkWork",
    "Simulation",
    "Task",
    "inflight_counts",
    "replay_memory",
    "simulate_schedule",
    "fill_drain_bubble",
    "gpipe_closed_form",
    "fill_drain_lower_bound_s",
    "gpipe_exact",
    "idle_fraction",
    "simulate",
    "simulate_plan",
    "plan_chunk_works",
    "stage_program",
]

# Among tasks ready at the same time on a shared device: backward work first (it frees
# activation memory and unblocks the previous stage), forward last.
_PRIORITY = {"backward": 0, "recompute": 1, "send": 2, "forward": 3}


@dataclass
class Simulation:
    iteration_time_s: float
    bubble_fraction: float
    """Idle share of the physical devices over the iteration: 1 - busy / (devices x time)."""
    timeline: Timeline | None = None
    """The simulated tasks (devices are indices; stage s is on device s unless shared), or
    None when ``simulate`` was asked not to record them."""
    busy_s: list[float] = field(default_factory=list)
    """Busy seconds per physical device."""
    peak_bytes: list[float] = field(default_factory=list)
    """Each rank's replayed peak memory (:func:`simulate_schedule`; [] from :func:`simulate`)."""
    memory: list[list[tuple[float, float]]] = field(default_factory=list)
    """Each rank's memory over the iteration as ``(time_s, bytes)`` steps (the bytes hold
    from that time to the next step), when recorded."""

    @property
    def tasks(self) -> list[Task]:
        """The timeline's tasks ([] when none were recorded)."""
        return [] if self.timeline is None else self.timeline.tasks


def idle_fraction(busy_s: Sequence[float], devices: int, iteration_s: float) -> float:
    """The bubble: ``1 - sum(busy_s) / (devices x iteration_s)``, 0 for an empty iteration.
    Never below 0: busy seconds summed task by task can pass the iteration by an ulp (a
    one-stage plan came out at -2.2e-16, which a plan file refuses). O(len(busy_s))."""
    if iteration_s <= 0:
        return 0.0
    return max(1.0 - sum(busy_s) / (devices * iteration_s), 0.0)


def fill_drain_bubble(microbatches: int, num_stages: int) -> float:
    """GPipe's idle fraction with equal stages: (K-1)/(M+K-1) (the fill and the drain)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)


def stage_program(stage: int, num_stages: int, microbatches: int, schedule: str) -> list[Action]:
    """The ``forward``/``backward`` actions stage ``stage`` executes in one iteration, in order
    (one stage per device: GPipe or 1F1B; the orders are
    :func:`autopipe.core.schedules.rank_orders`').

    GPipe: all M forwards, then all M backwards (m = 0..M-1). 1F1B (PipeDream-flush):
    ``min(K - s - 1, M)`` warm-up forwards, then alternate one forward / one backward, then drain.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
    return rank_order(schedule, num_stages, 1, microbatches, stage)


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    microbatches: int,
    *,
    recompute_s: Sequence[float] | None = None,
    send_s: Sequence[float] | None = None,
    schedule: str = "gpipe",
    shared_device_groups: Sequence[Sequence[int]] | None = None,
    record_tasks: bool = True,
) -> Simulation:
    """Simulate one training iteration; all per-stage times are seconds per micro-batch.

    ``send_s[s]`` is the time to send stage s's output to stage s + 1 (ignored for the last
    stage). ``shared_device_groups`` lists groups of stage indices placed on one physical device.
    ``record_tasks=False`` skips building the timeline (the planner's search needs only the
    figures).
    """
    k = len(forward_s)
    if k == 0 or microbatches < 1:
        raise ValueError("simulate needs at least one stage and one micro-batch")
    rec = [0.0] * k if recompute_s is None else list(recompute_s)
    snd = [0.0] * k if send_s is None else list(send_s)
    snd[-1] = 0.0
    device_of = _stage_devices(k, shared_device_groups)
    programs = [
        _stage_tasks(s, forward_s, backward_s, rec, snd, microbatches, schedule) for s in range(k)
    ]
    scheduler = _ListScheduler(programs, device_of, snd, microbatches)
    end_time, tasks = scheduler.run(record_tasks)
    busy = scheduler.busy
    num_devices = len(busy)
    bubble = idle_fraction(busy, num_devices, end_time)
    timeline = Timeline(tasks, k, label="simulated", schedule=schedule) if record_tasks else None
    return Simulation(end_time, bubble, timeline, busy)


def _stage_devices(
    num_stages: int, shared_device_groups: Sequence[Sequence[int]] | None
) -> list[int]:
    """The physical device of each stage: one per group of ``shared_device_groups`` (in
    order), then one per stage in no group. ValueError for a stage out of range or in two
    groups."""
    if not shared_device_groups:
        return list(range(num_stages))
    device_of = [-1] * num_stages
    next_id = 0
    for group in shared_device_groups:
        for s in group:
            if not 0 <= s < num_stages or device_of[s] != -1:
                raise ValueError(f"stage {s} in shared_device_groups is out of range or repeated")
            device_of[s] = next_id
        next_id += 1
    for s in range(num_stages):
        if device_of[s] == -1:
            device_of[s], next_id = next_id, next_id + 1
    return device_of


def _stage_tasks(
    stage: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    recompute_s: Sequence[float],
    send_s: Sequence[float],
    microbatches: int,
    schedule: str,
) -> list[tuple[str, int, float]]:
    """Stage ``stage``'s program (:func:`stage_program`) as ``(phase, micro-batch, seconds)``
    tasks: a forward followed by its ``send`` when sending costs time, a backward preceded
    by its ``recompute`` when re-computing does."""
    k = len(forward_s)
    prog: list[tuple[str, int, float]] = []
    for action in stage_program(stage, k, microbatches, schedule):
        m = action.microbatch
        if action.phase == "forward":
            prog.append(("forward", m, float(forward_s[stage])))
            if stage < k - 1 and send_s[stage] > 0:
                prog.append(("send", m, float(send_s[stage])))
        else:
            if recompute_s[stage] > 0:
                prog.append(("recompute", m, float(recompute_s[stage])))
            prog.append(("backward", m, float(backward_s[stage])))
    return prog


class _ListScheduler:
    """Stages' task programs run one task at a time per stage and per physical device, each
    task as soon as its stage and device are free and its input is there; among tasks ready
    together on a shared device, the earliest start first, then ``_PRIORITY``, then the lower
    stage. Times are seconds. O(T log K) for T tasks on K stages."""

    def __init__(
        self,
        programs: list[list[tuple[str, int, float]]],
        device_of: list[int],
        send_s: Sequence[float],
        microbatches: int,
    ) -> None:
        k = len(programs)
        self.programs = programs
        self.device_of = device_of
        self.send_s = send_s
        # When each stage's inputs (activations, gradients) of each micro-batch are there.
        self.arrive_fwd: list[dict[int, float]] = [{} for _ in range(k)]
        self.arrive_grad: list[dict[int, float]] = [{} for _ in range(k)]
        self.arrive_fwd[0] = dict.fromkeys(range(microbatches), 0.0)
        self.ptr = [0] * k
        self.stage_free = [0.0] * k
        self.device_free = [0.0] * (max(device_of) + 1)
        self.busy = [0.0] * (max(device_of) + 1)
        """Busy seconds per physical device."""
        self.in_heap = [False] * k
        self.heap: list[tuple[float, int, int]] = []

    def ready_time(self, s: int) -> float | None:
        """When stage ``s``'s next task can start, or None (no task, or input not there)."""
        if self.ptr[s] >= len(self.programs[s]):
            return None
        phase, m, _ = self.programs[s][self.ptr[s]]
        if phase == "forward":
            dep = self.arrive_fwd[s].get(m)
        elif phase in ("recompute", "backward") and s < len(self.programs) - 1:
            dep = self.arrive_grad[s].get(m)
        else:
            dep = 0.0  # send follows its forward; last-stage backward follows its forward
        if dep is None:
            return None
        return max(dep, self.stage_free[s], self.device_free[self.device_of[s]])

    def push(self, s: int) -> None:
        """Queue stage ``s``'s next task if it is not queued and can start."""
        if self.in_heap[s]:
            return
        t = self.ready_time(s)
        if t is not None:
            prio = _PRIORITY[self.programs[s][self.ptr[s]][0]] * len(self.programs) + s
            heapq.heappush(self.heap, (t, prio, s))
            self.in_heap[s] = True

    def run(self, record: bool) -> tuple[float, list[Task]]:
        """Run every task; returns the end time and, with ``record``, the tasks run
        (device = physical device). RuntimeError if the programs deadlock."""
        k = len(self.programs)
        tasks: list[Task] = []
        for s in range(k):
            self.push(s)
        end_time = 0.0
        while self.heap:
            t, prio, s = heapq.heappop(self.heap)
            now = self.ready_time(s)
            if now is None:  # cannot happen: dependencies never un-finish
                self.in_heap[s] = False
                continue
            if now > t:  # the shared device got busier since this entry was pushed
                heapq.heappush(self.heap, (now, prio, s))
                continue
            self.in_heap[s] = False
            phase, m, dur = self.programs[s][self.ptr[s]]
            dev = self.device_of[s]
            end = now + dur
            self.stage_free[s] = end
            self.device_free[dev] = end
            self.busy[dev] += dur
            end_time = max(end_time, end)
            if record:
                tasks.append(Task(s, m, phase, now, end, dev))
            self.ptr[s] += 1
            # Queued entries only ever get later (lazy re-push above), so pushing the stages
            # whose inputs just arrived is enough.
            for other in [s, *self._deliver(s, phase, m, end)]:
                self.push(other)
        if any(self.ptr[s] < len(self.programs[s]) for s in range(k)):
            raise RuntimeError(
                "pipeline simulation deadlocked; the schedule's program is inconsistent"
            )
        return end_time, tasks

    def _deliver(self, s: int, phase: str, m: int, end: float) -> list[int]:
        """Stage ``s`` finished ``phase`` of micro-batch ``m`` at ``end``: what it produced
        (its output, after the send if it has one; its input gradient) arrives at the next or
        previous stage. Returns the stage it arrived at, if any."""
        k = len(self.programs)
        if phase == "send" or (phase == "forward" and (s == k - 1 or self.send_s[s] <= 0)):
            if s < k - 1:
                self.arrive_fwd[s + 1][m] = end
                return [s + 1]
        elif phase == "backward" and s > 0:
            self.arrive_grad[s - 1][m] = end
            return [s - 1]
        return []


def gpipe_closed_form(stage_times_s: Sequence[float], microbatches: int) -> float:
    """The textbook estimate ``sum(t_s) + (M - 1) max(t_s)`` (t_s = forward + backward per mb)."""
    return float(sum(stage_times_s)) + (microbatches - 1) * float(max(stage_times_s))


def gpipe_exact(
    forward_part_s: Sequence[float], backward_part_s: Sequence[float], microbatches: int
) -> float:
    """Exact fill-drain makespan on dedicated devices: two flow shops of M identical jobs.

    ``forward_part_s[s]`` = forward + send, ``backward_part_s[s]`` = recompute + backward:
    ``sum(fp) + (M-1) max(fp) + sum(bp) + (M-1) max(bp)``. Equals ``gpipe_closed_form`` when one
    stage is the bottleneck of both parts (e.g. backward proportional to forward).
    """
    m1 = microbatches - 1
    return (
        float(sum(forward_part_s))
        + m1 * float(max(forward_part_s))
        + float(sum(backward_part_s))
        + m1 * float(max(backward_part_s))
    )


def fill_drain_lower_bound_s(chunks: Sequence[ChunkWork], microbatches: int) -> float:
    """A proven lower bound on :func:`simulate_schedule`'s iteration time for GPipe or 1F1B
    with one chunk per rank (``chunks``: the K stages in order, seconds per micro-batch) on
    dedicated ranks; O(K).

    Stage ``s`` runs ``f_s`` (forward), ``x_s`` (its send, every stage but the last),
    ``r_s`` (recompute, when checkpointed) and ``b_s`` (backward) for each of the M
    micro-batches, one task at a time: it is busy ``M (f_s + x_s + r_s + b_s)``. Its first
    task is a forward, whose input crossed every earlier stage's forward and send first
    (chunk 0's inputs are there at 0): it starts no earlier than
    ``P_s = sum_{s' < s} (f_s' + x_s')``. Its last task is a backward (each micro-batch's
    backward follows its forward on the same rank), whose input gradient must then cross
    every earlier stage's recompute and backward: ``Q_s = sum_{s' < s} (r_s' + b_s')``
    more. So ``T >= max_s P_s + M (f_s + x_s + r_s + b_s) + Q_s``. Unlike the textbook
    ``(M - 1) t_max + sum_s t_s``, it charges nothing for the stages after the bottleneck
    (their fill and drain can hide behind its warm-up forwards: a bottleneck first stage
    followed by near-free stages runs in ``M t_0``). Rounded down by 1e-9 so a tight bound
    never exceeds the simulated float sum."""
    k = len(chunks)
    before = 0.0
    best = 0.0
    for s, w in enumerate(chunks):
        send = w.send_s if s < k - 1 and w.send_s > 0 else 0.0
        rec = w.recompute_s if w.checkpoint and w.recompute_s > 0 else 0.0
        busy = microbatches * (w.forward_s + send + rec + w.backward_s)
        best = max(best, before + busy)
        before += w.forward_s + send + rec + w.backward_s
    return best * (1.0 - 1e-9)


def simulate_plan(
    plan: Plan,
    *,
    shared_device_groups: Sequence[Sequence[int]] | None = None,
    record_tasks: bool = True,
) -> Simulation:
    """Simulate one iteration of a ``Plan`` with its per-stage costs, M and schedule.

    GPipe and 1F1B with one stage per rank use :func:`simulate` (which can also share
    devices); every other schedule, or V > 1, :func:`simulate_schedule` over
    :func:`plan_chunk_works`, which also replays memory. A plan made for ranks on one shared
    host (its request's ``Cluster.host_throughput``) is simulated so, with every schedule.
    O(T log K); O(T K) on a shared host.
    """
    host = plan.host_throughput
    if host is not None and host < plan.num_stages and not shared_device_groups:
        return simulate_schedule(
            plan_chunk_works(plan), plan.schedule, plan.num_stages, plan.microbatches,
            record_tasks=record_tasks, host_throughput=host, orders=plan.actions,
        )  # fmt: skip
    if plan.schedule in ("gpipe", "1f1b") and plan.virtual_stages == 1:
        sim = simulate(
            [s.forward_s for s in plan.stages],
            [s.backward_s for s in plan.stages],
            plan.microbatches,
            recompute_s=[s.recompute_s for s in plan.stages],
            send_s=[s.send_s for s in plan.stages],
            schedule=plan.schedule,
            shared_device_groups=shared_device_groups,
            record_tasks=record_tasks,
        )
        if shared_device_groups:
            return sim
        works = plan_chunk_works(plan)
        orders = plan.actions
        sim.peak_bytes = replay_memory(orders, works, list(range(plan.num_stages)))
        if record_tasks:
            sim.memory = simulate_schedule(
                works, plan.schedule, plan.num_stages, plan.microbatches, orders=orders
            ).memory
        return sim
    if shared_device_groups:
        raise ValueError(
            f"{plan.schedule} with {plan.virtual_stages} virtual stages is simulated on "
            "dedicated ranks only (shared_device_groups is for GPipe and 1F1B)"
        )
    return simulate_schedule(
        plan_chunk_works(plan), plan.schedule, plan.num_stages, plan.microbatches,
        record_tasks=record_tasks, orders=plan.actions,
    )  # fmt: skip


def plan_chunk_works(plan: Plan) -> list[ChunkWork]:
    """Each of the plan's chunks as the simulator's :class:`ChunkWork`. O(K V M).

    Bytes per micro-batch come from ``StagePlan.microbatch_activation_bytes`` /
    ``microbatch_input_bytes``; plans written before those were recorded estimate them from
    ``activation_bytes`` and the schedule's in-flight count (checkpointed stages: all of it
    charged as re-computed activations)."""
    held: list[int] | None = None
    works = []
    for c, s in enumerate(plan.stages):
        act, inp = float(s.microbatch_activation_bytes), float(s.microbatch_input_bytes)
        if act == 0 and inp == 0 and s.activation_bytes > 0:
            if held is None:
                held = inflight_counts(plan.actions, len(plan.stages))[0]
            act = s.activation_bytes / (1 if s.checkpoint else max(held[c], 1))
        split = s.backward_input_s + s.backward_weight_s > 0
        works.append(
            ChunkWork(
                forward_s=s.forward_s,
                backward_s=s.backward_s,
                backward_input_s=s.backward_input_s if split else s.backward_s,
                backward_weight_s=s.backward_weight_s if split else 0.0,
                recompute_s=s.recompute_s,
                send_s=s.send_s,
                activation_bytes=act,
                input_bytes=inp,
                checkpoint=s.checkpoint,
                state_bytes=float(s.parameter_bytes + s.optimizer_bytes),
            )
        )
    return works


# -- every schedule: a plan's chunks on dedicated ranks ------------------------------------


# One rank's simulated tasks: (phase, chunk, mb, seconds, waits-for key or -1, produces key
# or -1, seconds from the task's end until what it produces is there); a key indexes
# ``ready``, the time its value is there (-1.0: not yet).
_Program = list[tuple[str, int, int, float, int, int, float]]


@dataclass(frozen=True)
class ChunkWork:
    """One model chunk's work per micro-batch on its rank (seconds) and its bytes.

    ``backward_s`` is the whole backward; ``backward_input_s`` + ``backward_weight_s`` its
    split (used by the zero-bubble schedules' split actions). ``send_s``: the forward send of
    the chunk's output to the next chunk, charged to this rank when the next chunk runs on
    another one. ``activation_bytes``: what one micro-batch's forward saves for backward;
    ``input_bytes``: the chunk's input of one micro-batch, all a checkpointed chunk keeps
    until it re-computes. ``state_bytes``: parameters, gradients and optimizer state, held
    all the time.
    """

    forward_s: float
    backward_s: float
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    recompute_s: float = 0.0
    send_s: float = 0.0
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    checkpoint: bool = False
    state_bytes: float = 0.0

    @property
    def kept_bytes(self) -> float:
        """Held from the forward's start to the end of the backward (or weight gradient)."""
        return self.input_bytes if self.checkpoint else self.activation_bytes


# What each action allocates when it starts and frees when it ends, as a chunk's bytes:
# the forward keeps the chunk's saved activations (or, checkpointed, its input); a
# checkpointed backward re-computes the activations first; the whole backward frees all of
# it, and so does the weight gradient: torch's input-gradient pass keeps the autograd graph
# (retain_graph=True in stage_backward_input), so the activations the weight gradient reads
# are held until it has run.
def _allocates(work: ChunkWork, phase: str) -> float:
    if phase == "forward":
        return work.kept_bytes
    if phase in ("backward", "backward_input") and work.checkpoint:
        return work.activation_bytes
    return 0.0


def _frees(work: ChunkWork, phase: str) -> float:
    if phase in ("backward", "backward_weight"):
        return work.kept_bytes + (work.activation_bytes if work.checkpoint else 0.0)
    return 0.0


def replay_memory(
    orders: Sequence[Sequence[Action]], chunks: Sequence[ChunkWork], ranks: Sequence[int]
) -> list[float]:
    """Each rank's peak bytes over its actions in order: training state of its chunks, plus
    what each action allocates at its start, less what it frees at its end.

    A rank runs its actions one at a time, so the peak depends on the order alone, not on
    the durations: this is the peak :func:`simulate_schedule` replays over time. O(T).
    """
    peaks = []
    for r, order in enumerate(orders):
        now = sum(w.state_bytes for c, w in enumerate(chunks) if ranks[c] == r)
        peak = now
        for a in order:
            work = chunks[a.stage]
            now += _allocates(work, a.phase)
            peak = max(peak, now)
            now -= _frees(work, a.phase)
        peaks.append(peak)
    return peaks


def inflight_counts(
    orders: Sequence[Sequence[Action]], num_chunks: int
) -> tuple[list[int], list[int]]:
    """Per chunk, the most micro-batches at once that hold its activations (``held``: from
    the forward's start to the end of the whole backward or of the weight gradient) and
    that hold re-computed activations when it is checkpointed (``full``: from the backward's
    or input gradient's start to that end). From the order alone; O(T).

    GPipe: ``held = M``; 1F1B: ``K - s`` (at most M); ``full`` is 1 unless weight gradients
    wait (zero bubble).
    """
    held = [0] * num_chunks
    full = [0] * num_chunks
    now_held = [0] * num_chunks
    now_full = [0] * num_chunks
    for order in orders:
        for a in order:
            c = a.stage
            if a.phase == "forward":
                now_held[c] += 1
                held[c] = max(held[c], now_held[c])
            elif a.phase in ("backward", "backward_input"):
                now_full[c] += 1
                full[c] = max(full[c], now_full[c])
            if a.phase in ("backward", "backward_weight"):
                now_held[c] -= 1
                now_full[c] -= 1
    return held, full


def simulate_schedule(
    chunks: Sequence[ChunkWork],
    schedule: str,
    num_ranks: int,
    microbatches: int,
    *,
    orders: Sequence[Sequence[Action]] | None = None,
    record_tasks: bool = True,
    host_throughput: float | None = None,
    action_s: Mapping[Action, float] | None = None,
    arrival_delay_s: Mapping[Action, float] | None = None,
    rank_start_s: Sequence[float] | None = None,
) -> Simulation:
    """Simulate one iteration of ``schedule`` with ``chunks`` (``K x V`` of them, in model
    order, placed by :func:`autopipe.core.schedule_rules.chunk_ranks`) on ``num_ranks``
    ranks; M = ``microbatches``.

    ``orders`` (each rank's actions) default to
    :func:`autopipe.core.schedules.rank_orders`; pass them to reuse them across
    simulations. ``host_throughput`` (see :attr:`autopipe.core.cluster.Cluster.host_throughput`):
    the ranks share one host that runs at most this many ranks' work at full speed, so while
    ``n`` ranks compute at once each progresses at ``min(1, host_throughput / n)`` of its
    profiled speed (sends are link time and share nothing); None: dedicated ranks. Returns
    the iteration time, the bubble (idle share of the ranks), busy seconds and replayed peak
    bytes per rank, and with ``record_tasks`` the timeline (stage = chunk, device = rank) and
    each rank's memory over time. Raises RuntimeError if the orders deadlock (they never do
    for the schedules' own orders). O(T) on dedicated ranks, O(T K) on a shared host.

    Replaying a run (:mod:`autopipe.planner.replay`) gives each action its own seconds
    instead of its chunk's: ``action_s[a]`` (a forward, backward, backward_input or
    backward_weight action), ``arrival_delay_s[a]``: seconds from the end of ``a`` until
    what it produces (a forward's output, an input gradient) is there for the chunk that
    waits for it (may be negative: it then waits less than the whole task), and
    ``rank_start_s[r]``: when rank ``r`` may start its first action (default 0). Those
    two are for dedicated ranks only.
    """
    k = num_ranks
    n_chunks = len(chunks)
    if k < 1 or microbatches < 1 or n_chunks % k:
        raise ValueError(
            f"simulate_schedule needs ranks >= 1, micro-batches >= 1 and a multiple of "
            f"{k} chunks, got {n_chunks}"
        )
    v = n_chunks // k
    ranks = chunk_ranks(schedule, k, v)
    if orders is None:
        orders = rank_orders(schedule, k, v, microbatches)
    programs = [
        _rank_program(
            orders[r], r, chunks, ranks, microbatches, schedule, action_s, arrival_delay_s
        )
        for r in range(k)
    ]
    starts, ends, busy, end_time = _run_programs(
        programs, n_chunks, microbatches, host_throughput, arrival_delay_s, rank_start_s
    )
    bubble = idle_fraction(busy, k, end_time)
    peaks = replay_memory(orders, chunks, ranks)
    if not record_tasks:
        return Simulation(end_time, bubble, None, busy, peaks)
    timeline, memory = _recorded(programs, starts, ends, chunks, ranks, schedule)
    return Simulation(end_time, bubble, timeline, busy, peaks, memory)


def _recorded(
    programs: list[_Program],
    starts: list[list[float]],
    ends: list[list[float]] | None,
    chunks: Sequence[ChunkWork],
    ranks: list[int],
    schedule: str,
) -> tuple[Timeline, list[list[tuple[float, float]]]]:
    """The simulated run's timeline and each rank's memory over time (task ends derived
    from the starts where the run did not keep them)."""
    if ends is None:  # only when recorded: the search's many simulations skip it
        ends = [
            [t + task[3] for t, task in zip(st, prog, strict=True)]
            for st, prog in zip(starts, programs, strict=True)
        ]
    timeline = _timeline(programs, starts, ends, len(chunks), schedule)
    memory = [
        _memory_steps(programs[r], starts[r], ends[r], chunks, ranks, r)
        for r in range(len(programs))
    ]
    return timeline, memory


def _run_programs(
    programs: list[_Program],
    n_chunks: int,
    microbatches: int,
    host_throughput: float | None,
    arrival_delay_s: Mapping[Action, float] | None,
    rank_start_s: Sequence[float] | None,
) -> tuple[list[list[float]], list[list[float]] | None, list[float], float]:
    """Run the ranks' programs on dedicated ranks or on a shared host; per-rank task starts,
    task ends (None on dedicated ranks: the caller derives them when it records), busy
    seconds, and the iteration's end."""
    k = len(programs)
    # When each value a task waits for is there (-1.0: not yet); chunk 0's inputs are there
    # from the start.
    ready = [-1.0] * (2 * n_chunks * microbatches)
    ready[:microbatches] = [0.0] * microbatches
    if host_throughput is not None and host_throughput < k:
        if rank_start_s is not None or arrival_delay_s:
            # The shared host's event loop starts a task the moment its input is produced.
            raise ValueError(
                "rank_start_s and arrival_delay_s are for dedicated ranks (no host_throughput)"
            )
        starts, ends, busy = _run_shared_host(programs, ready, host_throughput)
        return starts, ends, busy, max((e[-1] for e in ends if e), default=0.0)
    starts, busy, free = _run_dedicated(programs, ready, rank_start_s)
    return starts, None, busy, max(free, default=0.0)


def _timeline(
    programs: list[_Program],
    starts: list[list[float]],
    ends: list[list[float]],
    num_chunks: int,
    schedule: str,
) -> Timeline:
    """The ranks' tasks (stage = chunk, device = rank) with their start and end seconds, in
    order of start, then rank."""
    tasks = [
        Task(c, mb, phase, start, end, r)
        for r, prog in enumerate(programs)
        for (phase, c, mb, *_), start, end in zip(prog, starts[r], ends[r], strict=True)
    ]
    tasks.sort(key=lambda t: (t.start_s, t.device))
    return Timeline(tasks, num_chunks, label="simulated", schedule=schedule)


def _rank_program(
    order: Sequence[Action],
    rank: int,
    chunks: Sequence[ChunkWork],
    ranks: Sequence[int],
    microbatches: int,
    schedule: str,
    action_s: Mapping[Action, float] | None,
    arrival_delay_s: Mapping[Action, float] | None,
) -> _Program:
    """Rank ``rank``'s actions in ``order`` as the tasks it runs (see :data:`_Program`): a
    forward followed by its ``send`` when the next chunk is on another rank and sending costs
    time, a checkpointed backward preceded by its ``recompute``. Seconds are the chunk's
    (``chunks``), or the action's own in ``action_s``; ``arrival_delay_s``: seconds from an
    action's end until what it produces is there. O(len(order))."""
    m = microbatches
    last = len(chunks) - 1
    grad0 = len(chunks) * m  # the gradient of (c, mb)'s output waits at grad0 + c * m + mb
    own = action_s or {}
    delays = arrival_delay_s or {}
    prog: _Program = []
    for a in order:
        c, mb, phase = a.stage, a.microbatch, a.phase
        w = chunks[c]
        late = delays.get(a, 0.0)
        if phase == "forward":
            f = own.get(a, w.forward_s)
            if c == last:  # the loss: the last chunk's backward may start after it
                prog.append(("forward", c, mb, f, c * m + mb, grad0 + c * m + mb, late))
            elif ranks[c + 1] != rank and w.send_s > 0:
                prog.append(("forward", c, mb, f, c * m + mb, -1, 0.0))
                prog.append(("send", c, mb, w.send_s, -1, (c + 1) * m + mb, late))
            else:
                prog.append(("forward", c, mb, f, c * m + mb, (c + 1) * m + mb, late))
        elif phase in ("backward", "backward_input"):
            seconds = own.get(a, _backward_s(w, c, phase, schedule))
            wait = grad0 + c * m + mb
            out = grad0 + (c - 1) * m + mb if c > 0 else -1
            if w.checkpoint and w.recompute_s > 0:
                prog.append(("recompute", c, mb, w.recompute_s, wait, -1, 0.0))
                wait = -1
            prog.append((phase, c, mb, seconds, wait, out, late))
        elif phase == "backward_weight":
            prog.append((phase, c, mb, own.get(a, w.backward_weight_s), -1, -1, 0.0))
        else:
            raise ValueError(f"unknown action phase {phase!r} in the order of rank {rank}")
    return prog


def _backward_s(work: ChunkWork, chunk: int, phase: str, schedule: str) -> float:
    """Seconds of chunk ``chunk``'s ``backward`` (the whole one) or ``backward_input`` (B of
    the split, which the zero-bubble schedules need: ValueError when the chunk has none)."""
    if phase == "backward":
        return work.backward_s
    if work.backward_input_s + work.backward_weight_s > 0 or work.backward_s <= 0:
        # (a chunk with no backward at all, e.g. only rotary embeddings, splits into nothing)
        return work.backward_input_s
    raise ValueError(
        f"chunk {chunk} has no backward_input_s/backward_weight_s split, which {schedule} needs"
    )


def _memory_steps(
    program: _Program,
    starts: Sequence[float],
    ends: Sequence[float],
    chunks: Sequence[ChunkWork],
    ranks: Sequence[int],
    rank: int,
) -> list[tuple[float, float]]:
    """Rank ``rank``'s memory over the iteration as ``(time_s, bytes)`` steps: its chunks'
    training state, plus what each task allocates at its start (``starts``, seconds), less
    what it frees at its end (``ends``). O(len(program))."""
    now = sum(w.state_bytes for c, w in enumerate(chunks) if ranks[c] == rank)
    steps = [(0.0, now)]
    for (phase, c, *_), start, end in zip(program, starts, ends, strict=True):
        work = chunks[c]
        # A checkpointed backward's re-computed activations appear when its recompute
        # task starts (the same bytes replay_memory charges to the backward's start).
        if phase == "recompute":
            alloc = work.activation_bytes
        elif phase != "forward" and work.checkpoint and work.recompute_s > 0:
            alloc = 0.0
        else:
            alloc = _allocates(work, phase)
        if alloc:
            now += alloc
            steps.append((start, now))
        freed = _frees(work, phase)
        if freed:
            now -= freed
            steps.append((end, now))
    return steps


def _run_dedicated(
    programs: list[_Program], ready: list[float], rank_start_s: Sequence[float] | None = None
) -> tuple[list[list[float]], list[float], list[float]]:
    """Each rank runs its program in order, each task as soon as the rank is free (rank
    ``r`` from ``rank_start_s[r]``, default 0) and its input is there; returns per-rank task
    starts, busy seconds and end time (a task ends its seconds after its start). O(T)."""
    k = len(programs)
    ptr = [0] * k
    free = [0.0] * k if rank_start_s is None else [float(t) for t in rank_start_s]
    busy = [0.0] * k
    starts: list[list[float]] = [[0.0] * len(p) for p in programs]
    waiting: dict[int, int] = {}
    todo = list(range(k))
    while todo:
        r = todo.pop()
        prog = programs[r]
        i = ptr[r]
        t_free = free[r]
        while i < len(prog):
            _, _, _, seconds, wait, out, late = prog[i]
            t = t_free
            if wait >= 0:
                got = ready[wait]
                if got < 0:
                    waiting[wait] = r
                    break
                if got > t:
                    t = got
            starts[r][i] = t
            t_free = t + seconds
            busy[r] += seconds
            if out >= 0:
                ready[out] = max(t_free + late, 0.0)
                other = waiting.pop(out, None)
                if other is not None:
                    todo.append(other)
            i += 1
        ptr[r] = i
        free[r] = t_free
    if any(ptr[r] < len(programs[r]) for r in range(k)):
        raise RuntimeError("pipeline simulation deadlocked; the schedule's order is inconsistent")
    return starts, busy, free


def _run_shared_host(
    programs: list[_Program], ready: list[float], host_throughput: float
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """As :func:`_run_dedicated`, with the ranks' compute sharing one host (processor
    sharing): while ``n`` ranks compute, each task's remaining seconds shrink at
    ``min(1, host_throughput / n)`` per second; a ``send`` runs at full speed.

    An event loop over task starts and ends: O(T K).
    """
    if not host_throughput > 0:
        raise ValueError(f"host_throughput must be > 0, got {host_throughput}")
    k = len(programs)
    ptr = [0] * k
    left = [0.0] * k  # the running task's remaining seconds at full speed
    running = [False] * k
    busy = [0.0] * k
    starts: list[list[float]] = [[0.0] * len(p) for p in programs]
    ends: list[list[float]] = [[0.0] * len(p) for p in programs]
    now = 0.0
    while True:
        for r in range(k):  # start every task whose rank is free and whose input is there
            if running[r] or ptr[r] >= len(programs[r]):
                continue
            wait = programs[r][ptr[r]][4]
            if wait < 0 or ready[wait] >= 0:
                running[r] = True
                left[r] = programs[r][ptr[r]][3]
                starts[r][ptr[r]] = now
        active = [r for r in range(k) if running[r]]
        if not active:
            break
        computing = sum(programs[r][ptr[r]][0] != "send" for r in active)
        share = min(1.0, host_throughput / computing) if computing else 1.0
        rate = [1.0] * k
        for r in active:
            if programs[r][ptr[r]][0] != "send":
                rate[r] = share
        step = min(left[r] / rate[r] for r in active)
        now += step
        for r in active:
            left[r] -= step * rate[r]
            busy[r] += step
        for r in active:
            # A relative tolerance: rates are not exact binary fractions.
            if left[r] <= 1e-12 * max(1.0, now):
                i = ptr[r]
                ends[r][i] = now
                out = programs[r][i][5]
                if out >= 0:
                    ready[out] = now
                running[r] = False
                ptr[r] += 1
    if any(ptr[r] < len(programs[r]) for r in range(k)):
        raise RuntimeError("pipeline simulation deadlocked; the schedule's order is inconsistent")
    return starts, ends, busy
