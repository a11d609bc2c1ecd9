"""autopipe/explain.py: the sentences ``autopipe explain`` prints, with the plan's figures."""

from __future__ import annotations

import dataclasses

from autopipe.planner import Cluster, plan
from planner_instances import random_profile

from autopipe.core.humanize import format_bytes, format_seconds
from autopipe.core.request import PlanRequest
from autopipe.explain import explain


def _line(text: str, start: str) -> str:
    (found,) = [line for line in text.splitlines() if line.startswith(start)]
    return found


def test_the_bottleneck_bubble_and_prediction_sentences() -> None:
    p = plan(random_profile(8, 3), PlanRequest(gpus=4, microbatches=8, baselines=False))
    text = explain(p)
    b = max(p.stages, key=lambda s: s.time_s)
    mean = sum(s.time_s for s in p.stages) / 4
    # One module is named once: "(layer7)", never "(layer7 .. layer7)" (#36).
    span = (
        b.first_module
        if b.first_module == b.last_module
        else f"{b.first_module} .. {b.last_module}"
    )
    assert "(layer7 .. layer7)" not in text and ".. " + b.first_module + ")" not in text
    assert _line(text, "Bottleneck:").startswith(
        f"Bottleneck: stage {b.index} ({span}) takes "
        f"{format_seconds(b.time_s)} per micro-batch; the mean stage takes {format_seconds(mean)}, "
        f"so balance is {100 * mean / b.time_s:.0f}%"
    )
    assert _line(text, "Micro-batches:") == (
        f"Micro-batches: M = 8 of 4 samples; the fill-drain bubble is (K-1)/(M+K-1) = 27.3% for "
        f"equal stages, {100 * p.bubble_fraction:.1f}% as simulated. GPipe's rule of thumb "
        "M >= 4K = 16 is not met."
    )
    assert _line(text, "Prediction:") == (
        f"Prediction: {format_seconds(p.iteration_time_s)} per iteration, {p.throughput:.4g} "
        f"samples/s, {p.speedup:.2f}x over one device (gpipe schedule)."
    )
    assert _line(text, "Re-materialization:") == "Re-materialization: none."
    assert not any(line.startswith(("Schedule:", "Memory:")) for line in text.splitlines())


def test_memory_and_rematerialization_sentences() -> None:
    cluster = Cluster.homogeneous(2, memory_bytes=4 * 10**8)
    p = plan(
        random_profile(6, 1),
        PlanRequest(cluster=cluster, microbatches=4, checkpoint="always", baselines=False),
    )
    text = explain(p)
    r = max(range(2), key=lambda i: p.rank_peak_bytes[i])
    assert _line(text, "Memory:").startswith(
        f"Memory: the fullest rank is {r} with a replayed peak of {format_bytes(p.rank_peak_bytes[r])} "
        f"of {format_bytes(4 * 10**8)}"
    )
    assert _line(text, "Re-materialization:").startswith(
        "Re-materialization: stages 0, 1 recompute their forward in backward"
    )
    stages = [dataclasses.replace(s, checkpoint_granularity="unit") for s in p.stages]
    again = explain(dataclasses.replace(p, stages=stages))
    assert _line(again, "Re-materialization:").endswith(
        "(stages 0, 1 one unit at a time, keeping each unit's input)."
    )


def test_looped_schedules_and_baselines_are_explained() -> None:
    p = plan(
        random_profile(8, 2),
        PlanRequest(gpus=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
    )
    text = explain(p)
    assert _line(text, "Schedule:").startswith(
        "Schedule: interleaved-1f1b with V = 2 virtual stages per rank (2 x 2 = 4 chunks, loop "
        "placement); interleaving cuts the bubble to about (K-1)/(V M) = 12.5%"
    )
    assert _line(text, "Bottleneck:").startswith("Bottleneck: chunk ")
    u = p.baselines["uniform"]
    assert u["feasible"] and u["iteration_time_s"]
    assert _line(text, "Baseline uniform:") == (
        f"Baseline uniform: {format_seconds(u['iteration_time_s'])} per iteration, "
        f"{u['iteration_time_s'] / p.iteration_time_s:.2f}x autopipe's."
    )
    assert "What each framework's default split would cost here (same profile):" in text
    assert all(note in text for note in p.notes)
