"""ScheduleShape.of builds a (schedule, K, V, M)'s orders at most once, and for GPipe and 1F1B
only when a simulation reads them: the mesh search asks for the same shapes mesh after mesh
and prices most of them by their in-flight counts and bounds alone (DeepSeek-V3's search
spent most of its time building orders no simulation read)."""

from __future__ import annotations

import pytest
from autopipe.planner import chunks
from autopipe.planner.chunks import ScheduleShape
from autopipe.planner.simulate import inflight_counts

from autopipe.core.schedules import rank_orders


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, int]]:
    calls: list[tuple[str, int, int, int]] = []
    real = chunks.rank_orders

    def counting(schedule: str, k: int, v: int, m: int) -> list:  # type: ignore[type-arg]
        calls.append((schedule, k, v, m))
        return real(schedule, k, v, m)

    monkeypatch.setattr(chunks, "rank_orders", counting)
    monkeypatch.setattr(chunks, "_SHAPES", {})
    return calls


def test_shape_orders_built_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    first = ScheduleShape.of("1f1b", 4, 1, 7)
    again = ScheduleShape.of("1f1b", 4, 1, 7)
    other = ScheduleShape.of("1f1b", 4, 1, 8)
    assert calls == []  # 1F1B's in-flight counts need no orders
    assert again.orders == first.orders and again.held == first.held == [4, 3, 2, 1]
    assert other.microbatches == 8 and len(other.orders[0]) == 16
    assert calls == [("1f1b", 4, 1, 7), ("1f1b", 4, 1, 8)]
    # each call owns its lists: changing one shape leaves the next call's alone
    first.orders[0].clear()
    first.held[0] = 99
    third = ScheduleShape.of("1f1b", 4, 1, 7)
    assert len(third.orders[0]) == 14 and third.held[0] == 4
    assert len(calls) == 2


def test_other_schedules_build_their_orders_with_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    ScheduleShape.of("interleaved-1f1b", 2, 2, 4)
    ScheduleShape.of("interleaved-1f1b", 2, 2, 4)
    assert calls == [("interleaved-1f1b", 2, 2, 4)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_closed_form_inflight_counts_equal_the_replayed_ones(schedule: str) -> None:
    for k in range(1, 9):
        for m in range(1, 13):
            shape = ScheduleShape.of(schedule, k, 1, m)
            held, full = inflight_counts(rank_orders(schedule, k, 1, m), k)
            assert shape.held == held, (k, m)
            assert shape.full == [max(f, 1) for f in full], (k, m)
            assert shape.orders == rank_orders(schedule, k, 1, m)


@pytest.mark.parametrize(
    ("schedule", "k", "v", "m"),
    [("gpipe", 3, 1, 5), ("1f1b", 4, 1, 7), ("interleaved-1f1b", 2, 2, 4), ("zbv", 2, 2, 4)],
)
def test_vectorised_replay_gives_the_same_peaks(schedule: str, k: int, v: int, m: int) -> None:
    """chunks.replay_peaks equals simulate.replay_memory to the last bit (the same sums in
    the same order), checkpointed chunks and fractional bytes included."""
    import random

    from autopipe.planner.chunks import replay_peaks
    from autopipe.planner.simulate import ChunkWork, replay_memory

    r = random.Random(k * 100 + m)
    shape = ScheduleShape.of(schedule, k, v, m)
    works = [
        ChunkWork(
            forward_s=1.0, backward_s=2.0, activation_bytes=r.uniform(1, 1e9) / 3,
            input_bytes=r.uniform(1, 1e6) / 7, checkpoint=r.random() < 0.5,
            state_bytes=r.uniform(1, 1e10) / 11,
        )
        for _ in range(shape.num_chunks)
    ]  # fmt: skip
    assert replay_peaks(shape, works) == replay_memory(shape.orders, works, shape.ranks)
