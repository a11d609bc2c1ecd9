"""Which stage and replica each rank runs (autopipe.runtime.distributed.layout), without
launching processes."""

from __future__ import annotations

import pytest
from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout

from autopipe.core.errors import UsageError


def test_two_stages_by_three_replicas() -> None:
    grid = [rank_layout(r, 6, 2, replicas=3) for r in range(6)]
    assert [(g.stage, g.replica) for g in grid] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(g.replicas == 3 for g in grid)
    # Replica 2's pipeline, and stage 1's all-reduce group: consecutive ranks.
    assert grid[0].pipeline_ranks(2) == [2, 5]
    assert grid[0].replica_ranks(1) == [3, 4, 5]
    assert [g.is_first_stage for g in grid] == [True] * 3 + [False] * 3
    assert [g.is_last_stage for g in grid] == [False] * 3 + [True] * 3
    # Every rank is in exactly one pipeline and one replica group.
    pipelines = sorted(r for d in range(3) for r in grid[0].pipeline_ranks(d))
    assert pipelines == list(range(6))


def test_one_stage_is_data_parallel_only() -> None:
    layout = rank_layout(3, 4, 1)
    assert (layout.stage, layout.replica, layout.replicas) == (0, 3, 4)
    assert layout.is_first_stage and layout.is_last_stage
    assert layout.pipeline_ranks(3) == [3] and layout.replica_ranks(0) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("rank", "world", "stages", "replicas", "message"),
    [
        (0, 4, 0, 1, "the plan has 0 stages; it needs at least one"),
        (0, 8, 2, 3, "2 stages x 3 replicas = 6 processes but 8 were launched; launch 6"),
        (4, 4, 2, 1, "rank 4 is outside the world of 4 processes"),
        (-1, 4, 2, 1, "rank -1 is outside the world of 4 processes"),
    ],
)
def test_bad_worlds_are_usage_errors(
    rank: int, world: int, stages: int, replicas: int, message: str
) -> None:
    with pytest.raises(PlanWorldSizeError, match=message.replace("(", r"\(")) as caught:
        rank_layout(rank, world, stages, replicas)
    assert isinstance(caught.value, UsageError) and "\n" not in str(caught.value)


def test_a_broken_step_under_tp_names_dp_and_tp_ranks_not_a_replica() -> None:
    """Under TP the layout's "replica" counts the D x T pipelines: rank 5 of pp 2 x dp 2 x
    tp 2 is layout replica 1 but dp rank 0, tp rank 1, and the failure message says so
    (before: "replica 1"). Without TP the message still names the replica."""
    from types import SimpleNamespace

    from autopipe.runtime.distributed.failures import PipelineRankError
    from autopipe.runtime.distributed.pipeline import DistributedPipeline

    def broken(*_: object) -> None:
        raise RuntimeError("Connection reset by peer")

    def fail(layout: object, dp: int, tp: int, degree: int) -> str:
        pipe = SimpleNamespace(
            layout=layout, recorder=None, _step=broken, steps=0, data_parallel_rank=dp,
            tensor_parallel_rank=tp, plan=SimpleNamespace(tensor_parallel=degree),
        )  # fmt: skip
        with pytest.raises(PipelineRankError) as caught:
            DistributedPipeline.step(pipe)  # type: ignore[arg-type]
        return str(caught.value)

    mesh = rank_layout(5, 8, 2, 2 * 2)
    assert mesh.replica == 1
    text = fail(mesh, 0, 1, 2)
    assert text.startswith("rank 5 (stage 1, dp rank 0, tp rank 1): the pipeline broke in step 1")
    assert "replica" not in text
    plain = rank_layout(3, 4, 2, 2)
    assert fail(plain, plain.replica, 0, 1).startswith("rank 3 (stage 1, replica 1): ")
