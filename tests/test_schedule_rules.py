"""autopipe/core/schedule_rules.py: torch's schedule rules, one line each, before a plan is written."""

from __future__ import annotations

import dataclasses

import pytest
from autopipe.planner import plan
from autopipe.planner.errors import RuleViolation, check_plan
from planner_instances import random_profile

from autopipe.core.errors import UsageError
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import RULES, preflight, violations


@pytest.mark.parametrize(
    ("args", "kw", "expected"),
    [
        (("gpipe", 4, 1, 8, 32), {}, []),
        (
            ("gpipe", 4, 2, 8, 32),
            {},
            ["stages-per-rank: ScheduleGPipe: gpipe runs one stage per rank (virtual_stages=1), not 2"],
        ),
        (
            ("zbv", 2, 3, 8, 32),
            {},
            ["stages-per-rank: ScheduleZBVZeroBubble: zbv runs exactly 2 stages per rank (virtual_stages=2), not 3"],
        ),
        (
            ("1f1b", 4, 1, 2, 32),
            {},
            ["microbatches-vs-stages: Schedule1F1B needs at least as many micro-batches as pipeline stages, M >= 4 (4 ranks x 1), got M=2"],
        ),
        (
            ("dualpipev", 2, 2, 3, 3),
            {},
            ["microbatches-vs-stages: ScheduleDualPipeV needs at least as many micro-batches as pipeline stages, M >= 4 (2 ranks x 2), got M=3"],
        ),
        (
            ("interleaved-1f1b", 4, 2, 9, 36),
            {},
            ["rounds: ScheduleInterleaved1F1B runs M in max(1, M // K) = 2 rounds and needs M % 2 == 0, got M=9 with K=4"],
        ),
        (("looped-bfs", 4, 2, 9, 36), {}, []),  # no rounds rule
        (
            ("gpipe", 2, 1, 64, 32),
            {},
            ["batch-vs-microbatches: M=64 micro-batches need a batch of at least 64 samples, got 32"],
        ),
        (
            ("gpipe", 2, 1, 5, 32),
            {},
            ["batch-vs-microbatches: M=5 does not divide the batch of 32 into equal micro-batches"],
        ),
        (
            ("interleaved-zb", 2, 2, 4, 32),
            {"compile": True},
            ["no-compile-with-zero-bubble: ScheduleInterleavedZeroBubble splits backward into input and weight gradients, which torch does not support for torch.compile'd stages"],
        ),
        (("interleaved-1f1b", 2, 2, 4, 32), {"compile": True}, []),
    ],
)  # fmt: skip
def test_each_rule_is_one_line_naming_it(args: tuple, kw: dict, expected: list[str]) -> None:
    got = violations(*args, **kw)
    assert got == expected
    assert all(line.split(":")[0] in RULES and "\n" not in line for line in got)


def test_several_rules_at_once_and_check_plan_counts_the_rest() -> None:
    assert [v.split(":")[0] for v in violations("1f1b", 4, 1, 3, 2)] == [
        "microbatches-vs-stages",
        "batch-vs-microbatches",
    ]
    p = plan(random_profile(6, 0), PlanRequest(gpus=2, microbatches=4, schedule="1f1b"))
    assert preflight(p) == []
    check_plan(p)
    bad = dataclasses.replace(p, microbatches=1, microbatch_size=32)
    with pytest.raises(RuleViolation) as info:
        check_plan(bad)
    assert str(info.value).startswith("microbatches-vs-stages: Schedule1F1B")
    assert isinstance(info.value, UsageError)  # bad input: the CLI exits 2
    two = dataclasses.replace(p, microbatches=1, batch_size=0)  # fewer samples than M too
    with pytest.raises(RuleViolation, match=r"\(and 1 more\)$"):
        check_plan(two)


def test_chunks_off_their_torch_rank_are_a_placement_violation() -> None:
    p = plan(
        random_profile(8, 1),
        PlanRequest(gpus=2, microbatches=4, schedule="zbv", baselines=False),
    )
    assert preflight(p) == [] and [s.rank for s in p.stages] == [0, 1, 1, 0]
    looped = [dataclasses.replace(s, rank=[0, 1, 0, 1][i]) for i, s in enumerate(p.stages)]
    assert preflight(dataclasses.replace(p, stages=looped)) == [
        "placement: ScheduleZBVZeroBubble places chunks on ranks [0, 1, 1, 0], the plan on [0, 1, 0, 1]"
    ]
