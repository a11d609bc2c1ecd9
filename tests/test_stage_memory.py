"""One owner for a stage's peak memory per device: ``planner/costs.py:stage_memory``.

Every path that decides whether a segment fits (the scalar ``CostModel.segment``, its
``segment_memory_need``, the vectorised ``cost_matrix`` and ``segment_times``, the prober and
the ILP) prices memory through it: with ``stage_memory`` replaced by one that charges more
bytes, every path's answer changes. A path that computed memory by its own formula would keep
its answer, and this test would fail.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from autopipe.planner import costs, ilp
from autopipe.planner.costs import CostModel, StageMemory
from autopipe.planner.probe import _Prober
from planner_instances import cost_model, random_cluster, random_profile

MEMORY_BYTES = 10**12
"""Every device's memory (about; random_cluster scales it by 0.5..1.5): the whole model fits."""


def _model(checkpoint: str) -> CostModel:
    return cost_model(
        random_profile(12, 3), random_cluster(3, 5, MEMORY_BYTES), 4, "1f1b", checkpoint
    )


def _answers(checkpoint: str) -> dict[str, Any]:
    """Each path's answer on a fresh cost model (nothing cached from another run)."""
    cm = _model(checkpoint)
    n = cm.n_units
    i, j = np.array([0, 2, 5]), np.array([n, 9, 11])
    found = ilp.ilp_partition(_model(checkpoint), time_limit_s=20)
    return {
        "segment": cm.segment(0, 0, n).feasible,
        "segment_memory_need": cm.segment_memory_need(1, 0, n),
        "cost_matrix": np.isfinite(cm.cost_matrix(2)).sum(),
        "segment_times": np.isfinite(cm.segment_times(1, i, j)).sum(),
        "prober": _Prober(_model(checkpoint)).probe(math.inf) is not None,
        "ilp": found is not None,
    }


@pytest.mark.parametrize("checkpoint", ["never", "always", "auto"])
def test_every_memory_path_prices_through_stage_memory(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str
) -> None:
    real = costs.stage_memory
    before = _answers(checkpoint)
    assert before["segment"] and before["prober"] and before["ilp"]  # everything fits

    def heavier(state_bytes: Any, *rest: Any) -> StageMemory:
        # the training state of every segment grows past any device's memory
        return real(state_bytes + 4 * MEMORY_BYTES, *rest)

    # the ILP holds the name it imported; setattr refuses a module that dropped it
    monkeypatch.setattr(costs, "stage_memory", heavier)
    monkeypatch.setattr(ilp, "stage_memory", heavier)
    after = _answers(checkpoint)
    changed = {path for path in before if before[path] != after[path]}
    assert changed == set(before), f"not priced by stage_memory: {set(before) - changed}"


def test_stage_memory_options_by_hand() -> None:
    mem = costs.stage_memory(100.0, 10.0, 2.0, 5.0, lambda: 4.0, 3, 1)
    assert mem.kept_bytes == 30.0  # 3 micro-batches' activations
    assert mem.per_stage_bytes == 10.0 + 2.0 * 3  # one re-computed, 3 stage inputs
    assert mem.per_unit_bytes == 4.0 + 5.0 * 3  # the largest unit, 3 x every unit's input
