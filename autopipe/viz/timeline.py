"""Pipeline timelines as plain data: who ran what, when.

A :class:`Timeline` is a list of :class:`Task` (stage, micro-batch, phase, start, end in
seconds). It comes from the planner's schedule simulator (predicted) or from the executor
(measured: ``pipeline.last_timeline`` or the Chrome trace JSON it exports); the adapters here
accept both so the plots never care where a timeline came from. Torch-free.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("forward", "recompute", "backward", "send", "loss")
"""Phases a task can have; ``send`` is the transfer of a stage's output cut; ``loss`` is the
loss forward or backward when the executor runs it outside the stages (micro-batch -1)."""

_PHASE_ALIASES = {
    "f": "forward",
    "fwd": "forward",
    "forward": "forward",
    "b": "backward",
    "bwd": "backward",
    "backward": "backward",
    "r": "recompute",
    "recompute": "recompute",
    "remat": "recompute",
    "s": "send",
    "send": "send",
    "comm": "send",
    "copy": "send",
    "loss": "loss",
}


class TimelineFormatError(ValueError):
    """A timeline (records or Chrome trace) cannot be read."""


@dataclass(frozen=True)
class Task:
    """One piece of work on one stage: ``phase`` of micro-batch ``microbatch``.

    Times are seconds from the start of the iteration.
    """

    stage: int
    microbatch: int
    phase: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """The tasks of one training iteration of a K-stage pipeline.

    ``num_stages`` may exceed the highest stage seen (a stage that did nothing still has a
    row). ``label`` says where it came from, e.g. ``"predicted"`` or ``"measured"``.
    ``devices[s]`` is the physical device stage ``s`` ran on (any hashable: an index or a
    name such as ``"cpu"``); stages that share one device share its idle time. ``None`` means
    one device per stage.
    """

    tasks: list[Task]
    num_stages: int
    label: str = ""
    schedule: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    devices: list[Any] | None = None

    def device_groups(self) -> list[list[int]]:
        """Stages grouped by physical device, in order of first stage."""
        if self.devices is None:
            return [[s] for s in range(self.num_stages)]
        groups: dict[Any, list[int]] = {}
        for s in range(self.num_stages):
            groups.setdefault(
                self.devices[s] if s < len(self.devices) else ("stage", s), []
            ).append(s)
        return list(groups.values())

    @property
    def shared(self) -> bool:
        """True if some physical device runs more than one stage."""
        return any(len(g) > 1 for g in self.device_groups())

    @property
    def start_s(self) -> float:
        return min((t.start_s for t in self.tasks), default=0.0)

    @property
    def end_s(self) -> float:
        return max((t.end_s for t in self.tasks), default=0.0)

    @property
    def iteration_s(self) -> float:
        """First task's start to last task's end, seconds."""
        return self.end_s - self.start_s

    @property
    def num_microbatches(self) -> int:
        return 1 + max((t.microbatch for t in self.tasks), default=-1)

    def busy_s(self, stage: int) -> float:
        """Seconds stage ``stage`` spends on its tasks (overlaps within a stage counted once).

        O(n log n) in the stage's task count.
        """
        spans = sorted((t.start_s, t.end_s) for t in self.tasks if t.stage == stage)
        return _union_length(spans)

    def device_busy_s(self, stages: list[int]) -> float:
        """Seconds a physical device running ``stages`` is busy (overlaps counted once)."""
        group = set(stages)
        return _union_length(sorted((t.start_s, t.end_s) for t in self.tasks if t.stage in group))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the devices x iteration-time rectangle: 1 - busy / (D * T).

        With one device per stage (D = K) this is the idle share of the stage rows drawn in
        the Gantt chart; stages sharing a device count their device's idle time once.
        """
        groups = self.device_groups()
        area = len(groups) * self.iteration_s
        if area <= 0:
            return 0.0
        return 1.0 - sum(self.device_busy_s(g) for g in groups) / area

    def shifted(self) -> Timeline:
        """The same timeline with the first task starting at 0 s."""
        t0 = self.start_s
        tasks = [
            Task(t.stage, t.microbatch, t.phase, t.start_s - t0, t.end_s - t0) for t in self.tasks
        ]
        return Timeline(
            tasks, self.num_stages, self.label, self.schedule, dict(self.meta), self.devices
        )

    def durations(self, stage: int, phase: str) -> list[float]:
        """Durations (s) of every ``phase`` task on ``stage``, in micro-batch order."""
        tasks = sorted(
            (t for t in self.tasks if t.stage == stage and t.phase == phase),
            key=lambda t: t.microbatch,
        )
        return [t.duration_s for t in tasks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "tasks": [
                {
                    "stage": t.stage,
                    "microbatch": t.microbatch,
                    "phase": t.phase,
                    "start_s": t.start_s,
                    "end_s": t.end_s,
                }
                for t in self.tasks
            ],
        }


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Length covered by sorted ``(start, end)`` intervals, overlaps counted once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def normalize_phase(name: str) -> str:
    """``"F"``, ``"fwd"``, ``"forward"`` -> ``"forward"``; raises on an unknown phase."""
    key = str(name).strip().lower()
    if key not in _PHASE_ALIASES:
        raise TimelineFormatError(
            f"unknown task phase {name!r}; expected one of {', '.join(PHASES)}"
        )
    return _PHASE_ALIASES[key]


