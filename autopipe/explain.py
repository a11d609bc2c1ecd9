"""Why a plan is what it is, in sentences: bottleneck, memory, micro-batches, baselines."""

from __future__ import annotations

from autopipe.humanize import format_bytes, format_seconds
from autopipe.planner.plan import Plan


def explain(plan: Plan) -> str:
    """A few lines a user can read instead of the plan's JSON."""
    lines: list[str] = []
    k, m = plan.num_stages, plan.microbatches
    if not plan.stages:
        return "empty plan"
    bottleneck = max(plan.stages, key=lambda s: s.time_s)
    mean_s = sum(s.time_s for s in plan.stages) / k
    lines.append(
        f"Bottleneck: stage {bottleneck.index} ({bottleneck.first_module} .. {bottleneck.last_module}) "
        f"takes {format_seconds(bottleneck.time_s)} per micro-batch; the mean stage takes "
        f"{format_seconds(mean_s)}, so balance is {100 * mean_s / bottleneck.time_s:.0f}% "
        "(100% = perfectly even)."
    )
    ideal_bubble = (k - 1) / (m + k - 1)
    lines.append(
        f"Micro-batches: M = {m} of {plan.microbatch_size} samples; the fill-drain bubble is "
        f"(K-1)/(M+K-1) = {100 * ideal_bubble:.1f}% for equal stages, {100 * plan.bubble_fraction:.1f}% "
        f"as simulated. GPipe's rule of thumb M >= 4K = {4 * k} is "
        f"{'met' if m >= 4 * k else 'not met'}."
    )
    if plan.memory_per_device:
        fullest = max(plan.stages, key=lambda s: s.memory_bytes)
        share = fullest.memory_bytes / plan.memory_per_device
        lines.append(
            f"Memory: the fullest stage is {fullest.index} with {format_bytes(fullest.memory_bytes)} of "
            f"{format_bytes(plan.memory_per_device)} ({100 * share:.0f}%); memory "
            f"{'binds' if share > 0.9 else 'does not bind'} this plan."
        )
    ckpt = [s.index for s in plan.stages if s.checkpoint]
    lines.append(
        "Re-materialization: "
        + (
            f"stages {', '.join(map(str, ckpt))} recompute their forward in backward."
            if ckpt
            else "none."
        )
    )
    lines.append(
        f"Prediction: {format_seconds(plan.iteration_time_s)} per iteration, {plan.throughput:.4g} "
        f"samples/s, {plan.speedup:.2f}x over one device ({plan.schedule} schedule)."
    )
    for name, b in plan.baselines.items():
        if not b.get("feasible", True):
            lines.append(f"Baseline {name}: does not fit memory.")
        elif b.get("iteration_time_s"):
            lines.append(
                f"Baseline {name}: {format_seconds(b['iteration_time_s'])} per iteration, "
                f"{b['iteration_time_s'] / plan.iteration_time_s:.2f}x autopipe's."
            )
    lines.extend(plan.notes)
    return "\n".join(lines)
