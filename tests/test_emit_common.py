"""planner/emit_common.py: what every emitter reads of a plan, and its one error."""

from __future__ import annotations

import dataclasses

import pytest
from autopipe.planner import plan
from autopipe.planner.emit_common import (
    EmitError,
    checkpointed,
    checkpointed_per_stage,
    require_schedule,
)
from planner_instances import random_profile

from autopipe.core.errors import UsageError
from autopipe.core.request import PlanRequest


def test_schedule_names_and_checkpointed_chunks() -> None:
    p = plan(
        random_profile(8, 0),
        PlanRequest(gpus=4, microbatches=4, checkpoint="except_last", baselines=False),
    )
    assert require_schedule(p, {"gpipe": "GPipe"}, "X") == "GPipe"
    with pytest.raises(EmitError, match=r"^Megatron has no schedule for autopipe's 'gpipe'$"):
        require_schedule(p, {"1f1b": "1F1B"}, "Megatron")
    assert issubclass(EmitError, UsageError)  # the CLI exits 2
    assert checkpointed(p) == [0, 1, 2]
    stages = [
        dataclasses.replace(s, checkpoint_granularity="unit" if s.index == 1 else "stage")
        for s in p.stages
    ]
    assert checkpointed_per_stage(dataclasses.replace(p, stages=stages)) == [0, 2]