def _field(rec: Any, *names: str) -> Any:
    for name in names:
        if isinstance(rec, Mapping):
            if name in rec:
                return rec[name]
        elif hasattr(rec, name):
            return getattr(rec, name)
    return None


def timeline_from_records(
    records: Iterable[Any],
    num_stages: int | None = None,
    label: str = "",
    schedule: str = "",
    time_scale: float = 1.0,
) -> Timeline:
    """A Timeline from task records: dicts, dataclasses or objects with attributes.

    Each record needs a stage (``stage``), a micro-batch (``microbatch``/``micro_batch``/
    ``mb``/``chunk``), a phase (``phase``/``kind``/``op``) and start/end times
    (``start_s``/``end_s``, ``start``/``end``, or ``start``/``duration``), in seconds times
    ``time_scale``. The result starts at 0 s. O(n).
    """
    tasks: list[Task] = []
    device_of: dict[int, Any] = {}
    for rec in records:
        stage = _field(rec, "stage", "stage_index", "partition")
        mb = _field(rec, "microbatch", "micro_batch", "microbatch_index", "mb", "chunk")
        phase = _field(rec, "phase", "kind", "op", "type")
        start = _field(rec, "start_s", "start", "begin_s", "begin")
        end = _field(rec, "end_s", "end", "stop_s", "stop")
        if end is None:
            duration = _field(rec, "duration_s", "duration", "dur")
            end = None if duration is None or start is None else float(start) + float(duration)
        if None in (stage, mb, phase, start, end):
            raise TimelineFormatError(
                f"timeline record {rec!r} lacks a stage, micro-batch, phase, start or end"
            )
        device = _field(rec, "device")
        if device is not None:
            device_of.setdefault(int(stage), device)
        tasks.append(
            Task(
                int(stage),
                int(mb),
                normalize_phase(phase),
                float(start) * time_scale,
                float(end) * time_scale,
            )
        )
    if not tasks:
        raise TimelineFormatError("timeline has no tasks")
    k = max(t.stage for t in tasks) + 1
    if num_stages is not None:
        k = max(k, num_stages)
    devices = None
    if device_of:
        devices = [device_of.get(s, ("stage", s)) for s in range(k)]
    return Timeline(tasks, k, label, schedule, devices=devices).shifted()


_NAME_RE = re.compile(
    r"(?i)(?:stage\s*)?(?P<stage>\d+)?\D*?(?P<phase>forward|backward|recompute|send|fwd|bwd|remat|[fbrs])"
    r"\s*(?:mb|micro-?batch|chunk)?\s*(?P<mb>\d+)"
)


