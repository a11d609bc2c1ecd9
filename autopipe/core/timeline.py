"""One pipeline timeline for every layer: which work ran on which device, and when.

Torch-free. The schedule simulator (``autopipe.planner.simulate``) returns a :class:`Timeline`,
the runtime's recorder (``autopipe.runtime.recorder``) produces one from a run, the plots
(``autopipe.viz``) draw one, and Chrome traces are written (:func:`to_chrome_trace`) and read
(:func:`load_chrome_trace`) here and nowhere else.

As in torch.distributed.pipelining, where one ``_Action`` (stage, computation type,
micro-batch) drives schedule generation, execution, simulation and tracing, one small
vocabulary names the work everywhere:

- an :class:`Action` is *what* runs: micro-batch ``microbatch`` of pipeline stage ``stage``
  in phase ``phase`` (a schedule's per-stage program is a list of actions);
- a :class:`Task` is an action that ran, or is simulated to run, on physical device
  ``device`` from ``start_s`` to ``end_s``.

``stage`` is the pipeline stage, i.e. the model chunk: with V virtual stages per rank
(interleaved 1F1B) several stages share one ``device``. ``phase`` is one of :data:`PHASES`;
zero-bubble schedules split ``backward`` into ``backward_input`` and ``backward_weight``.
Times are seconds on one clock from an origin of the producer's choosing (the start of the
iteration for the simulator, the recorder's creation for a run); only differences matter.

The Chrome trace format (one writer, one dialect) opens in Perfetto and chrome://tracing: one
process per device (named after it), one thread per stage, one complete event per task named
like torch's actions (``"F3"``: forward of micro-batch 3; ``"loss"`` for work of the whole
batch), with ``stage``, ``microbatch`` and ``phase`` in ``args``; a :class:`Mark` (a whole
step, the optimizer step: a device's time that is no stage's task) is a complete event on
thread -1 with ``args: {"mark": name}``. The reader reads this one dialect.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from autopipe.core.errors import UsageError

__all__ = [
    "PHASES",
    "PHASE_LETTERS",
    "Action",
    "Mark",
    "Task",
    "Timeline",
    "TimelineFormatError",
    "load_chrome_trace",
    "save_chrome_trace",
    "task_name",
    "to_chrome_trace",
]

PHASES = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "recompute",
    "send",
    "loss",
)
"""Every phase a task can have. ``backward`` is a stage's whole backward; zero-bubble
schedules split it into ``backward_input`` (the gradient of the stage's inputs, which the
previous stage waits for) and ``backward_weight`` (the parameter gradients, which can fill
bubbles). ``recompute`` is the re-materialising forward of a checkpointed stage (in a run it
nests inside its backward's interval). ``send`` is the transfer of a stage's output cut.
``loss`` is the loss forward or backward; micro-batch -1 when it runs once on the gathered
batch, outside the stages."""

PHASE_LETTERS = {
    "forward": "F",
    "backward": "B",
    "backward_input": "I",
    "backward_weight": "W",
    "recompute": "R",
    "send": "S",
    "loss": "L",
}
"""Short names of the phases in trace event names; F, B, I and W are torch.distributed.pipelining's
(``_ComputationType``: full backward, backward input, backward weight)."""

_PHASE_SET = frozenset(PHASES)


class TimelineFormatError(UsageError, ValueError):
    """A timeline (a Chrome trace, or its tasks) cannot be read."""


class Action(NamedTuple):
    """What runs: ``phase`` of micro-batch ``microbatch`` on pipeline stage ``stage``.

    The untimed part of a :class:`Task`, like torch.distributed.pipelining's ``_Action``.
    """

    stage: int
    microbatch: int
    phase: str

    def __str__(self) -> str:
        """``"2F3"``: stage 2, forward, micro-batch 3 (torch's action notation)."""
        return f"{self.stage}{task_name(self.phase, self.microbatch)}"


@dataclass(frozen=True)
class Task:
    """One piece of work that ran (or is simulated to run) on one device.

    ``stage``: the pipeline stage (model chunk) index. ``microbatch``: its index, -1 for
    work on the whole batch (the loss). ``phase``: one of :data:`PHASES`. ``start_s`` and
    ``end_s``: seconds on the timeline's clock. ``device``: the physical device index (the
    rank in a multi-process run); its name is ``Timeline.device_name(device)``.
    """

    stage: int
    microbatch: int
    phase: str
    start_s: float
    end_s: float
    device: int

    def __post_init__(self) -> None:
        # A typo in a phase would otherwise draw (or simulate) as nothing at all.
        if self.phase not in _PHASE_SET:
            raise ValueError(f"unknown task phase {self.phase!r}; use one of {', '.join(PHASES)}")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def action(self) -> Action:
        return Action(self.stage, self.microbatch, self.phase)


@dataclass(frozen=True)
class Mark:
    """A span of one device's time that is no stage's task: ``name`` is what it was
    (``"step"``: one training step, from the call to its return; ``"optimizer"``: the
    optimizer step after it), ``device`` the device index (the rank), ``start_s`` / ``end_s``
    seconds on the timeline's clock. Marks are not counted as busy time."""

    name: str
    device: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """The tasks of one training iteration of a pipeline of ``num_stages`` stages.

    ``num_stages`` may exceed the highest stage seen (a stage that did nothing still has a
    row). ``label`` says what it is (``"predicted"``, ``"measured"``), ``schedule`` which
    schedule ran (``"gpipe"``, ``"1f1b"``). ``device_names[d]`` names device index ``d``
    (``"cuda:0"``, ``"cpu"``); missing names read as ``"device d"``. Stages whose tasks ran on
    one device share its idle time. Queries are O(n) or O(n log n) in the tasks.
    """

    tasks: list[Task]
    num_stages: int
    label: str = ""
    schedule: str = ""
    device_names: list[str] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    """Spans that are no stage's work (:class:`Mark`: each step, the optimizer), by start."""

    def __post_init__(self) -> None:
        stages = {t.stage for t in self.tasks}
        if stages and (min(stages) < 0 or max(stages) >= self.num_stages):
            raise ValueError(
                f"tasks of stages {min(stages)}..{max(stages)} do not fit a "
                f"{self.num_stages}-stage timeline"
            )

    def device_name(self, device: int) -> str:
        """The name of device index ``device``."""
        if 0 <= device < len(self.device_names) and self.device_names[device]:
            return self.device_names[device]
        return f"device {device}"

    def stage_devices(self) -> list[int | None]:
        """The device each stage ran on (its first task's), None for a stage without tasks."""
        out: list[int | None] = [None] * self.num_stages
        for t in self.tasks:
            if out[t.stage] is None:
                out[t.stage] = t.device
        return out

    def device_groups(self) -> list[list[int]]:
        """Stages grouped by the device they ran on, in order of first stage; a stage without
        tasks is a group of its own."""
        groups: dict[Any, list[int]] = {}
        for s, device in enumerate(self.stage_devices()):
            groups.setdefault(("stage", s) if device is None else device, []).append(s)
        return list(groups.values())

    @property
    def shared(self) -> bool:
        """True if some device runs more than one stage."""
        return any(len(g) > 1 for g in self.device_groups())

    @property
    def start_s(self) -> float:
        return min((t.start_s for t in self.tasks), default=0.0)

    @property
    def end_s(self) -> float:
        return max((t.end_s for t in self.tasks), default=0.0)

    @property
    def iteration_s(self) -> float:
        """Seconds from the first task's start to the last task's end (0 when empty)."""
        return self.end_s - self.start_s

    @property
    def num_microbatches(self) -> int:
        return 1 + max((t.microbatch for t in self.tasks), default=-1)

    def of(self, phase: str) -> list[Task]:
        """The tasks of one phase, in timeline order."""
        return [t for t in self.tasks if t.phase == phase]

    def durations(self, stage: int, phase: str) -> list[float]:
        """Durations (s) of every ``phase`` task on ``stage``, in micro-batch order."""
        tasks = sorted(
            (t for t in self.tasks if t.stage == stage and t.phase == phase),
            key=lambda t: t.microbatch,
        )
        return [t.duration_s for t in tasks]

    def busy_s(self, stage: int) -> float:
        """Seconds stage ``stage`` spends on its tasks; overlaps (a recompute nested in its
        backward) count once."""
        return _union_length(sorted((t.start_s, t.end_s) for t in self.tasks if t.stage == stage))

    def device_busy_s(self, stages: Iterable[int]) -> float:
        """Seconds a device running ``stages`` is busy (overlaps counted once)."""
        group = set(stages)
        return _union_length(sorted((t.start_s, t.end_s) for t in self.tasks if t.stage in group))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the devices x iteration-time rectangle: 1 - busy / (D * T).

        With one device per stage (D = K) this is the idle share of the stage rows of a Gantt
        chart; stages sharing a device count their device's idle time once.
        """
        groups = self.device_groups()
        area = len(groups) * self.iteration_s
        if area <= 0:
            return 0.0
        # busy seconds summed piece by piece can pass the area by an ulp: never below 0
        return max(1.0 - sum(self.device_busy_s(g) for g in groups) / area, 0.0)

    def shifted(self) -> Timeline:
        """A copy with the first task starting at 0 s."""
        t0 = self.start_s
        tasks = [replace(t, start_s=t.start_s - t0, end_s=t.end_s - t0) for t in self.tasks]
        marks = [replace(k, start_s=k.start_s - t0, end_s=k.end_s - t0) for k in self.marks]
        return replace(self, tasks=tasks, device_names=list(self.device_names), marks=marks)

    def marked(self, name: str, device: int | None = None) -> list[Mark]:
        """The marks called ``name`` (on ``device``, or every device), by start."""
        return sorted(
            (k for k in self.marks if k.name == name and device in (None, k.device)),
            key=lambda k: (k.start_s, k.device),
        )

    def to_chrome_trace(self) -> dict[str, Any]:
        return to_chrome_trace(self)

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        save_chrome_trace(self, path)


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Length covered by sorted ``(start, end)`` intervals, overlaps counted once."""
    total = 0.0
    cur: tuple[float, float] | None = None
    for start, end in spans:
        if cur is None or start > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (start, end)
        else:
            cur = (cur[0], max(cur[1], end))
    if cur is not None:
        total += cur[1] - cur[0]
    return total


def task_name(phase: str, microbatch: int) -> str:
    """A task's trace event name: ``"F3"``, ``"I0"``; the phase itself for micro-batch -1."""
    return phase if microbatch < 0 else f"{PHASE_LETTERS[phase]}{microbatch}"


# -- the writer -----------------------------------------------------------------------------


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace JSON object (Perfetto, chrome://tracing).

    One process per device (``pid`` = device index, named after the device), one thread per
    stage (``tid`` = stage), one complete event (``ph: "X"``) per task with ``ts``/``dur`` in
    microseconds; ``otherData`` keeps the label, schedule and stage count. O(n).
    """
    stage_devices = timeline.stage_devices()
    # A stage without tasks still gets its row, under a process of its own past the devices.
    spare = 1 + max((t.device for t in timeline.tasks), default=-1)
    pid_of = []
    for device in stage_devices:
        if device is None:
            device, spare = spare, spare + 1
        pid_of.append(device)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": timeline.device_name(pid)}}
        for pid in sorted(set(pid_of) | {t.device for t in timeline.tasks})
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": s, "args": {"name": f"stage {s}"}}
        for s, pid in enumerate(pid_of)
    ]
    for t in timeline.tasks:
        events.append(
            {
                "name": task_name(t.phase, t.microbatch),
                "cat": t.phase,
                "ph": "X",
                "pid": t.device,
                "tid": t.stage,
                "ts": t.start_s * 1e6,
                "dur": max(t.duration_s, 0.0) * 1e6,
                "args": {"stage": t.stage, "microbatch": t.microbatch, "phase": t.phase},
            }
        )
    for k in timeline.marks:
        # On a row of their own per device (tid -1), named after what they time.
        events.append(
            {
                "name": k.name,
                "cat": "mark",
                "ph": "X",
                "pid": k.device,
                "tid": -1,
                "ts": k.start_s * 1e6,
                "dur": max(k.duration_s, 0.0) * 1e6,
                "args": {"mark": k.name},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "label": timeline.label,
            "schedule": timeline.schedule,
            "num_stages": timeline.num_stages,
        },
    }


def save_chrome_trace(timeline: Timeline, path: str | os.PathLike[str]) -> None:
    """Write ``timeline`` as a Chrome trace JSON file."""
    Path(path).write_text(json.dumps(to_chrome_trace(timeline)))


# -- the reader -----------------------------------------------------------------------------


def load_chrome_trace(
    trace: str | os.PathLike[str] | Mapping[str, Any] | list[Any],
    *,
    num_stages: int | None = None,
    label: str | None = None,
) -> Timeline:
    """A Timeline from a Chrome trace: a file, ``{"traceEvents": [...]}`` or an event list.

    The dialect :func:`to_chrome_trace` writes: complete events (``ph: "X"``) whose ``args``
    give ``stage``, ``microbatch`` and ``phase`` (one of :data:`PHASES`) are tasks, those
    whose ``args`` give ``mark`` are marks. The device is the event's process (``pid``; each
    stage its own device when there is none), named by the trace's ``process_name``
    metadata. Other events are ignored. Times are kept as written
    (microseconds -> seconds). ``num_stages`` is a lower bound on the stage count; ``label``
    defaults to the one the trace carries. Raises TimelineFormatError. O(n log n).
    """
    events, other = _trace_events(trace)
    names, found, marks_found = _scan_events(events)
    if not found:
        raise TimelineFormatError(
            "Chrome trace has no pipeline tasks (complete events with a stage, micro-batch "
            "and phase in args)"
        )
    # Dense device indices: the trace's processes in pid order (our own traces round-trip),
    # then one device for each stage whose events carry no pid.
    keys = sorted({key for *_, key in found} | {m[3] for m in marks_found}, key=_device_order)
    index = {key: i for i, key in enumerate(keys)}
    tasks = [Task(s, mb, phase, start, end, index[key]) for s, mb, phase, start, end, key in found]
    tasks.sort(key=lambda t: (t.start_s, t.stage, t.microbatch))
    k = max(t.stage for t in tasks) + 1
    stated = other.get("num_stages")
    for bound in (num_stages, stated if isinstance(stated, int) else None):
        if bound is not None:
            k = max(k, bound)
    device_names = [names.get(key, "") if not isinstance(key, tuple) else "" for key in keys]
    marks = sorted(
        (Mark(name, index[key], start, end) for name, start, end, key in marks_found),
        key=lambda m: (m.start_s, m.device),
    )
    return Timeline(
        tasks,
        k,
        label=str(other.get("label", "") or "") if label is None else label,
        schedule=str(other.get("schedule", "") or ""),
        device_names=device_names if any(device_names) else [],
        marks=marks,
    )


def _trace_events(
    trace: str | os.PathLike[str] | Mapping[str, Any] | list[Any],
) -> tuple[list[Any], Mapping[str, Any]]:
    """The trace's event list and its ``otherData`` (empty if none), read from the file
    where ``trace`` is a path; TimelineFormatError if it is not JSON or not a trace."""
    if isinstance(trace, (str, os.PathLike)):
        try:
            trace = json.loads(Path(trace).read_text())
        except json.JSONDecodeError as exc:
            raise TimelineFormatError(
                f"{trace}: not valid JSON ({exc.msg} at line {exc.lineno})"
            ) from exc
        except UnicodeDecodeError:
            raise TimelineFormatError(f"{trace}: not a JSON text file") from None
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    if not isinstance(events, list):
        raise TimelineFormatError(
            'not a Chrome trace: expected {"traceEvents": [...]} or a list of events'
        )
    other = trace.get("otherData") if isinstance(trace, Mapping) else None
    return events, other if isinstance(other, Mapping) else {}


def _scan_events(
    events: list[Any],
) -> tuple[
    dict[Any, str],
    list[tuple[int, int, str, float, float, Any]],
    list[tuple[str, float, float, Any]],
]:
    """The process names (by pid), the task events and the mark events of ``events``, in
    their order; other events are skipped."""
    names: dict[Any, str] = {}
    found: list[tuple[int, int, str, float, float, Any]] = []
    marks_found: list[tuple[str, float, float, Any]] = []
    for ev in events:
        if not isinstance(ev, Mapping):
            continue
        ph = ev.get("ph")
        if ph == "M":
            if ev.get("name") == "process_name" and isinstance(ev.get("args"), Mapping):
                names[ev.get("pid")] = str(ev["args"].get("name", ""))
            continue
        if ph != "X":
            continue
        mark = _event_mark(ev)
        if mark is not None:
            marks_found.append(mark)
            continue
        task = _event_task(ev)
        if task is not None:
            found.append(task)
    return names, found, marks_found


def _event_mark(ev: Mapping[str, Any]) -> tuple[str, float, float, Any] | None:
    """``(name, start_s, end_s, device key)`` of a mark event (``args.mark``), or None."""
    args = ev.get("args")
    if not isinstance(args, Mapping) or "mark" not in args:
        return None
    try:
        start_us, dur_us = float(ev["ts"]), float(ev.get("dur", 0.0))
    except (TypeError, ValueError, KeyError):
        return None
    pid = ev.get("pid")
    return (
        str(args["mark"]),
        start_us * 1e-6,
        (start_us + dur_us) * 1e-6,
        pid if pid is not None else 0,
    )


def _device_order(key: Any) -> tuple[int, float, str]:
    """Numeric pids in order, then other pids by text, then the stages without a pid."""
    if isinstance(key, tuple):
        return (2, key[1], "")
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return (0, key, "")
    return (1, 0, str(key))


def _event_task(ev: Mapping[str, Any]) -> tuple[int, int, str, float, float, Any] | None:
    """``(stage, microbatch, phase, start_s, end_s, device key)`` of one event, or None."""
    args = ev.get("args")
    if not isinstance(args, Mapping):
        return None
    phase = args.get("phase")
    if not isinstance(phase, str) or phase not in _PHASE_SET:
        return None
    try:
        start_us, dur_us = float(ev["ts"]), float(ev.get("dur", 0.0))
        stage, mb = int(args["stage"]), int(args["microbatch"])
    except (TypeError, ValueError, KeyError):
        return None
    if stage < 0:
        return None
    # One trace process per device (every autopipe trace's convention).
    pid = ev.get("pid")
    key = ("stage", stage) if pid is None else pid
    return stage, mb, phase, start_us * 1e-6, (start_us + dur_us) * 1e-6, key
