"""PlanRequest validates its fields when it is built (issue 37): one clear line per bad
field, a ``RuleViolation`` (a ``ValueError`` and the planner's own error), so the CLI builds
the request before any profiling and refuses bad input in one line, exit 2."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

import pytest
from autopipe.planner.search import STRATEGIES
from test_cli_errors import GPT, _err_line

from autopipe import profiling
from autopipe.cli import main
from autopipe.core.errors import PlanningError, RuleViolation
from autopipe.core.request import Checkpoint, PlanRequest, Schedule, Shard, Strategy
from autopipe.core.vocabulary import CHECKPOINT_MODES, PLAN_SCHEDULES, SHARD_MODES

BAD = [
    ({"gpus": 0}, "gpus=0 must be a positive integer"),
    ({"gpus": True}, "gpus=True must be a positive integer"),
    ({"batch_size": -3}, "batch_size=-3 must be a positive integer"),
    ({"gpus_per_node": 0}, "gpus_per_node=0 must be a positive integer"),
    ({"microbatches": 0}, "microbatches=0 must be a positive integer"),
    ({"microbatches": (4, 0)}, "microbatches=0 must be a positive integer"),
    ({"microbatches": "many"}, "microbatches='many': give 'auto', an integer"),
    ({"microbatches": []}, "microbatches is an empty list"),
    ({"schedule": "zb"}, "schedule='zb' is not valid; use one of 'gpipe'"),
    ({"virtual_stages": 0}, "virtual_stages=0 must be 'auto' or a positive integer"),
    ({"schedule": "gpipe", "virtual_stages": 2}, "stages-per-rank: gpipe runs one stage"),
    ({"schedule": "zbv", "virtual_stages": 3}, "stages-per-rank: zbv runs exactly 2"),
    ({"checkpoint": "sometimes"}, "checkpoint='sometimes' is not valid"),
    ({"strategy": "magic"}, "strategy='magic' is not valid"),
    ({"optimizer": "lion"}, "optimizer='lion' is not valid"),
    ({"bytes_per_parameter": 0}, "bytes_per_parameter=0 must be positive"),
    ({"memory_per_device": -1}, "memory_per_device=-1 must be a positive number of bytes"),
    ({"headroom": float("nan")}, "headroom=nan must be a fraction >= 0"),
    ({"time_limit_s": 0}, "time_limit_s=0 must be a positive number of seconds"),
    ({"tensor_parallel": 0}, "tensor_parallel=0 must be 'auto' or a positive integer"),
    ({"data_parallel": "two"}, "data_parallel='two' must be 'auto' or a positive integer"),
    ({"shard": "everything"}, "shard='everything' is not valid"),
    ({"inter_node_bandwidth_bytes_per_s": float("inf")}, "must be a positive number of bytes"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_a_bad_field_is_refused_when_built(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RuleViolation) as info:
        PlanRequest(**fields)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PlanningError)
    assert info.value.field in fields  # type: ignore[attr-defined]


def test_replace_validates_too() -> None:
    with pytest.raises(RuleViolation, match="schedule='nope'"):
        dataclasses.replace(PlanRequest(gpus=2), schedule="nope")  # type: ignore[arg-type]


def test_good_requests_are_kept_as_given() -> None:
    r = PlanRequest(gpus=4, microbatches=[8, 2], optimizer="SGD_Momentum")  # type: ignore[arg-type]
    assert r.microbatches == (8, 2) and r.optimizer == "SGD_Momentum"
    assert PlanRequest(microbatches="4", schedule="auto", virtual_stages=3).virtual_stages == 3
    assert PlanRequest(tensor_parallel="auto", data_parallel="auto", shard="auto").plans_mesh


def test_the_literals_are_the_vocabulary() -> None:
    assert get_args(Schedule) == (*PLAN_SCHEDULES, "auto")
    assert get_args(Checkpoint) == CHECKPOINT_MODES
    assert get_args(Strategy) == STRATEGIES
    assert get_args(Shard) == (*SHARD_MODES, "auto")


def test_cli_refuses_a_bad_request_before_profiling(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_profiling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("profiled before the request was checked")

    monkeypatch.setattr(profiling, "profile_model_file", no_profiling)
    for flags, words in (
        (["--schedule", "gpipe", "--virtual-stages", "2"], "stages-per-rank: gpipe runs one"),
        (["--schedule", "zbv", "--virtual-stages", "3"], "stages-per-rank: zbv runs exactly"),
        (["--schedule", "dualpipev", "--virtual-stages", "1"], "stages-per-rank: dualpipev"),
    ):
        assert main(["plan", GPT, "--gpus", "2", *flags]) == 2
        line = _err_line(capsys)
        assert words in line, line