def timeline_from_chrome_trace(
    trace: str | os.PathLike[str] | Mapping[str, Any] | list[Any],
    num_stages: int | None = None,
    label: str = "measured",
) -> Timeline:
    """A Timeline from a Chrome trace (``{"traceEvents": [...]}`` or a bare event list).

    Complete events (``ph == "X"``, ``ts``/``dur`` in microseconds) are tasks; their stage,
    micro-batch and phase come from ``args`` (``stage``, ``microbatch``, ``phase``) when
    present, otherwise from the event name (``"F3"``, ``"backward mb 2"``) and ``tid`` as
    the stage. Begin/end pairs (``B``/``E``) are paired per thread. Other events are ignored.
    """
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
    schedule = ""
    other = trace.get("otherData") if isinstance(trace, Mapping) else None
    if isinstance(other, Mapping):
        schedule = str(other.get("schedule", "") or "")
    records: list[dict[str, Any]] = []
    open_events: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for ev in events:
        if not isinstance(ev, Mapping):
            continue
        ph = ev.get("ph")
        if ph == "B":
            open_events.setdefault((ev.get("pid"), ev.get("tid")), []).append(dict(ev))
            continue
        if ph == "E":
            stack = open_events.get((ev.get("pid"), ev.get("tid")))
            if not stack:
                continue
            begin = stack.pop()
            try:
                begin["dur"] = float(ev["ts"]) - float(begin["ts"])
            except (KeyError, TypeError, ValueError):
                continue  # a malformed pair is no task, like any other unreadable event
            ev = begin
        elif ph != "X":
            continue
        rec = _chrome_event_record(ev)
        if rec is not None:
            records.append(rec)
    if not records:
        raise TimelineFormatError(
            "Chrome trace has no pipeline tasks (complete events with a stage, micro-batch "
            "and phase in args or name)"
        )
    return timeline_from_records(
        records, num_stages=num_stages, label=label, schedule=schedule, time_scale=1e-6
    )


def _chrome_event_record(ev: Mapping[str, Any]) -> dict[str, Any] | None:
    args = ev.get("args") or {}
    stage = _field(args, "stage", "stage_index", "partition")
    mb = _field(args, "microbatch", "micro_batch", "mb", "chunk")
    phase = _field(args, "phase", "kind", "op")
    if phase is None or mb is None or stage is None:
        match = _NAME_RE.search(str(ev.get("name", "")))
        if match is None:
            return None
        phase = phase if phase is not None else match.group("phase")
        mb = mb if mb is not None else match.group("mb")
        if stage is None:
            stage = match.group("stage") if match.group("stage") is not None else ev.get("tid")
    try:
        phase = normalize_phase(phase)
        rec = {
            "stage": int(stage),
            "microbatch": int(mb),
            "phase": phase,
            "start": float(ev["ts"]),
            "duration": float(ev.get("dur", 0.0)),
        }
    except (TimelineFormatError, TypeError, ValueError, KeyError):
        return None
    # One trace process per physical device (the executor's and our own export's convention).
    device = _field(args, "device")
    if device is None and ev.get("pid") is not None:
        device = ("pid", ev.get("pid"))
    if device is not None:
        rec["device"] = device
    return rec


def timeline_to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace (open it in Perfetto or chrome://tracing).

    One process per physical device, one thread row per stage; times in microseconds.
    """
    pid_of = {s: i for i, group in enumerate(timeline.device_groups()) for s in group}
    events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid_of[s],
            "tid": s,
            "args": {"name": f"stage {s}"},
        }
        for s in range(timeline.num_stages)
    ]
    for t in timeline.tasks:
        events.append(
            {
                "ph": "X",
                "name": t.phase if t.microbatch < 0 else f"{t.phase} {t.microbatch}",
                "cat": t.phase,
                "pid": pid_of[t.stage],
                "tid": t.stage,
                "ts": t.start_s * 1e6,
                "dur": t.duration_s * 1e6,
                "args": {"stage": t.stage, "microbatch": t.microbatch, "phase": t.phase},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"label": timeline.label, "schedule": timeline.schedule},
    }


def as_timeline(obj: Any, num_stages: int | None = None, label: str = "") -> Timeline:
    """Coerce a Timeline, a Chrome trace (path or dict) or task records into a Timeline."""
    if isinstance(obj, Timeline):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return timeline_from_chrome_trace(obj, num_stages=num_stages, label=label or "measured")
    if isinstance(obj, Mapping) and "traceEvents" in obj:
        return timeline_from_chrome_trace(obj, num_stages=num_stages, label=label or "measured")
    if isinstance(obj, Mapping) and "tasks" in obj:
        return timeline_from_records(
            obj["tasks"],
            num_stages=num_stages or obj.get("num_stages"),
            label=label or str(obj.get("label", "")),
            schedule=str(obj.get("schedule", "")),
        )
    # The executor's Timeline (``.records``) or the planner's Simulation (``.tasks``).
    tasks = getattr(obj, "records", None)
    if tasks is None:
        tasks = getattr(obj, "tasks", None)
    if tasks is not None and not isinstance(obj, Mapping):
        return timeline_from_records(
            tasks,
            num_stages=num_stages or getattr(obj, "num_stages", None),
            label=label,
            schedule=str(getattr(obj, "schedule", "") or ""),
        )
    return timeline_from_records(obj, num_stages=num_stages, label=label)
