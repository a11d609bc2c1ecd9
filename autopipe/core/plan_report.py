"""The PlanReport: what the planner predicted and weighed for a :class:`~autopipe.core.plan.Plan`.

Torch-free. A :class:`Plan` is what every rank executes and agrees on (ARCHITECTURE.md "The
Plan, version 3"); its report is everything else the planner knows about it: the predicted
step and bubble, throughput, speed-up, bottleneck and lower-bound figures, the memory per
device and each rank's peak, the request it was planned for, the baselines, candidates and
mesh weighed, the notes, the embedded profile and plot data; each stage's predicted seconds
and bytes are its :class:`StageReport`. Times are seconds, sizes bytes.
The runtime, training, the rank agreement and the emitters never read it (tests/test_layers.py);
``autopipe plan``, ``explain``, ``plot`` and the reports do, as ``plan.report.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopipe.core.meta_fields import lift_meta
from autopipe.core.plan_records import CandidateRow, DataParallelRow, MeshReport
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

__all__ = ["REPORT_META_FIELDS", "PlanReport", "StageReport"]

REPORT_META_FIELDS = {
    "algorithm": "partition_algorithm",
    "bottleneck_s": "bottleneck_s",
    "min_bottleneck_s": "min_bottleneck_s",
    "single_device_time_s": "single_device_time_s",
    "parameter_size_bytes": "parameter_size_bytes",
    "pipeline_iteration_s": "pipeline_iteration_s",
    "allreduce_s": "allreduce_s",
    "candidates": "candidates",
    "data_parallel": "data_parallel_rows",
    "mesh": "mesh",
    "profile": "profile",
    "viz": "plot_data",
    "state_bytes_per_parameter": "state_bytes_per_parameter",
}
"""``meta`` keys of earlier writers (schema v1) and the report fields they are now."""


@dataclass
class StageReport:
    """What the planner predicted for one stage (model chunk) of a plan: its busy seconds per
    micro-batch and its memory (``StagePlan.report``; saved as ``report.stages[i]`` in a plan
    file of version 3, beside the stage in earlier ones). Nothing here changes what a rank
    does; ``stage.forward_s`` reads and sets ``stage.report.forward_s``.

    ``forward_s``/``backward_s``/``recompute_s``/``send_s`` are per micro-batch.
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    """Extra forward in backward when the stage is checkpointed, else 0."""
    send_s: float = 0.0
    """Time to send this stage's output cut to the next stage (0 for the last stage)."""
    memory_bytes: int = 0
    parameter_bytes: int = 0
    """The stage's parameters as profiled. The runtimes check a model against it only for a
    plan written before ``StagePlan.unit_parameters`` was recorded (their instruction)."""
    optimizer_bytes: int = 0
    """Gradients plus optimizer state."""
    activation_bytes: int = 0
    reason: str = ""
    """Why the stage is checkpointed, in words; "" when it is not."""
    backward_input_s: float = 0.0
    """The part of ``backward_s`` that computes the input gradient (zero-bubble "B"); with
    ``backward_weight_s`` both 0 when the plan does not split backward."""
    backward_weight_s: float = 0.0
    """The part of ``backward_s`` that computes the weight gradients (zero-bubble "W")."""
    microbatch_activation_bytes: int = 0
    """What one micro-batch's forward saves for backward (bytes; re-computed when
    checkpointed); with ``microbatch_input_bytes`` what the memory replay over time uses. 0 in
    plans written before it was recorded (then estimated from ``activation_bytes``)."""
    microbatch_input_bytes: int = 0
    """One micro-batch's stage input (bytes), all a checkpointed stage keeps per micro-batch
    until it re-computes."""

    @property
    def time_s(self) -> float:
        """Busy seconds per micro-batch: forward + backward + recompute + send."""
        return self.forward_s + self.backward_s + self.recompute_s + self.send_s


def _record(cls: Any, value: Any) -> Any:
    """``value`` as a ``cls`` record: itself, or built from its JSON object."""
    return value if isinstance(value, cls) else cls.from_dict(value)


