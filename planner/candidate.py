"""One point the planner's search tries: a micro-batch count and a schedule, and what it gave.

Torch-free. The search makes one :class:`Candidate` per (M, schedule), partitions it, and the
refinements (the GPipe frontier walk, the baselines that simulate faster) replace its
partition through :meth:`Candidate.adopt`, never by rewriting loose dictionary keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopipe.planner.chain import Partition
from autopipe.planner.costs import CostModel, SegmentCost
from autopipe.planner.simulate import Simulation

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """A (micro-batch count, schedule) pair with its cost model and, if it fits, its best
    partition, per-stage costs and simulated iteration."""

    microbatches: int
    schedule: str
    cost_model: CostModel
    partition: Partition | None = None
    costs: list[SegmentCost] = field(default_factory=list)
    simulation: Simulation | None = None
    min_bottleneck_s: float = math.inf
    """The smallest bottleneck any partition reaches here (the exact partitioner's)."""
    frontier: dict[str, Any] | None = None
    """What the GPipe frontier walk looked at, when it ran."""

    @property
    def feasible(self) -> bool:
        return self.partition is not None and self.simulation is not None

    @property
    def iteration_time_s(self) -> float:
        return self.simulation.iteration_time_s if self.simulation is not None else math.inf

    def adopt(self, partition: Partition, costs: list[SegmentCost], simulation: Simulation) -> None:
        """Take another partition of the same candidate (faster under the simulator)."""
        self.partition, self.costs, self.simulation = partition, costs, simulation

    def summary(self) -> dict[str, Any]:
        """The JSON row a Plan keeps for every candidate it weighed."""
        return {
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "feasible": self.feasible,
            "iteration_time_s": self.iteration_time_s if self.feasible else None,
            "bottleneck_s": self.partition.bottleneck_s if self.partition is not None else None,
        }
