"""planner/planning.py: the planner's front door."""

from __future__ import annotations

import pytest
from autopipe.planner import PlanningError, plan
from planner_instances import random_profile

from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest


def test_it_takes_a_request_and_a_profile_with_units() -> None:
    with pytest.raises(TypeError, match=r"^plan\(\) takes a PlanRequest, not dict: "):
        plan(random_profile(3, 0), {"gpus": 2})  # type: ignore[arg-type]
    empty = Profile(units=[], cut_bytes=[], batch_size=8)
    with pytest.raises(PlanningError, match="^the profile has no units; profile a model"):
        plan(empty, PlanRequest(gpus=1))


def test_a_mesh_request_goes_to_the_mesh_search() -> None:
    profile = random_profile(6, 1)
    pipeline = plan(profile, PlanRequest(gpus=2, microbatches=4, baselines=False))
    assert pipeline.mesh is None and pipeline.data_parallel == 1
    mesh = plan(profile, PlanRequest(gpus=4, microbatches=4, data_parallel=2, baselines=False))
    assert mesh.mesh is not None and mesh.data_parallel == 2 and mesh.world_size == 4
