"""The planner's schedule orders (autopipe/core/schedules.py, torch-free) against torch's own.

torch.distributed.pipelining's multi-stage schedules keep each rank's order in
``pipeline_order``; GPipe and 1F1B have none worth trusting in torch 2.13 (1F1B's is off by
one micro-batch on later ranks), so their order is the one ``_step_microbatches`` actually
runs on a mocked stage. Nothing distributed runs: the stages are autospec mocks.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from autopipe.core.schedule_rules import chunk_ranks, violations  # noqa: E402
from autopipe.core.schedules import rank_orders  # noqa: E402
from autopipe.core.vocabulary import TORCH_CLASSES, V_SHAPE_SCHEDULES  # noqa: E402

_PHASE = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


@functools.cache
def _stage(rank: int, k: int, v: int) -> mock.MagicMock:
    """A mocked stage of rank ``rank`` (autospec is slow: one per (rank, K, V), reused; each
    use sets the side effects it needs)."""
    st = mock.create_autospec(PipelineStage, instance=True)
    st.group_rank, st.group_size, st.num_stages = rank, k, k * v
    st.submod = None
    st.stage_index, st.device, st.output_chunks = rank, "cpu", []
    st.is_first, st.is_last = rank == 0, rank == k - 1
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(st, name).return_value = []
    return st


def _single_executed(name: str, k: int, m: int) -> list[list[tuple[int, int, str]]]:
    """What GPipe / 1F1B's ``_step_microbatches`` calls on each rank's stage, in order."""
    cls = getattr(torch_schedules, TORCH_CLASSES[name])
    out = []
    for r in range(k):
        st = _stage(r, k, 1)
        order: list[tuple[int, int, str]] = []
        st.forward_one_chunk.side_effect = lambda i, *a, _o=order, _r=r, **kw: _o.append(
            (_r, i, "forward")
        )
        st.backward_one_chunk.side_effect = lambda i, *a, _o=order, _r=r, **kw: _o.append(
            (_r, i, "backward")
        )
        sched = cls(st, m, loss_fn=lambda o, t: None)
        sched._step_microbatches([()] * m, [{}] * m, [None] * m, None)
        out.append(order)
    return out


def _multi_order(name: str, k: int, v: int, m: int) -> list[list[tuple[int, int, str]]]:
    """The compute actions of each rank in the schedule's ``pipeline_order``."""
    cls = getattr(torch_schedules, TORCH_CLASSES[name])
    st = _stage(0, k, v)
    sched = cls([st] * v, m)
    out = []
    for r in range(k):
        acts = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            for x in a.sub_actions if a.sub_actions is not None else (a,):
                phase = _PHASE.get(x.computation_type.value)
                if phase is not None:
                    acts.append((x.stage_index, x.microbatch_index, phase))
        out.append(acts)
    return out


def _torch_order(name: str, k: int, v: int, m: int) -> list[list[tuple[int, int, str]]]:
    if name in ("gpipe", "1f1b"):
        return _single_executed(name, k, m)
    return _multi_order(name, k, v, m)


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in TORCH_CLASSES:
        if name in ("gpipe", "1f1b"):
            vs = (1,)
        elif name in V_SHAPE_SCHEDULES:
            vs = (2,)
        else:
            vs = (1, 2, 4)
        for k in (2, 4, 8):
            for v in vs:
                for m in sorted({2, 3, k, k + 2, 2 * k, 2 * k + 3, 3 * k}):
                    if not violations(name, k, v, m, batch_size=m):
                        cases.append((name, k, v, m))
    return cases


CASES = _cases()


def test_cases_cover_every_schedule() -> None:
    assert {c[0] for c in CASES} == set(TORCH_CLASSES)
    assert len(CASES) >= 100


@pytest.mark.parametrize("name,k,v,m", CASES, ids=[f"{n}-K{k}-V{v}-M{m}" for n, k, v, m in CASES])
def test_order_matches_torch(name: str, k: int, v: int, m: int) -> None:
    ours = [[(a.stage, a.microbatch, a.phase) for a in r] for r in rank_orders(name, k, v, m)]
    assert ours == _torch_order(name, k, v, m)


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
def test_placement_matches_torch(name: str) -> None:
    """Every chunk appears only in the order of the rank chunk_ranks puts it on."""
    k = 4
    v = 1 if name in ("gpipe", "1f1b") else 2
    m = 8
    ranks = chunk_ranks(name, k, v)
    for r, acts in enumerate(_torch_order(name, k, v, m)):
        assert {ranks[c] for c, _, _ in acts} == {r}


@pytest.mark.parametrize(
    "name,k,v,m",
    [("1f1b", 4, 1, 3), ("dualpipev", 2, 2, 3), ("interleaved-1f1b", 4, 2, 9)],
)
def test_preflight_rules_are_torchs(name: str, k: int, v: int, m: int) -> None:
    """What preflight refuses, torch refuses too."""
    assert violations(name, k, v, m, batch_size=m)
    cls = getattr(torch_schedules, TORCH_CLASSES[name])
    with pytest.raises((ValueError, RuntimeError, AssertionError)):
        if name in ("gpipe", "1f1b"):
            cls(_stage(0, k, 1), m)
        else:
            cls([_stage(0, k, v)] * v, m)
