"""The Plan: how to cut a model into pipeline stages and run it, as plain data.

Torch-free. Times are seconds, sizes bytes. A :class:`Plan` holds what every rank executes
and agrees on (:data:`INSTRUCTION_FIELDS`; per stage :data:`STAGE_INSTRUCTION_FIELDS`); its
``report`` (:class:`PlanReport`) and each stage's ``report`` (:class:`StageReport`) what the
planner predicted and weighed. ``Plan.save`` writes versioned JSON (version 4) whose keys are
a stable interface (scripts read them)::

    {"version": 4, "num_stages": ..., "microbatches": ..., "microbatch_size": ...,
     "batch_size": ..., "schedule": ..., "data_parallel": ..., <the other Plan fields>,
     "trainer": {"compile": false, "precision": "bf16", ...},
     "actions": ["0F0 0F1 0B0 ...", "1F0 1B0 ..."], "stages": [{"index": 0, "units": ...}],
     "report": {"iteration_time_s": ..., "bubble_fraction": ..., "throughput": ..., ...,
                "stages": [{"forward_s": ..., "backward_s": ..., "memory_bytes": ...}]}}

Earlier files still load: version 1 (every field at the top level: its report fields go to
the report), version 2 (the report under ``"report"``, each stage's predicted figures beside
its instructions, the data-parallel degree D as ``"replicas"`` and the report's K x D rows as
``"data_parallel"``), version 3 (the trainer options only in the report's ``request``: they
load from it into ``trainer``, the defaults without one). A file written before ``actions``
(each rank's order) was recorded gets its schedule's order on load.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

from autopipe.core.datafile import atomic_write_json, check_version, known_fields, load_json_file
from autopipe.core.errors import UsageError
from autopipe.core.fields import FieldError, check_dataclass, check_number
from autopipe.core.humanize import format_seconds
from autopipe.core.optimizer import AUTO, OPTIMIZERS, normalize_optimizer
from autopipe.core.plan_records import CandidateRow, DataParallelRow, MeshReport
from autopipe.core.plan_report import PlanReport, StageReport
from autopipe.core.plantext import format_plan
from autopipe.core.profile import Profile, ProfileFormatError
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import check_virtual_stages
from autopipe.core.schedules import rank_orders
from autopipe.core.timeline import PHASE_LETTERS, Action
from autopipe.core.trainer_options import TrainerOptions
from autopipe.core.vocabulary import CHECKPOINT_GRANULARITIES, PLAN_SCHEDULES, SHARD_MODES

PLAN_VERSION = 4
READABLE_PLAN_VERSIONS = (1, 2, 3, 4)
"""Version 1: every field at the top level; version 2: the report under ``"report"``;
version 3: each stage's predicted figures under ``report.stages``, ``replicas`` named
``data_parallel`` (an older reader would have read the missing ``replicas`` as 1); version
4: the trainer options an instruction field, ``trainer`` (:class:`TrainerOptions`; an older
reader would have taken them from the report's ``request`` only, which a plan edited since
may no longer match)."""
__all__ = [
    "CUSTOM_OPTIMIZER",
    "INSTRUCTION_FIELDS",
    "PLAN_VERSION",
    "STAGE_INSTRUCTION_FIELDS",
    "Plan",
    "PlanFormatError",
    "StagePlan",
    "load_plan",
    "replace_plan",
]


INSTRUCTION_FIELDS = (
    "model", "granularity", "schedule", "num_stages", "virtual_stages", "microbatches",
    "microbatch_size", "batch_size", "data_parallel", "tensor_parallel", "context_parallel",
    "expert_parallel", "shard", "tp_plan", "trainer", "optimizer", "actions", "stages",
    "version",
)  # fmt: skip
"""The :class:`Plan` fields every rank acts on and agrees on (ARCHITECTURE.md "The plan"):
what the runtime, training, the rank agreement and emit may read, and all the ranks compare
at start (``plan_fingerprint``). Everything else is the planner's report
(:class:`PlanReport`: predictions, candidates, baselines, notes, the profile):
tests/test_layers.py checks that those readers read no other."""
STAGE_INSTRUCTION_FIELDS = (
    "index", "rank", "units", "unit_parameters", "checkpoint", "checkpoint_granularity",
    "split_backward",
)  # fmt: skip
"""The :class:`StagePlan` fields the ranks act on and agree on (``plan_fingerprint``). The
others are for people: ``device`` (the planned device's name; each rank runs on its own),
``first_module`` / ``last_module`` (the ends of ``units``); the chunk's predicted figures are
its ``report`` (:class:`StageReport`)."""

T = TypeVar("T")


class _Reported(Generic[T]):
    """A report field read and set through what it reports on: a :class:`PlanReport` field
    through its :class:`Plan` (``plan.iteration_time_s`` is ``plan.report.iteration_time_s``),
    a :class:`StageReport` field through its :class:`StagePlan` (``stage.forward_s`` is
    ``stage.report.forward_s``): the attribute paths scripts and the reports used before the
    plan was split (#37)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, holder: None, owner: type | None = None) -> _Reported[T]: ...
    @overload
    def __get__(self, holder: Plan | StagePlan, owner: type | None = None) -> T: ...
    def __get__(
        self, holder: Plan | StagePlan | None, owner: type | None = None
    ) -> T | _Reported[T]:
        if holder is None:
            return self
        return cast(T, getattr(holder.report, self.name))

    def __set__(self, holder: Plan | StagePlan, value: T) -> None:
        setattr(holder.report, self.name, value)


def _legacy_request(meta: dict[str, Any]) -> PlanRequest:
    """The request of a plan written before ``Plan.request`` was recorded: the planner's
    keywords it kept in ``meta["options"]``, its re-materialization mode, headroom and the
    training state it charged."""
    values = dict(meta.pop("options") or {})
    if "checkpoint_mode" in meta:
        values.setdefault("checkpoint", meta.pop("checkpoint_mode"))
    if "headroom" in meta:
        values.setdefault("headroom", meta.pop("headroom"))
    return _load_request(values)


def _load_request(values: dict[str, Any]) -> PlanRequest:
    """``PlanRequest.from_dict``; a field it refuses is a FieldError naming
    ``request.<field>`` and its value, as the file holds it."""
    try:
        return PlanRequest.from_dict(values)
    except ValueError as exc:
        name = getattr(exc, "field", "")
        if name not in values:
            raise
        raise FieldError(f"request.{name}", f"is {values[name]!r}; {exc}") from None


class PlanFormatError(UsageError, ValueError):
    """A plan file is not a valid autopipe plan."""


CUSTOM_OPTIMIZER = "custom"
"""``Plan.optimizer`` for a plan priced with an explicit ``bytes_per_parameter``."""


@dataclass
class StagePlan:
    """One pipeline stage: a contiguous run of units placed on one device.

    Its fields are what the ranks run (:data:`STAGE_INSTRUCTION_FIELDS`) and where it was
    planned (``device``, ``first_module``, ``last_module``); what the planner predicted for
    it (seconds per micro-batch, bytes) is its ``report`` (:class:`StageReport`), read and set
    as before through the stage too: ``stage.forward_s`` is ``stage.report.forward_s``.
    """

    index: int
    device: str
    units: list[str]
    first_module: str = ""
    last_module: str = ""
    checkpoint: bool = False
    checkpoint_granularity: str = "stage"
    """When ``checkpoint``: ``"stage"`` (keep the stage's input, re-compute the whole stage
    in its backward) or ``"unit"`` (keep each unit's input, re-compute one unit at a time:
    torchtitan's ``mode = "full"``); :data:`CHECKPOINT_GRANULARITIES`. Plans written before
    it was recorded mean ``"stage"``."""
    rank: int = -1
    """The pipeline rank that runs this stage (model chunk); ``-1`` in plans written before
    stages were placed: the stage's own index (one stage per rank)."""
    unit_parameters: list[int] = field(default_factory=list)
    """Parameter elements of each of ``units``, in order, as the profile counted them (a tied
    parameter counts in every unit using it): what the runtimes check the model against
    before building a stage, so a plan made for another model is refused. Empty in plans
    written before it was recorded (then the runtimes compare the report's
    ``parameter_bytes``, the one predicted figure they read, for those files only)."""
    split_backward: bool | None = None
    """Under a zero-bubble schedule (``SPLIT_BACKWARD_SCHEDULES``): whether the chunk runs its
    backward as B then W (torch's split weight pass), decided by the planner
    (``planner/chunks.py:splits_backward``: not when re-materialized or a parameter is used
    more than once in it) and run so by the distributed runtime; the first chunk is torch's
    own (True). None under the other schedules and in plans written before it was recorded
    (then the runtime decides from the chunk itself); not written to the file when None."""
    report: StageReport = field(default_factory=StageReport)
    """What the planner predicted for this stage (:class:`StageReport`); saved as
    ``report.stages[index]``. Never part of what the ranks act on or agree on."""

    # The report's fields, read and set through the stage as before the split (#37). The
    # runtime, training, the rank agreement and the emitters do not use them
    # (tests/test_layers.py), but for ``parameter_bytes`` of plans without unit_parameters.
    forward_s = _Reported[float]()
    backward_s = _Reported[float]()
    recompute_s = _Reported[float]()
    send_s = _Reported[float]()
    memory_bytes = _Reported[int]()
    parameter_bytes = _Reported[int]()
    optimizer_bytes = _Reported[int]()
    activation_bytes = _Reported[int]()
    reason = _Reported[str]()
    backward_input_s = _Reported[float]()
    backward_weight_s = _Reported[float]()
    microbatch_activation_bytes = _Reported[int]()
    microbatch_input_bytes = _Reported[int]()

    @property
    def time_s(self) -> float:
        """Busy seconds per micro-batch: forward + backward + recompute + send."""
        return self.report.time_s


@dataclass(repr=False)
class Plan:
    """A complete pipeline configuration and its predicted performance.

    ``repr(plan)`` is one line (stages, units per stage, schedule, M, predicted step);
    ``print(plan)`` and ``plan.summary()`` print the table ``autopipe plan`` prints; every
    field is in ``plan.to_dict()``.
    """

    num_stages: int
    microbatches: int
    microbatch_size: int
    batch_size: int
    stages: list[StagePlan]
    schedule: str = "gpipe"
    data_parallel: int = 1
    """D: data-parallel copies of the pipeline (``num_stages x data_parallel`` devices in
    all; ``replicas`` in files of versions 1 and 2); ``batch_size`` is per replica, and
    ``iteration_time_s`` includes the gradient all-reduce."""
    model: str = ""
    optimizer: str = ""
    """The training state charged per parameter: ``sgd``, ``sgd-momentum``, ``adam``,
    ``mixed-adam`` ... or ``custom`` (an explicit ``bytes_per_parameter``); ``""`` in plans
    written before it was recorded (schema v1 either way)."""
    virtual_stages: int = 1
    """V, model chunks per rank: ``stages`` lists ``num_stages x virtual_stages`` chunks in
    model order, each with the ``rank`` that runs it (loop or V-shape placement)."""
    granularity: str = "block"
    """How the profile grouped the model into units (``block``, ``module``, ``node``): the
    runtime traces the model into the same units."""
    tensor_parallel: int = 1
    """T: every stage's modules are split over T devices by ``tp_plan`` (Megatron-style, with
    sequence parallelism); 1 in plans written before the mesh was planned."""
    context_parallel: int = 1
    """C: each sample's sequence is split over C devices (torch's ``context_parallel``); the
    plan runs on ``num_stages x data_parallel x context_parallel x tensor_parallel`` devices; 1 in
    plans written before it."""
    expert_parallel: int = 1
    """E: each MoE layer's routed experts are spread over E of the devices (no more
    devices); 1 in plans written before it."""
    shard: str = "none"
    """How the training state is sharded over the ``data_parallel`` replicas (one of ``SHARD_MODES``);
    ``none`` in plans written before the mesh was planned."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """The tensor-parallel plan the stages are split by: module path pattern (fnmatch, as
    Hugging Face's ``base_model_tp_plan``, e.g. ``layers.*.self_attn.q_proj``) to style
    (``colwise``, ``rowwise``, ...); empty when ``tensor_parallel`` is 1."""
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    """The trainer options the plan was priced for (:class:`TrainerOptions`: compiled
    stages, FP8, selective re-computation, the TP and data-parallel communication options),
    which the ranks and the emitted configs act on; copied from the request by the planner.
    Files before version 4 get them from their report's ``request`` (the defaults without
    one)."""
    actions: list[list[Action]] = field(default_factory=list, init=False)
    """What each pipeline rank executes, in order: ``actions[r]`` is rank ``r``'s
    ``Action(chunk, micro-batch, phase)`` list, the one timeline the one-process executor
    runs and the distributed build checks torch's schedule against. It is the schedule's
    own order for this plan's ``(schedule, num_stages, virtual_stages, microbatches)``
    (:func:`autopipe.core.schedules.rank_orders`), derived by the plan itself: when it is
    made (not an ``__init__`` argument, so ``dataclasses.replace`` never carries an old
    order over) and again when one of those four is set; empty while they are not values
    the schedule can run. The distributed runtime runs torch's schedule classes, which
    generate their own order, so an order other than the schedule's could not be run as
    written: a file whose actions differ is refused (:meth:`validate`) rather than run.
    Written as one string per rank in torch's ``_Action`` notation (``"0F0 0F1 0B0 ..."``;
    ``I``/``W``: the zero-bubble input/weight backward); a file written before it was
    recorded gets the schedule's order on load."""
    version: int = PLAN_VERSION
    report: PlanReport = field(default_factory=PlanReport)
    """What the planner predicted and weighed (:class:`PlanReport`); saved under
    ``"report"``. Never part of what the ranks act on or agree on."""

    # The report's fields, read and set through the plan as before the split (#37):
    # ``plan.iteration_time_s`` is ``plan.report.iteration_time_s``. The runtime, training,
    # the rank agreement and the emitters do not use them (tests/test_layers.py).
    iteration_time_s = _Reported[float]()
    bubble_fraction = _Reported[float]()
    throughput = _Reported[float]()
    speedup = _Reported[float]()
    bottleneck_stage = _Reported[int]()
    strategy = _Reported[str]()
    memory_per_device = _Reported[int | None]()
    optimality_gap = _Reported[float]()
    profile_mode = _Reported[str]()
    baselines = _Reported[dict[str, dict[str, Any]]]()
    notes = _Reported[list[str]]()
    state_bytes_per_parameter = _Reported[float]()
    lower_bound_s = _Reported[float]()
    lower_bound_gap = _Reported[float]()
    method = _Reported[str]()
    rank_peak_bytes = _Reported[list[int]]()
    request = _Reported[PlanRequest | None]()
    partition_algorithm = _Reported[str]()
    bottleneck_s = _Reported[float]()
    min_bottleneck_s = _Reported[float]()
    single_device_time_s = _Reported[float]()
    parameter_size_bytes = _Reported[int]()
    pipeline_iteration_s = _Reported[float]()
    allreduce_s = _Reported[float]()
    candidates = _Reported[list[CandidateRow]]()
    data_parallel_rows = _Reported[list[DataParallelRow]]()
    mesh = _Reported[MeshReport | None]()
    profile = _Reported[Profile | None]()
    plot_data = _Reported[dict[str, Any]]()
    meta = _Reported[dict[str, Any]]()

    def __post_init__(self) -> None:
        self.actions = _schedule_actions(self) or []
        meta = self.report.meta
        if "granularity" in meta and self.granularity == "block":  # an earlier writer's meta
            self.granularity = meta.pop("granularity")
        if self.report.request is None and "options" in meta:
            self.report.request = _legacy_request(meta)

    def __setattr__(self, name: str, value: Any) -> None:
        # The actions are the schedule's order for these four figures: changing one after
        # the plan was made (``plan.microbatches = 8``) must not leave the ranks the old
        # order to run. "actions" is not yet set while __init__ assigns the fields; the
        # checks re-assign a field its own value (64.0 as 64), which changes nothing.
        changed = (
            name in _ORDER_FIELDS and "actions" in self.__dict__ and self.__dict__[name] != value
        )
        super().__setattr__(name, value)
        if changed:
            super().__setattr__("actions", _schedule_actions(self) or [])

    def __repr__(self) -> str:
        # The dataclass repr spelled out every stage's unit names, the request, the notes
        # and the profile kept in meta: ~20 KB for an 8-stage GPT.
        where = f"{self.num_stages} stages" + (
            f" x V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        )
        mesh = (f", data_parallel={self.data_parallel}" if self.data_parallel > 1 else "") + (
            f", tensor_parallel={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        )
        return (
            f"<Plan {self.model or 'model'}: {where}, units {'/'.join(map(str, self.balance))}"
            f"{mesh}, {self.schedule}, M={self.microbatches} x {self.microbatch_size}, "
            f"iteration {format_seconds(self.iteration_time_s)}, "
            f"bubble {100 * self.bubble_fraction:.1f}%>"
        )

    def __str__(self) -> str:
        return self.summary_text()

    def summary_text(self) -> str:
        """The table ``autopipe plan`` prints (stages, then the pipeline-level figures, the
        frameworks' default splits and the notes), as one string."""
        return format_plan(self)

    def summary(self) -> None:
        """Print the table ``autopipe plan`` prints (:meth:`summary_text` returns it)."""
        print(self.summary_text())

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """The device mesh ``(pp, dp, tp)`` (``MESH_DIM_NAMES``): ``num_stages`` x
        ``data_parallel`` x ``tensor_parallel`` devices in all."""
        return (self.num_stages, self.data_parallel, self.tensor_parallel)

    @property
    def world_size(self) -> int:
        """Devices the plan runs on: the product of :attr:`mesh_shape`."""
        return self.num_stages * self.data_parallel * self.tensor_parallel * self.context_parallel

    @property
    def host_throughput(self) -> float | None:
        """The request's ``Cluster.host_throughput`` (ranks sharing one host), None when the
        ranks are dedicated or the plan predates the request."""
        cluster = self.request.cluster if self.request is not None else None
        return cluster.host_throughput if cluster is not None else None

    @property
    def boundaries(self) -> list[int]:
        """Index of the first unit of each stage, counted over the whole unit list."""
        starts, pos = [], 0
        for stage in self.stages:
            starts.append(pos)
            pos += len(stage.units)
        return starts

    @property
    def balance(self) -> list[int]:
        """Units per stage, torchgpipe's ``balance``."""
        return [len(s.units) for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        """The version-4 JSON object: the instructions (:meth:`instructions`) and the
        report under ``"report"``, each stage's (:class:`StageReport`) as ``report.stages``."""
        data = self.instructions()
        report = dataclasses.asdict(self.report)
        report["request"] = self.request.to_dict() if self.request is not None else None
        report["profile"] = self.profile.to_dict() if self.profile is not None else None
        report["stages"] = [dataclasses.asdict(stage.report) for stage in self.stages]
        data["report"] = report
        return data

    def instructions(self) -> dict[str, Any]:
        """What the ranks execute and agree on, as JSON: the :data:`INSTRUCTION_FIELDS`
        (``version`` first), every stage in full. No report field."""
        data: dict[str, Any] = {"version": self.version}
        for f in dataclasses.fields(self):
            if f.name == "trainer":
                data["trainer"] = self.trainer.to_dict()
            elif f.name not in ("version", "report", "stages", "actions"):
                data[f.name] = copy.deepcopy(getattr(self, f.name))
        # torch's _Action notation, one string per rank: "0F0 0F1 0B0 ..." (the last field).
        data["actions"] = [" ".join(map(str, order)) for order in self.actions]
        data["stages"] = []
        for stage in self.stages:
            fields = {f.name: getattr(stage, f.name) for f in dataclasses.fields(stage)}
            del fields["report"]
            if fields["split_backward"] is None:  # only zero-bubble plans record it
                del fields["split_backward"]
            data["stages"].append(copy.deepcopy(fields))
        return data

    def validate(self) -> None:
        """Raise :class:`PlanFormatError` naming the first field that cannot be right: a
        negative, NaN or infinite time or size, fewer than one stage, micro-batch or sample,
        M x micro-batch size != batch size, a stage count or unit list that does not add up,
        ``actions`` other than the schedule's order (the rank and first differing action)."""
        try:
            self._check_fields()
            self._check_stages()
            self._check_actions()
        except FieldError as exc:
            raise PlanFormatError(str(exc)) from exc

    def _check_fields(self) -> None:
        """FieldError for the first plan-wide field out of range or inconsistent."""
        one = (1, math.inf)
        check_dataclass(
            self,
            bounds={
                "num_stages": one,
                "microbatches": one,
                "microbatch_size": one,
                "batch_size": one,
                "data_parallel": one,
                "tensor_parallel": one,
                "context_parallel": one,
                "expert_parallel": one,
            },
        )
        check_dataclass(self.report, bounds={"memory_per_device": one, "bubble_fraction": (0, 1)})
        if self.request is not None:
            _check_request(self.request)
        if not isinstance(self.trainer, TrainerOptions):
            raise FieldError("trainer", f"is {self.trainer!r}; expected TrainerOptions")
        self.trainer.check()
        known = ("", CUSTOM_OPTIMIZER, *OPTIMIZERS)  # "": written before it was recorded
        if self.optimizer not in known:
            raise FieldError(
                "optimizer",
                f"is {self.optimizer!r}; expected one of {', '.join(known[1:])} (or absent)",
            )
        if self.schedule not in PLAN_SCHEDULES:
            raise FieldError(
                "schedule", f"is {self.schedule!r}; expected one of {', '.join(PLAN_SCHEDULES)}"
            )
        if self.microbatches * self.microbatch_size != self.batch_size:
            raise FieldError(
                "batch_size",
                f"is {self.batch_size} but microbatches x microbatch_size is "
                f"{self.microbatches} x {self.microbatch_size}",
            )
        if self.shard not in SHARD_MODES:
            raise FieldError(
                "shard", f"is {self.shard!r}; expected one of {', '.join(SHARD_MODES)}"
            )
        if self.tensor_parallel > 1 and not self.tp_plan:
            raise FieldError("tp_plan", f"is empty but tensor_parallel is {self.tensor_parallel}")
        if self.virtual_stages < 1:
            raise FieldError("virtual_stages", f"is {self.virtual_stages}; expected >= 1")

    def _check_stages(self) -> None:
        """FieldError for the first stage that is wrong, or stages that do not add up: V per
        rank, each unit on one stage. Places stages written before placement (rank -1)."""
        chunks = self.num_stages * self.virtual_stages
        if len(self.stages) != chunks:
            raise FieldError(
                "stages",
                f"lists {len(self.stages)} stages but num_stages x virtual_stages is "
                f"{self.num_stages} x {self.virtual_stages}",
            )
        owner: dict[str, int] = {}
        per_rank = [0] * self.num_stages
        for i, stage in enumerate(self.stages):
            if stage.rank == -1:  # written before stages were placed: one per rank
                stage.rank = i if self.virtual_stages == 1 else -1
            if not 0 <= stage.rank < self.num_stages:
                raise FieldError(
                    f"stages[{i}].rank", f"is {stage.rank}; expected 0..{self.num_stages - 1}"
                )
            per_rank[stage.rank] += 1
            _check_stage(stage, i)
            for name in stage.units:
                if name in owner:
                    raise FieldError(
                        f"stages[{i}].units",
                        f"repeats {name!r} (already in stages[{owner[name]}])",
                    )
                owner[name] = i
        if any(count != self.virtual_stages for count in per_rank):
            raise FieldError(
                "stages[*].rank",
                f"gives the ranks {per_rank} stages; each needs {self.virtual_stages}",
            )

    def _check_actions(self) -> None:
        """FieldError naming the rank and first action where :attr:`actions` is not the
        schedule's order for this plan's K, V and M (a hand-edited file). A V the schedule
        cannot run is left to the schedule rules (``schedule_rules.preflight``), which every
        command that would run or emit the plan applies. O(K V M)."""
        if check_virtual_stages(self.schedule, self.virtual_stages) is not None:
            return
        k, v, m = self.num_stages, self.virtual_stages, self.microbatches
        what = f"{self.schedule} with num_stages={k}, virtual_stages={v}, microbatches={m}"
        if len(self.actions) != k:
            raise FieldError("actions", f"lists {len(self.actions)} ranks but {what} has {k}")
        # Every rank runs V x M forwards: an edited M is named without building M's order.
        for rank, ours in enumerate(self.actions):
            forwards = sum(a.phase == "forward" for a in ours)
            if forwards != v * m:
                raise FieldError(
                    f"actions[{rank}]",
                    f"runs {forwards} forwards where {what} runs {v * m}; a plan's actions are "
                    "its schedule's order (remove the field to have it derived)",
                )
        expected = rank_orders(self.schedule, k, v, m)
        for rank, (ours, theirs) in enumerate(zip(self.actions, expected, strict=True)):
            if ours == theirs:
                continue
            i = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None
            )
            if i is None:
                i = min(len(ours), len(theirs))
            got = str(ours[i]) if i < len(ours) else "the end"
            want = str(theirs[i]) if i < len(theirs) else "the end"
            raise FieldError(
                f"actions[{rank}]",
                f"has {got} at position {i} where {what} runs {want}; a plan's actions are "
                "its schedule's order (remove the field to have it derived)",
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan in ``data`` (a loaded JSON object of version 4, 3, 2 or 1: the module's
        docstring says how they differ), checked by :meth:`validate`."""
        written = data.get("version") if isinstance(data, dict) else None
        check_version(
            data, "stages", written if written in READABLE_PLAN_VERSIONS else PLAN_VERSION,
            "plan", PlanFormatError, "re-run `autopipe plan` to regenerate it",
        )  # fmt: skip
        try:
            data, report_data = _current_layout(data, written)
            stage_reports = _stage_reports(data["stages"], report_data, written)
            stages = [
                StagePlan(**known_fields(StagePlan, s, without=("report",)), report=r)
                for s, r in zip(data["stages"], stage_reports, strict=True)
            ]
            fields = known_fields(
                cls, data, without=("stages", "report", "version", "actions", "trainer")
            )
            report = _load_report(report_data)
            plan = cls(stages=stages, report=report, **fields)  # earlier meta keys: lifted
            plan.trainer = _load_trainer(data, written, plan.request)
            if "actions" in data:  # absent in files written before it was recorded
                plan.actions = _parse_actions(data["actions"])  # checked by validate
        except FieldError as exc:
            raise PlanFormatError(str(exc)) from exc
        except (TypeError, AttributeError, ValueError) as exc:
            raise PlanFormatError(f"malformed autopipe plan: {exc}") from exc
        if isinstance(plan.profile, dict):
            plan.profile = _embedded_profile(plan.profile)
        plan.validate()
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON atomically (a crash never leaves half a file)."""
        atomic_write_json(Path(path), self.to_dict())


def replace_plan(plan: Plan, **changes: Any) -> Plan:
    """``dataclasses.replace`` for a plan whose ``changes`` may name report fields too
    (``profile``, ``speedup``, ``baselines``, ...: :class:`PlanReport`'s): those go to a copy
    of the report, so ``plan`` and its report are left as they were; the rest to the plan."""
    names = {f.name for f in dataclasses.fields(PlanReport)}
    reported = {k: v for k, v in changes.items() if k in names}
    rest = {k: v for k, v in changes.items() if k not in names}
    return dataclasses.replace(plan, report=dataclasses.replace(plan.report, **reported), **rest)


_ORDER_FIELDS = ("schedule", "num_stages", "virtual_stages", "microbatches")
"""The :class:`Plan` fields its ``actions`` are derived from."""

_LETTER_PHASES = {letter: phase for phase, letter in PHASE_LETTERS.items()}
_ACTION_PHASES = ("forward", "backward", "backward_input", "backward_weight")
"""The phases a rank's action list holds (torch's F, B, I, W)."""


def _schedule_actions(plan: Plan) -> list[list[Action]] | None:
    """:func:`rank_orders` for the plan's schedule, K, V and M; None while one of them is not
    a value the schedule can run (``validate`` names which)."""
    k, v, m = plan.num_stages, plan.virtual_stages, plan.microbatches
    if not (
        plan.schedule in PLAN_SCHEDULES
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (k, v, m))
        and check_virtual_stages(plan.schedule, v) is None
    ):
        return None
    return rank_orders(plan.schedule, k, v, m)


def _parse_actions(value: Any) -> list[list[Action]]:
    """A file's ``actions``, one string per rank of ``"<chunk><F|B|I|W><micro-batch>"``
    separated by spaces, as Action lists (FieldError naming the first that is not one)."""
    if not isinstance(value, list):
        raise FieldError("actions", "is not a list of one string per rank")
    out = []
    for rank, text in enumerate(value):
        if not isinstance(text, str):
            raise FieldError(f"actions[{rank}]", f"is {text!r}; expected a string like '0F0 0B0'")
        order = []
        for word in text.split():
            match = re.fullmatch(r"(\d+)([A-Z])(\d+)", word)
            phase = _LETTER_PHASES.get(match.group(2), "") if match else ""
            if match is None or phase not in _ACTION_PHASES:
                raise FieldError(
                    f"actions[{rank}]",
                    f"has {word!r}; expected <chunk><F|B|I|W><micro-batch> such as '0F3'",
                )
            order.append(Action(int(match.group(1)), int(match.group(3)), phase))
        out.append(order)
    return out


def _current_layout(data: Any, written: Any) -> tuple[dict[str, Any], Any]:
    """The plan's keys and its report's keys of a file of version ``written``, under
    version 3's names: D as ``data_parallel`` (``replicas`` before), the K x D rows as
    ``data_parallel_rows`` (``data_parallel`` before). A version-1 file's report keys are
    its top level."""
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
        raise FieldError("stages", "is not a list")
    report = data["report"] if written != 1 and "report" in data else data
    if written not in (1, 2):
        return data, report
    plan = {k: v for k, v in data.items() if k not in ("data_parallel", "replicas")}
    if "replicas" in data:
        plan["data_parallel"] = data["replicas"]
    if isinstance(report, dict) and "data_parallel" in report:
        rows = report["data_parallel"]
        report = {k: v for k, v in report.items() if k != "data_parallel"}
        report["data_parallel_rows"] = rows
    return plan, report


def _stage_reports(stages: list[Any], report: Any, written: Any) -> list[StageReport]:
    """Each stage's :class:`StageReport`: ``report.stages`` of a file of version 3 or later (its
    defaults where the file has none: a hand-made plan), each stage's own keys before."""
    if written in (1, 2):
        return [StageReport(**known_fields(StageReport, s)) for s in stages]
    rows = report.get("stages") if isinstance(report, dict) else None
    if rows is None:
        return [StageReport() for _ in stages]
    if not isinstance(rows, list) or len(rows) != len(stages):
        count = len(rows) if isinstance(rows, list) else "no"
        raise FieldError("report.stages", f"lists {count} stages but stages lists {len(stages)}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise FieldError(f"report.stages[{i}]", "is not an object")
        out.append(StageReport(**known_fields(StageReport, row)))
    return out


def _load_report(data: Any) -> PlanReport:
    """The report in ``data`` (the ``"report"`` object of a version-2 file, or a whole
    version-1 file, whose other keys are the plan's), its request as a record."""
    if not isinstance(data, dict):
        raise FieldError("report", "is not an object")
    fields = known_fields(PlanReport, data, without=("stages",))
    if isinstance(fields.get("request"), dict):
        fields["request"] = _load_request(fields["request"])
    elif fields.get("request") is not None:
        raise FieldError("request", "is not an object")
    return PlanReport(**fields)  # meta keys of earlier writers: lift_meta


def _load_trainer(
    data: dict[str, Any], written: Any, request: PlanRequest | None
) -> TrainerOptions:
    """The trainer options of a file of version ``written``: its ``"trainer"`` object
    (version 4; the defaults where it has none: a hand-made plan), else what its report's
    ``request`` asked (the defaults without one), as the readers of those files took them."""
    if written in (1, 2, 3):
        return TrainerOptions.from_request(request)
    return TrainerOptions.from_dict(data.get("trainer", {}))


def _embedded_profile(data: dict[str, Any]) -> Profile:
    """The profile a plan file carries (``Plan.profile``), or ``PlanFormatError`` saying why
    it is unusable."""
    try:
        return Profile.from_dict(data)
    except ProfileFormatError as exc:
        raise PlanFormatError(f"profile (the embedded profile) is unusable: {exc}") from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by ``Plan.save`` or ``autopipe plan --json`` (``PlanFormatError``
    naming the file)."""
    return load_json_file(path, Plan.from_dict, PlanFormatError)


def _check_stage(stage: StagePlan, i: int) -> None:
    """FieldError for the first field of ``stage`` (``stages[i]``, its predicted figures
    ``report.stages[i]``) that cannot be right."""
    check_dataclass(stage, prefix=f"stages[{i}].")
    check_dataclass(stage.report, prefix=f"report.stages[{i}].")
    if stage.index != i:
        raise FieldError(f"stages[{i}].index", f"is {stage.index}; expected {i}")
    if not stage.units:
        raise FieldError(f"stages[{i}].units", "is empty; every stage needs a unit")
    if stage.checkpoint_granularity not in CHECKPOINT_GRANULARITIES:
        raise FieldError(
            f"stages[{i}].checkpoint_granularity",
            f"is {stage.checkpoint_granularity!r}; expected one of "
            f"{', '.join(CHECKPOINT_GRANULARITIES)}",
        )
    if stage.unit_parameters and len(stage.unit_parameters) != len(stage.units):
        raise FieldError(
            f"stages[{i}].unit_parameters",
            f"lists {len(stage.unit_parameters)} counts for {len(stage.units)} units",
        )


def _check_request(request: PlanRequest) -> None:
    """The request's numbers: what a hand-edited file could break (FieldError)."""
    positive = {"gpus": request.gpus, "batch_size": request.batch_size}
    positive["memory_per_device"] = request.memory_per_device
    for name, value in positive.items():
        if value is not None:
            check_number(f"request.{name}", value, integer=True, minimum=1)
    try:  # the request keeps the spelling it was given ("SGD_Momentum" is sgd-momentum)
        normalize_optimizer(str(request.optimizer))
    except ValueError:
        raise FieldError(
            "request.optimizer",
            f"is {request.optimizer!r}; expected one of {', '.join((AUTO, *OPTIMIZERS))}",
        ) from None
    check_number("request.headroom", request.headroom)
    check_number("request.time_limit_s", request.time_limit_s)
    if request.bytes_per_parameter is not None:
        check_number("request.bytes_per_parameter", request.bytes_per_parameter, minimum=1e-9)
    if request.virtual_stages != "auto":
        check_number("request.virtual_stages", request.virtual_stages, integer=True, minimum=1)
