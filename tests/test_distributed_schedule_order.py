"""torch's schedule checked against the plan's per-rank orders at build time
(``runtime/distributed/schedule_order.py``).

The schedule objects are built as ``autopipe run`` builds them, on mocked stages (no
process is launched: building a torch schedule only reads the stage's rank, size and count).
"""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from autopipe.runtime.distributed.schedule_order import (  # noqa: E402
    ScheduleOrderMismatchError,
    check_torch_order,
    torch_rank_orders,
)
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from autopipe.core.plan import Plan, StagePlan  # noqa: E402
from autopipe.core.schedule_rules import chunk_ranks  # noqa: E402
from autopipe.core.schedules import rank_orders  # noqa: E402
from autopipe.core.timeline import Action  # noqa: E402
from autopipe.core.vocabulary import TORCH_CLASSES  # noqa: E402

MULTI = [
    ("interleaved-1f1b", 2, 2, 4),
    ("interleaved-1f1b", 3, 2, 5),
    ("looped-bfs", 2, 3, 4),
    ("interleaved-zb", 2, 2, 4),
    ("zbv", 2, 2, 4),
    ("dualpipev", 2, 2, 5),
]


def _stage(rank: int, k: int, v: int) -> mock.MagicMock:
    st = mock.create_autospec(PipelineStage, instance=True)
    st.group_rank, st.group_size, st.num_stages = rank, k, k * v
    st.submod = None
    st.stage_index, st.device, st.output_chunks = rank, "cpu", []
    st.is_first, st.is_last = rank == 0, rank == k - 1
    return st


def _schedule(name: str, k: int, v: int, m: int, cls_name: str | None = None) -> object:
    """torch's schedule object for ``name`` as ``runtime/distributed/pipeline.py`` builds it."""
    cls = getattr(torch_schedules, cls_name or TORCH_CLASSES[name])
    options = {"loss_fn": lambda out, target: out, "scale_grads": False}
    if name in ("gpipe", "1f1b"):
        return cls(_stage(0, k, 1), m, **options)
    return cls([_stage(0, k, v)] * v, m, **options)


def _plan(name: str, k: int, v: int, m: int) -> Plan:
    ranks = chunk_ranks(name, k, v)
    stages = [
        StagePlan(index=c, device="cpu", units=[f"u{c}"], rank=ranks[c]) for c in range(k * v)
    ]
    return Plan(k, m, 1, m, stages, schedule=name, virtual_stages=v)


@pytest.mark.parametrize(("name", "k", "v", "m"), MULTI)
def test_torch_runs_the_plans_order(name: str, k: int, v: int, m: int) -> None:
    schedule, plan = _schedule(name, k, v, m), _plan(name, k, v, m)
    assert torch_rank_orders(schedule) == rank_orders(name, k, v, m) == plan.actions
    check_torch_order(schedule, plan, plan.actions)  # what DistributedPipeline checks


@pytest.mark.parametrize(("name", "k", "v", "m"), MULTI[::2])
def test_an_altered_order_is_refused_by_name(name: str, k: int, v: int, m: int) -> None:
    orders = rank_orders(name, k, v, m)
    # Rank 1 swaps two neighbouring actions of different kinds: a reorder a plan could hold.
    at = next(i for i in range(len(orders[1]) - 1) if orders[1][i] != orders[1][i + 1])
    altered = [list(o) for o in orders]
    altered[1][at], altered[1][at + 1] = altered[1][at + 1], altered[1][at]
    with pytest.raises(
        ScheduleOrderMismatchError,
        match=rf"torch's {TORCH_CLASSES[name]} runs rank 1's compute action {at} as "
        rf"{orders[1][at]} where the plan's order has {altered[1][at]} \({name}",
    ):
        check_torch_order(_schedule(name, k, v, m), _plan(name, k, v, m), altered)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_classes_are_checked_by_class_and_microbatches(name: str) -> None:
    plan, orders = _plan(name, 2, 1, 4), rank_orders(name, 2, 1, 4)
    check_torch_order(_schedule(name, 2, 1, 4), plan, orders)
    other = "Schedule1F1B" if name == "gpipe" else "ScheduleGPipe"
    with pytest.raises(ScheduleOrderMismatchError, match=f"is {name} .* but torch built {other}"):
        check_torch_order(_schedule(name, 2, 1, 4, other), plan, orders)
    with pytest.raises(ScheduleOrderMismatchError, match="runs 6 micro-batches where the plan"):
        check_torch_order(_schedule(name, 2, 1, 6), plan, orders)


def test_missing_actions_are_refused() -> None:
    orders = rank_orders("interleaved-1f1b", 2, 2, 4)
    short = [orders[0], orders[1][:-1]]
    with pytest.raises(ScheduleOrderMismatchError, match="has nothing"):
        check_torch_order(
            _schedule("interleaved-1f1b", 2, 2, 4), _plan("interleaved-1f1b", 2, 2, 4), short
        )
    assert Action(0, 0, "forward") in orders[0]
