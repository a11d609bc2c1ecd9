"""What the planner weighed on the way to a Plan, as typed records the Plan keeps.

Torch-free. Every record is plain data with a JSON form (``dataclasses.asdict``) and a
``from_dict`` that ignores keys a newer writer added (schema v1 stays additive). Times are
seconds, sizes bytes; ``None`` where a candidate has no figure (no plan, or infinite).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopipe.core.datafile import known_fields

__all__ = ["CandidateRow", "DataParallelRow", "MeshReport", "MeshRow"]


@dataclass
class CandidateRow:
    """One (schedule, V, M) the pipeline search weighed (``Plan.candidates``)."""

    microbatches: int
    schedule: str
    virtual_stages: int = 1
    feasible: bool = False
    iteration_time_s: float | None = None
    """The simulated iteration of its best cut; None when it does not fit."""
    bottleneck_s: float | None = None
    """The slowest chunk of its cut per micro-batch; None when it was never cut."""
    lower_bound_s: float | None = None
    """Its proven lower bound on the iteration time; None when not computed."""
    pruned: bool = False
    """Not searched: its lower bound could not beat the best found so far."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CandidateRow:
        return cls(**known_fields(cls, data))


@dataclass
class DataParallelRow:
    """One ``K x D`` layout an earlier ``plan_data_parallel`` weighed
    (``Plan.data_parallel_rows``)."""

    stages: int
    """K, pipeline stages."""
    replicas: int
    """D, copies of the pipeline."""
    step_s: float | None = None
    """Pipeline iteration + gradient all-reduce; None when K has no plan."""
    allreduce_s: float | None = None
    throughput: float = 0.0
    """Samples per second over the global batch."""
    reason: str = ""
    """Why the layout has no plan ("" when it has one)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataParallelRow:
        return cls(**known_fields(cls, data))


@dataclass
class MeshRow:
    """One ``pp x dp x tp`` mesh with a sharding that the mesh search weighed."""

    pp: int
    dp: int
    tp: int
    shard: str
    cp: int = 1
    """C, context-parallel degree (1 in plans written before it)."""
    ep: int = 1
    """E, expert-parallel degree (1 in plans written before it)."""
    step_s: float | None = None
    """Pipeline iteration + exposed data-parallel communication + optimizer step; None
    without a plan."""
    pipeline_s: float | None = None
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    """The busiest pipeline rank's optimizer step, after its gradient reduction (0 in plans
    written before it was priced)."""
    gather_s: float = 0.0
    """Average rank's exposed parameter gathers per step (``shard="parameters"``)."""
    tp_comm_s: float = 0.0
    """The busiest rank's tensor-parallel collectives per step."""
    bubble_s: float | None = None
    peak_bytes: int | None = None
    """Largest per-device peak (gather buffers included); None when unknown."""
    lower_bound_s: float = 0.0
    searched: bool = False
    """Its pipeline was searched (else its lower bound or memory ruled it out)."""
    reason: str = ""
    """Why it loses to the chosen mesh, or why it has no plan."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshRow:
        return cls(**known_fields(cls, data))


@dataclass
class MeshReport:
    """The device mesh a mesh plan chose and every mesh it weighed (``Plan.mesh``)."""

    gpus: int
    """N = pp x dp x tp devices."""
    gpus_per_node: int
    intra_node_bandwidth_bytes_per_s: float | None = None
    """Per-device link inside a node; None: unlimited."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    peak_bytes: int = 0
    """The chosen mesh's largest per-device peak (gather buffers included)."""
    gather_buffer_bytes: float = 0.0
    """The chosen mesh's buffers for gathered parameters (``shard="parameters"``)."""
    device_state_bytes_per_parameter: float = 0.0
    """Training-state bytes per parameter on one device after sharding."""
    tp_comm_s: float = 0.0
    """The busiest rank's tensor-parallel collectives per step."""
    candidates: list[MeshRow] = field(default_factory=list)
    """Every mesh weighed, fastest first (the chosen one first), each with why it loses."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshReport:
        values = known_fields(cls, data)
        values["candidates"] = [MeshRow.from_dict(r) for r in values.get("candidates", [])]
        return cls(**values)