@dataclass
class PlanReport:
    """The planner's figures for one plan: predictions (seconds, bytes, samples per second),
    the request, what it weighed and why (``Plan.report``; saved under ``"report"`` in a
    version-2 plan file). Nothing here changes what a rank does."""

    iteration_time_s: float = 0.0
    bubble_fraction: float = 0.0
    throughput: float = 0.0
    """Samples per second."""
    speedup: float = 1.0
    """Predicted single-device iteration time / this plan's iteration time."""
    bottleneck_stage: int = 0
    strategy: str = "dp"
    memory_per_device: int | None = None
    optimality_gap: float = 0.0
    profile_mode: str = "measured"
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Other strategies' figures on the same problem, e.g. ``{"uniform": {...}}``."""
    notes: list[str] = field(default_factory=list)
    """Why the plan is what it is, one sentence each."""
    state_bytes_per_parameter: float = 0.0
    """Parameter + gradient + optimizer-state bytes charged per parameter (0: not recorded)."""
    lower_bound_s: float = 0.0
    """A proven lower bound on the iteration time of any cut of the model into
    ``num_stages x virtual_stages`` chunks with this schedule, M and micro-batch size
    (docs/cost-model.md); 0 in plans written before it was recorded."""
    lower_bound_gap: float = 0.0
    """``iteration_time_s / lower_bound_s - 1``: at most how much slower this plan is than the
    best plan of its schedule, V and M (the schedule's own bubble included)."""
    method: str = ""
    """How the stage (chunk) boundaries were found, in words: the exact min-bottleneck search
    for V = 1, that search over the ``K x V`` chunks then simulated refinement for V > 1."""
    rank_peak_bytes: list[int] = field(default_factory=list)
    """Each rank's peak memory (bytes, headroom not included) replayed over the simulated
    iteration: what the memory limit was checked against."""
    request: PlanRequest | None = None
    """What the plan was asked for; ``plan(profile, dataclasses.replace(p.request, ...))``
    plans it again with one thing changed. None in plans written before it was recorded."""
    partition_algorithm: str = ""
    """The partition search that placed the stage (chunk) boundaries (``dp``, ``pareto``,
    ``dp+moves``, ``probe``, a baseline's name ...); ``""`` in plans written before it was a
    field."""
    bottleneck_s: float = 0.0
    """The slowest stage (chunk) of this cut, busy seconds per micro-batch."""
    min_bottleneck_s: float = 0.0
    """The smallest bottleneck any cut into these stages has (the exact search's optimum):
    at most ``bottleneck_s``; below it when the plan traded the bottleneck for a faster
    simulated iteration."""
    single_device_time_s: float = 0.0
    """Predicted seconds of the whole per-replica batch on one device (``speedup`` is this
    over ``iteration_time_s`` for a pipeline plan)."""
    parameter_size_bytes: int = 0
    """Bytes of one parameter as profiled (its dtype): what ``state_bytes_per_parameter`` is
    explained against; 0: not recorded."""
    pipeline_iteration_s: float = 0.0
    """With ``data_parallel`` > 1: the pipeline's own iteration, without the exposed
    data-parallel communication that ``iteration_time_s`` includes; 0 otherwise."""
    allreduce_s: float = 0.0
    """With ``data_parallel`` > 1: the exposed data-parallel communication per step (gradient
    all-reduce, or the sharded modes' collectives); 0 otherwise."""
    optimizer_s: float = 0.0
    """In a mesh plan: the optimizer step per step, the busiest pipeline rank's memory-bound
    passes over its share of the training state after its gradient reduction, included in
    ``iteration_time_s`` (docs/cost-model.md, "The optimizer step"); 0 otherwise and in
    plans written before it was priced."""
    candidates: list[CandidateRow] = field(default_factory=list)
    """Every (schedule, V, M) the pipeline search weighed."""
    data_parallel_rows: list[DataParallelRow] = field(default_factory=list)
    """Every ``K x D`` layout an earlier ``plan_data_parallel`` weighed, best first (key
    ``data_parallel`` in files written before ``Plan.replicas`` became ``data_parallel``);
    empty otherwise."""
    mesh: MeshReport | None = None
    """The device mesh search's report (nodes, links, peak memory, every mesh weighed);
    None for a plan of one pipeline."""
    profile: Profile | None = None
    """The profile the plan was made from, when it travels with the plan (``autopipe plan``
    writes it, so ``autopipe plot`` and tools can re-plan); None otherwise."""
    plot_data: dict[str, Any] = field(default_factory=dict)
    """The figures' data (``autopipe.viz.collect_plot_data``) when ``autopipe plan --plot``
    stored it, so ``autopipe plot PLAN.json`` redraws without re-planning; empty otherwise."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form notes for people (nothing reads them back)."""

    def __post_init__(self) -> None:
        lift_meta(self, REPORT_META_FIELDS)
        # A loaded file (or an earlier writer's meta) gives the records as JSON objects.
        self.candidates = [_record(CandidateRow, r) for r in self.candidates]
        self.data_parallel_rows = [_record(DataParallelRow, r) for r in self.data_parallel_rows]
        if self.mesh is not None:
            self.mesh = _record(MeshReport, self.mesh)
