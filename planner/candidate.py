"""One point the planner's search tries: a schedule, V chunks per rank and a micro-batch
count, and what it gave.

Torch-free. The search makes one :class:`Candidate` per (schedule, V, M), partitions it,
and the refinements (the GPipe frontier walk, the baselines that simulate faster, the
chunk moves of V > 1) replace its partition through :meth:`Candidate.adopt`, never by
rewriting loose dictionary keys. :meth:`Candidate.evaluate` is the one place a partition is
priced: chunk costs, the simulated iteration and every rank's replayed peak memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopipe.planner.chain import Partition
from autopipe.planner.chunks import ScheduleShape, chunk_works, rank_fits
from autopipe.planner.costs import CostModel, SegmentCost
from autopipe.planner.simulate import (
    ChunkWork,
    Simulation,
    fill_drain_lower_bound_s,
    gpipe_exact,
    idle_fraction,
    simulate_schedule,
)

from autopipe.core.cluster import Cluster
from autopipe.core.plan_records import CandidateRow

__all__ = ["Candidate", "Evaluation"]


@dataclass
class Evaluation:
    """A partition priced: its chunk costs, the simulator's work, the simulated iteration
    and each rank's replayed peak bytes; ``fits`` when every peak fits its rank."""

    bounds: list[int]
    costs: list[SegmentCost]
    works: list[ChunkWork]
    simulation: Simulation
    peaks: list[float]
    fits: bool

    @property
    def iteration_time_s(self) -> float:
        return self.simulation.iteration_time_s


@dataclass
class Candidate:
    """A (schedule, V, M) with its cost model and, if it fits, its best partition, per-chunk
    costs, simulated iteration and replayed memory."""

    microbatches: int
    schedule: str
    cost_model: CostModel
    shape: ScheduleShape | None = None
    """Placement, orders and in-flight counts (None only in hand-built test candidates)."""
    cluster: Cluster | None = None
    """The ranks' devices (the cost model's are per chunk when V > 1)."""
    partition: Partition | None = None
    costs: list[SegmentCost] = field(default_factory=list)
    simulation: Simulation | None = None
    works: list[ChunkWork] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    """Each rank's replayed peak bytes (headroom not included)."""
    min_bottleneck_s: float = math.inf
    """The smallest bottleneck any partition reaches here (the exact partitioner's): a
    stage's time per micro-batch with V = 1, a chunk's with V > 1."""
    lower_bound_s: float = 0.0
    """Proven lower bound on the iteration time of any partition of this (schedule, V, M)."""
    method: str = ""
    """How the partition was found, in words."""
    frontier: dict[str, Any] | None = None
    """What the GPipe frontier walk looked at, when it ran."""
    refinement: dict[str, Any] | None = None
    """What the chunk-move refinement of V > 1 looked at, when it ran."""
    pruned: bool = False
    """Not partitioned: its proven lower bound (or one probe: no cut keeps every chunk within
    the best time so far / M) showed it cannot beat a plan already found."""

    @property
    def virtual_stages(self) -> int:
        return 1 if self.shape is None else self.shape.virtual_stages

    @property
    def feasible(self) -> bool:
        return self.partition is not None and self.simulation is not None

    @property
    def iteration_time_s(self) -> float:
        return self.simulation.iteration_time_s if self.simulation is not None else math.inf

    def evaluate(self, bounds: list[int], costs: list[SegmentCost] | None = None) -> Evaluation:
        """Price the partition ``bounds`` (with ``costs`` if given, else the cost model's
        option per chunk). O(T) for T simulated tasks; GPipe on one stage per rank uses its
        exact fill-drain formula, O(K), unless the ranks share a host
        (``Cluster.host_throughput``): then every schedule is simulated, O(T K)."""
        assert self.shape is not None and self.cluster is not None
        cm, shape = self.cost_model, self.shape
        if costs is None:
            costs = cm.stage_costs(bounds)
        works = chunk_works(cm, bounds, costs, shape.split_backward)
        fits, peaks = rank_fits(works, shape, self.cluster, cm.headroom)
        fits = fits and all(c.feasible for c in costs)
        shared = self.cluster.sharing(shape.num_ranks)
        if shape.schedule == "gpipe" and shared is None:
            fwd = [w.forward_s + w.send_s for w in works]
            bwd = [w.recompute_s + w.backward_s for w in works]
            total = gpipe_exact(fwd, bwd, self.microbatches)
            busy = [self.microbatches * (f + b) for f, b in zip(fwd, bwd, strict=True)]
            bubble = idle_fraction(busy, len(works), total)
            sim = Simulation(total, bubble, busy_s=busy, peak_bytes=peaks)
        else:
            sim = simulate_schedule(
                works, shape.schedule, shape.num_ranks, self.microbatches,
                orders=shape.orders, record_tasks=False, host_throughput=shared,
            )  # fmt: skip
        return Evaluation(list(bounds), costs, works, sim, peaks, fits)

    def cut_lower_bound_s(self, bounds: list[int]) -> float:
        """A proven lower bound on :meth:`evaluate`'s iteration time for the cut ``bounds``
        (the cost model's option per chunk), O(N + K) without simulating: GPipe and 1F1B
        on one stage per dedicated rank (:func:`fill_drain_lower_bound_s`), else 0."""
        assert self.shape is not None and self.cluster is not None
        cm, shape = self.cost_model, self.shape
        if shape.schedule not in ("gpipe", "1f1b") or shape.virtual_stages != 1:
            return 0.0
        if self.cluster.sharing(shape.num_ranks) is not None:
            return 0.0
        works = chunk_works(cm, bounds, cm.stage_costs(bounds), shape.split_backward)
        return fill_drain_lower_bound_s(works, self.microbatches)

    def adopt(
        self,
        partition: Partition,
        costs: list[SegmentCost],
        simulation: Simulation,
        works: list[ChunkWork] | None = None,
        peaks: list[float] | None = None,
    ) -> None:
        """Take another partition of the same candidate (faster under the simulator)."""
        self.partition, self.costs, self.simulation = partition, costs, simulation
        if works is not None:
            self.works = works
        if peaks is not None:
            self.peaks = peaks

    def adopt_evaluation(self, ev: Evaluation, algorithm: str) -> None:
        """Take a priced partition (it must fit)."""
        bottleneck = max(c.time_s for c in ev.costs)
        self.adopt(Partition(ev.bounds, bottleneck, algorithm), ev.costs, ev.simulation,
                   ev.works, ev.peaks)  # fmt: skip

    def summary(self) -> CandidateRow:
        """The row a Plan keeps for every candidate it weighed (``Plan.candidates``)."""
        return CandidateRow(
            microbatches=self.microbatches,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            feasible=self.feasible,
            iteration_time_s=self.iteration_time_s if self.feasible else None,
            bottleneck_s=self.partition.bottleneck_s if self.partition is not None else None,
            lower_bound_s=self.lower_bound_s or None,
            pruned=self.pruned,
        )
