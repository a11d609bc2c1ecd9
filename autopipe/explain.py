"""Why a plan is what it is, in sentences: bottleneck, memory, micro-batches, baselines."""

from __future__ import annotations

from autopipe.core.humanize import format_bytes, format_seconds, printable
from autopipe.core.plan import Plan
from autopipe.core.plantext import advice_notes, framework_table, module_span, optimizer_words
from autopipe.core.vocabulary import FRAMEWORK_DEFAULTS, SINGLE_SCHEDULES, V_SHAPE_SCHEDULES
from autopipe.planner.simulate import fill_drain_bubble


def explain(plan: Plan) -> str:
    """A few lines a user can read instead of the plan's JSON."""
    if not plan.stages:
        return "empty plan"
    lines = [_bottleneck_line(plan), _microbatch_line(plan)]
    lines += _schedule_lines(plan)
    lines += _lower_bound_lines(plan)
    lines += _memory_lines(plan)
    lines.append(_rematerialization_line(plan))
    step = ""
    if plan.data_parallel > 1 and plan.pipeline_iteration_s > 0:  # the table's words: one meaning
        step = (
            f" (iteration = one training step: the pipeline's "
            f"{format_seconds(plan.pipeline_iteration_s)} + exposed DP communication "
            f"{format_seconds(plan.allreduce_s)}{optimizer_words(plan)}; notes that say "
            "pipeline mean the first)"
        )
    lines.append(
        f"Prediction: {format_seconds(plan.iteration_time_s)} per iteration, {plan.throughput:.4g} "
        f"samples/s, {plan.speedup:.2f}x over one device ({plan.schedule} schedule){step}."
    )
    lines += _baseline_lines(plan)
    table = framework_table(plan)
    if table:
        where = "same profile"
        if plan.mesh is not None:
            where = (
                f"same mesh pp {plan.num_stages} x dp {plan.data_parallel} x tp "
                f"{plan.tensor_parallel}, DP communication included"
            )
        lines += ["", f"What each framework's default split would cost here ({where}):"]
        lines += table
        lines.append("")
    lines.extend(printable(note) for note in [*advice_notes(plan), *plan.notes])
    return "\n".join(lines)


def _bottleneck_line(plan: Plan) -> str:
    """The slowest stage (or chunk) against the mean one."""
    bottleneck = max(plan.stages, key=lambda s: s.time_s)
    mean_s = sum(s.time_s for s in plan.stages) / len(plan.stages)
    what = "chunk" if plan.virtual_stages > 1 else "stage"
    return (
        f"Bottleneck: {what} {bottleneck.index} "
        f"({module_span(bottleneck.first_module, bottleneck.last_module)}) "
        f"takes {format_seconds(bottleneck.time_s)} per micro-batch; the mean {what} takes "
        f"{format_seconds(mean_s)}, so balance is {100 * mean_s / bottleneck.time_s:.0f}% "
        "(100% = perfectly even)."
    )


def _microbatch_line(plan: Plan) -> str:
    """M, the fill-drain bubble (ideal and simulated) and GPipe's M >= 4K."""
    k, m = plan.num_stages, plan.microbatches
    ideal_bubble = fill_drain_bubble(m, k)
    return (
        f"Micro-batches: M = {m} of {plan.microbatch_size} samples; the fill-drain bubble is "
        f"(K-1)/(M+K-1) = {100 * ideal_bubble:.1f}% for equal stages, {100 * plan.bubble_fraction:.1f}% "
        f"as simulated. GPipe's rule of thumb M >= 4K = {4 * k} is "
        f"{'met' if m >= 4 * k else 'not met'}."
    )


