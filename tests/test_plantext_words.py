"""The plan report's words read one way (#36, "the report, read right"): the solver is not
called "dp", batch and iteration say which they mean, and a plan that reads wrong at first
sight (no faster than one device, slower than a framework's default) says why and what to do."""

from __future__ import annotations

from autopipe.planner import plan
from planner_instances import random_profile

from autopipe.core.plan import replace_plan
from autopipe.core.plantext import format_plan
from autopipe.core.request import PlanRequest
from autopipe.explain import explain


def test_the_solver_is_named_in_words_and_one_stage_is_singular() -> None:
    """Before: "on 1 stages (dp, measured costs)", dp read as data parallel."""
    one = plan(random_profile(4, 1), PlanRequest(gpus=1, microbatches=1, baselines=False))
    title = format_plan(one).splitlines()[0]
    assert " on 1 stage (dynamic-programming cut, measured costs)" in title
    four = plan(random_profile(8, 1), PlanRequest(gpus=4, microbatches=4, baselines=False))
    assert " on 4 stages (dynamic-programming cut, " in format_plan(four).splitlines()[0]
    assert "(dp)" not in explain(four) and "(dynamic programming)" in explain(four)


def test_batch_and_iteration_say_which_they_mean_with_replicas() -> None:
    """Before: "(batch 8)" per replica beside "the global batch of 16", and "iteration"
    both with and without the all-reduce."""
    p = plan(random_profile(8, 2), PlanRequest(gpus=2, microbatches=4, baselines=False))
    dp = replace_plan(
        p,
        data_parallel=2,
        pipeline_iteration_s=p.iteration_time_s,
        allreduce_s=0.001,
        iteration_time_s=p.iteration_time_s + 0.001,
    )
    text = format_plan(dp)
    assert f"(batch {p.batch_size} per replica, {2 * p.batch_size} global over dp 2)" in text
    assert "(iteration = one training step: the pipeline's " in text
    assert ": pipeline iteration " in text  # the planner's note names the pipeline's own
    assert "per replica" not in format_plan(p) and "one training step" not in format_plan(p)
    # explain says the same (before: its "per iteration" was the step, its notes' the pipeline)
    assert "per iteration, " in explain(dp) and "(iteration = one training step: " in explain(dp)
    assert "one training step" not in explain(p)


def test_a_plan_no_faster_than_one_device_says_why_and_what_to_do() -> None:
    p = plan(random_profile(8, 3), PlanRequest(gpus=4, microbatches=1, baselines=False))
    slow = replace_plan(p, speedup=0.99)
    for text in (format_plan(slow), explain(slow)):
        assert "this plan is no faster than one device (0.99x)" in text
        assert "--batch-size" in text and "fewer GPUs" in text
    assert "no faster than one device" not in format_plan(replace_plan(p, speedup=2.5))


def test_a_framework_default_faster_than_the_plan_says_why() -> None:
    p = plan(random_profile(8, 4), PlanRequest(gpus=4, microbatches=8))
    faster = dict(p.baselines)
    faster["deepspeed-parameters"] = {
        **faster.get("deepspeed-parameters", {}),
        "iteration_time_s": 0.8 * p.iteration_time_s,
        "feasible": True,
        "schedule": "1f1b",
        "virtual_stages": 1,
    }
    text = format_plan(replace_plan(p, baselines=faster))
    assert 'DeepSpeed 0.19 ("parameters") is faster than this plan (0.80x its iteration)' in text
    assert "it runs 1f1b" in text and "--schedule auto" in text
    slower = {k: {**b, "iteration_time_s": 1.2 * p.iteration_time_s} for k, b in faster.items()}
    assert "is faster than this plan" not in format_plan(replace_plan(p, baselines=slower))


def test_a_one_unit_stage_is_named_once() -> None:
    """Before: "head .. head" for a stage holding one unit, in the table, the bottleneck
    note and explain's bottleneck line."""
    import re

    p = plan(random_profile(4, 5), PlanRequest(gpus=4, microbatches=4, baselines=False))
    assert all(len(s.units) == 1 for s in p.stages)
    for text in (format_plan(p), explain(p)):
        repeated = re.findall(r"([^\s()]+) \.\. ([^\s()]+)", text)
        assert not [pair for pair in repeated if pair[0] == pair[1]], repeated
        assert f"{p.stages[0].units[0]} (1)" in format_plan(p)
