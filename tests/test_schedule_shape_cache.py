"""ScheduleShape.of builds a (schedule, K, V, M)'s orders once: the mesh search asks for the
same shapes mesh after mesh (DeepSeek-V3's search spent most of its time rebuilding them)."""

from __future__ import annotations

import pytest
from autopipe.planner import chunks
from autopipe.planner.chunks import ScheduleShape


def test_shape_orders_built_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int, int]] = []
    real = chunks.rank_orders

    def counting(schedule: str, k: int, v: int, m: int) -> list:  # type: ignore[type-arg]
        calls.append((schedule, k, v, m))
        return real(schedule, k, v, m)

    monkeypatch.setattr(chunks, "rank_orders", counting)
    monkeypatch.setattr(chunks, "_SHAPES", {})
    first = ScheduleShape.of("1f1b", 4, 1, 7)
    again = ScheduleShape.of("1f1b", 4, 1, 7)
    other = ScheduleShape.of("1f1b", 4, 1, 8)
    assert calls == [("1f1b", 4, 1, 7), ("1f1b", 4, 1, 8)]
    assert again.orders == first.orders and again.held == first.held == [4, 3, 2, 1]
    assert other.microbatches == 8 and len(other.orders[0]) == 16
    # each call owns its lists: changing one shape leaves the next call's alone
    first.orders[0].clear()
    first.held[0] = 99
    third = ScheduleShape.of("1f1b", 4, 1, 7)
    assert len(third.orders[0]) == 14 and third.held[0] == 4
    assert len(calls) == 2
