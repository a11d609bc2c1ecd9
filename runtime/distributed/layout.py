"""Which stage and which data-parallel replica each rank runs. Torch-free.

World size ``W = K x D``: ``K`` pipeline stages (the plan's ``num_stages``) times ``D`` replicas.
Ranks are laid out stage-major: ``stage = rank // D``, ``replica = rank % D``. Ranks of one stage
are consecutive, so with ``--nproc-per-node`` a multiple of ``D`` the gradient all-reduce of a
stage stays inside one node and only the (smaller) activations cross nodes, as in Megatron-LM's
layout where pipeline parallelism is the outermost dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopipe.core.errors import UsageError


class PlanWorldSizeError(UsageError, ValueError):
    """The number of launched processes does not fit the plan."""


@dataclass(frozen=True)
class RankLayout:
    """Position of one rank in the K x D grid."""

    rank: int
    world_size: int
    num_stages: int

    @property
    def replicas(self) -> int:
        """D: copies of each stage (data-parallel degree)."""
        return self.world_size // self.num_stages

    @property
    def stage(self) -> int:
        return self.rank // self.replicas

    @property
    def replica(self) -> int:
        return self.rank % self.replicas

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of replica ``replica``'s pipeline, stage 0 first."""
        return [stage * self.replicas + replica for stage in range(self.num_stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """Global ranks holding a copy of ``stage`` (its gradient all-reduce group)."""
        return [stage * self.replicas + d for d in range(self.replicas)]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


def rank_position(
    layout: RankLayout, data_parallel_rank: int, tensor_parallel_rank: int, tensor_parallel: int
) -> str:
    """Where ``layout``'s rank sits, as messages name it: ``rank R (stage S, replica D)``, or
    under tensor parallelism (``layout.replica`` then counts the D x T pipelines, so it is
    not a replica) ``rank R (stage S, dp rank d, tp rank t)``."""
    if tensor_parallel > 1:
        return (
            f"rank {layout.rank} (stage {layout.stage}, dp rank {data_parallel_rank}, "
            f"tp rank {tensor_parallel_rank})"
        )
    return f"rank {layout.rank} (stage {layout.stage}, replica {data_parallel_rank})"


def rank_layout(rank: int, world_size: int, num_stages: int, replicas: int = 1) -> RankLayout:
    """The layout of ``rank``; raises :class:`PlanWorldSizeError` unless ``K`` divides ``W``."""
    if num_stages < 1:
        raise PlanWorldSizeError(f"the plan has {num_stages} stages; it needs at least one")
    if world_size % num_stages != 0:
        raise PlanWorldSizeError(
            f"the plan has {num_stages} stages but {world_size} processes were launched; "
            f"launch a multiple of {num_stages} (K x D, e.g. torchrun --nproc-per-node "
            f"{num_stages}) or re-plan with `autopipe plan ... --gpus {world_size}`"
        )
    if replicas > 1 and world_size != num_stages * replicas:
        raise PlanWorldSizeError(
            f"the plan is {num_stages} stages x {replicas} replicas = {num_stages * replicas} "
            f"processes but {world_size} were launched; launch {num_stages * replicas} "
            f"(torchrun --nproc-per-node ...) or re-plan for {world_size} GPUs"
        )
    if not 0 <= rank < world_size:
        raise PlanWorldSizeError(f"rank {rank} is outside the world of {world_size} processes")
    return RankLayout(rank, world_size, num_stages)
