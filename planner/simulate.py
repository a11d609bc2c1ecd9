"""A small discrete-event simulator of pipeline schedules (GPipe fill-drain and 1F1B).

Torch-free. Each stage runs a fixed program of tasks, one at a time, per micro-batch m:
``forward`` -> ``send`` (the output cut, blocking the sender, before the next stage may start
m) ... later ``recompute`` (checkpointed stages) -> ``backward``. Cross-stage dependencies:
forward(s, m) waits for send(s-1, m) (or forward(s-1, m) when there is no send time);
recompute(s, m) and backward(s, m) wait for backward(s+1, m) (the gradient of the stage output).
Stages listed together in ``shared_device_groups`` share one physical device: at most one of
their tasks runs at a time, chosen by a list scheduler (earliest possible start first, then
backward work before forward work, then lower stage).

Cost: O(T log K) for T = K x M x (2 to 4) tasks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopipe.planner.plan_data import Plan
from autopipe.planner.timeline import PHASES, Action, Task, Timeline

__all__ = [
    "PHASES",
    "Simulation",
    "Task",
    "fill_drain_bubble",
    "gpipe_closed_form",
    "gpipe_exact",
    "simulate",
    "simulate_plan",
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

    @property
    def tasks(self) -> list[Task]:
        """The timeline's tasks ([] when none were recorded)."""
        return [] if self.timeline is None else self.timeline.tasks


def fill_drain_bubble(microbatches: int, num_stages: int) -> float:
    """GPipe's idle fraction with equal stages: (K-1)/(M+K-1) (the fill and the drain)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)


def stage_program(stage: int, num_stages: int, microbatches: int, schedule: str) -> list[Action]:
    """The ``forward``/``backward`` actions stage ``stage`` executes in one iteration, in order.

    GPipe: all M forwards, then all M backwards (m = 0..M-1). 1F1B (PipeDream-flush):
    ``min(K - s - 1, M)`` warm-up forwards, then alternate one forward / one backward, then drain.
    """

    def fwd(m: int) -> Action:
        return Action(stage, m, "forward")

    def bwd(m: int) -> Action:
        return Action(stage, m, "backward")

    m_all = range(microbatches)
    if schedule == "gpipe":
        return [fwd(m) for m in m_all] + [bwd(m) for m in m_all]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
    warm = min(num_stages - stage - 1, microbatches)
    prog = [fwd(m) for m in range(warm)]
    for i in range(microbatches - warm):
        prog += [fwd(warm + i), bwd(i)]
    prog += [bwd(m) for m in range(microbatches - warm, microbatches)]
    return prog


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
    device_of = list(range(k))
    if shared_device_groups:
        device_of = [-1] * k
        next_id = 0
        for group in shared_device_groups:
            for s in group:
                if not 0 <= s < k or device_of[s] != -1:
                    raise ValueError(
                        f"stage {s} in shared_device_groups is out of range or repeated"
                    )
                device_of[s] = next_id
            next_id += 1
        for s in range(k):
            if device_of[s] == -1:
                device_of[s], next_id = next_id, next_id + 1
    num_devices = max(device_of) + 1

    # Expand each stage's program into concrete (phase, m, seconds) tasks.
    programs: list[list[tuple[str, int, float]]] = []
    for s in range(k):
        prog: list[tuple[str, int, float]] = []
        for action in stage_program(s, k, microbatches, schedule):
            m = action.microbatch
            if action.phase == "forward":
                prog.append(("forward", m, float(forward_s[s])))
                if s < k - 1 and snd[s] > 0:
                    prog.append(("send", m, float(snd[s])))
            else:
                if rec[s] > 0:
                    prog.append(("recompute", m, float(rec[s])))
                prog.append(("backward", m, float(backward_s[s])))
        programs.append(prog)

    # Time at which each stage's inputs become available, filled in as tasks finish.
    arrive_fwd: list[dict[int, float]] = [dict() for _ in range(k)]
    arrive_grad: list[dict[int, float]] = [dict() for _ in range(k)]
    for m in range(microbatches):
        arrive_fwd[0][m] = 0.0
    ptr = [0] * k
    stage_free = [0.0] * k
    device_free = [0.0] * num_devices
    busy = [0.0] * num_devices
    tasks: list[Task] = []
    in_heap = [False] * k
    heap: list[tuple[float, int, int]] = []

    def ready_time(s: int) -> float | None:
        if ptr[s] >= len(programs[s]):
            return None
        phase, m, _ = programs[s][ptr[s]]
        if phase == "forward":
            dep = arrive_fwd[s].get(m)
        elif phase in ("recompute", "backward") and s < k - 1:
            dep = arrive_grad[s].get(m)
        else:
            dep = 0.0  # send follows its forward; last-stage backward follows its forward
        if dep is None:
            return None
        return max(dep, stage_free[s], device_free[device_of[s]])

    def push(s: int) -> None:
        if in_heap[s]:
            return
        t = ready_time(s)
        if t is not None:
            heapq.heappush(heap, (t, _PRIORITY[programs[s][ptr[s]][0]] * k + s, s))
            in_heap[s] = True

    for s in range(k):
        push(s)
    end_time = 0.0
    while heap:
        t, prio, s = heapq.heappop(heap)
        now = ready_time(s)
        if now is None:  # cannot happen: dependencies never un-finish
            in_heap[s] = False
            continue
        if now > t:  # the shared device got busier since this entry was pushed
            heapq.heappush(heap, (now, prio, s))
            continue
        in_heap[s] = False
        phase, m, dur = programs[s][ptr[s]]
        dev = device_of[s]
        end = now + dur
        stage_free[s] = end
        device_free[dev] = end
        busy[dev] += dur
        end_time = max(end_time, end)
        if record_tasks:
            tasks.append(Task(s, m, phase, now, end, dev))
        ptr[s] += 1
        touched = [s]
        if phase == "send" or (phase == "forward" and (s == k - 1 or snd[s] <= 0)):
            if s < k - 1:
                arrive_fwd[s + 1][m] = end
                touched.append(s + 1)
        elif phase == "backward" and s > 0:
            arrive_grad[s - 1][m] = end
            touched.append(s - 1)
        # Queued entries only ever get later (lazy re-push above), so pushing the stages
        # whose inputs just arrived is enough.
        for other in touched:
            push(other)
    if any(ptr[s] < len(programs[s]) for s in range(k)):
        raise RuntimeError("pipeline simulation deadlocked; the schedule's program is inconsistent")
    bubble = 1.0 - sum(busy) / (num_devices * end_time) if end_time > 0 else 0.0
    timeline = Timeline(tasks, k, label="simulated", schedule=schedule) if record_tasks else None
    return Simulation(end_time, bubble, timeline, busy)


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


def simulate_plan(
    plan: Plan,
    *,
    shared_device_groups: Sequence[Sequence[int]] | None = None,
    record_tasks: bool = True,
) -> Simulation:
    """Simulate one iteration of a ``Plan`` with its per-stage costs, M and schedule."""
    return simulate(
        [s.forward_s for s in plan.stages],
        [s.backward_s for s in plan.stages],
        plan.microbatches,
        recompute_s=[s.recompute_s for s in plan.stages],
        send_s=[s.send_s for s in plan.stages],
        schedule=plan.schedule,
        shared_device_groups=shared_device_groups,
        record_tasks=record_tasks,
    )