def _schedule_lines(plan: Plan) -> list[str]:
    """The interleaved schedule's chunks and bubble (none for a one-chunk schedule)."""
    k, m, v = plan.num_stages, plan.microbatches, plan.virtual_stages
    if not (v > 1 or plan.schedule not in SINGLE_SCHEDULES):
        return []
    placement = "V-shape" if plan.schedule in V_SHAPE_SCHEDULES else "loop"
    return [
        f"Schedule: {plan.schedule} with V = {v} virtual stages per rank ({k} x {v} = "
        f"{len(plan.stages)} chunks, {placement} placement); interleaving cuts the "
        f"bubble to about (K-1)/(V M) = {100 * (k - 1) / (v * m):.1f}%"
        + (", and the split backward (B, W) fills most of it." if _splits(plan) else ".")
    ]


def _lower_bound_lines(plan: Plan) -> list[str]:
    """The proven lower bound and the plan's gap to it (none without a bound)."""
    k, m, v = plan.num_stages, plan.microbatches, plan.virtual_stages
    if not plan.lower_bound_s > 0:
        return []
    how = f" Method: {plan.method}." if plan.method else ""
    return [
        f"Lower bound: no cut of this model into {k} x {v} chunks with {plan.schedule} at "
        f"M = {m} is faster than {format_seconds(plan.lower_bound_s)} (proven: the work, "
        "heaviest-unit and critical-path bounds); this plan is "
        f"{format_seconds(plan.iteration_time_s)}, a gap of at most "
        f"{100 * plan.lower_bound_gap:.1f}%.{how}"
        + (
            " With one chunk per rank the cut itself is exact; the gap is the bubble, "
            "which the bound leaves out."
            if v == 1
            else ""
        )
    ]


def _memory_lines(plan: Plan) -> list[str]:
    """The fullest rank's replayed peak (else the fullest stage) against the device's memory;
    none without a memory limit."""
    if plan.memory_per_device and plan.rank_peak_bytes:
        r = max(range(len(plan.rank_peak_bytes)), key=lambda i: plan.rank_peak_bytes[i])
        peak = plan.rank_peak_bytes[r]
        share = peak / plan.memory_per_device
        return [
            f"Memory: the fullest rank is {r} with a replayed peak of {format_bytes(peak)} of "
            f"{format_bytes(plan.memory_per_device)} ({100 * share:.0f}%, headroom not "
            f"included); memory {'binds' if share > 0.9 else 'does not bind'} this plan."
        ]
    if plan.memory_per_device:
        fullest = max(plan.stages, key=lambda s: s.memory_bytes)
        share = fullest.memory_bytes / plan.memory_per_device
        return [
            f"Memory: the fullest stage is {fullest.index} with {format_bytes(fullest.memory_bytes)} of "
            f"{format_bytes(plan.memory_per_device)} ({100 * share:.0f}%); memory "
            f"{'binds' if share > 0.9 else 'does not bind'} this plan."
        ]
    return []


def _rematerialization_line(plan: Plan) -> str:
    """Which stages recompute their forward, and which of them one unit at a time."""
    ckpt = [s.index for s in plan.stages if s.checkpoint]
    per_unit = [s.index for s in plan.stages if s.checkpoint and s.checkpoint_granularity == "unit"]
    return "Re-materialization: " + (
        f"stages {', '.join(map(str, ckpt))} recompute their forward in backward"
        + (
            f" (stages {', '.join(map(str, per_unit))} one unit at a time, keeping each "
            "unit's input)."
            if per_unit
            else "."
        )
        if ckpt
        else "none."
    )


def _baseline_lines(plan: Plan) -> list[str]:
    """Each baseline that is not a framework default (those are in the table) against the plan."""
    lines = []
    for name, b in plan.baselines.items():
        if name in FRAMEWORK_DEFAULTS:
            continue  # in the table below
        if not b.get("feasible", True):
            lines.append(f"Baseline {name}: {b.get('reason') or 'does not fit memory'}.")
        elif b.get("iteration_time_s"):
            lines.append(
                f"Baseline {name}: {format_seconds(b['iteration_time_s'])} per iteration, "
                f"{b['iteration_time_s'] / plan.iteration_time_s:.2f}x autopipe's."
            )
    return lines


def _splits(plan: Plan) -> bool:
    return any(s.backward_weight_s > 0 for s in plan.stages)
