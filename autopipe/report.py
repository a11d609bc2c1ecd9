"""Human-readable text for Plans, Profiles and bench results (the CLI's tables); the
plan's own table is ``autopipe.core.plantext.format_plan`` (``Plan.summary()`` prints it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.core.humanize import format_bytes, format_seconds, printable
from autopipe.core.plantext import ms as _ms
from autopipe.core.plantext import table as _table
from autopipe.core.profile import Profile

__all__ = ["format_bench", "format_profile", "format_scaling"]

if TYPE_CHECKING:
    from autopipe.bench_report import BenchResult


def format_profile(profile: Profile, verbose: bool = False) -> str:
    """The profile as a table, one row per unit; which units share a measurement (one line,
    or one line per shared measurement with ``verbose``)."""
    rows = [
        [
            str(i),
            printable(u.name),
            u.kind,
            _ms(u.forward_s),
            _ms(u.backward_s),
            format_bytes(u.parameter_bytes),
            format_bytes(u.activation_bytes),
            format_bytes(profile.cut_bytes[i]) if i < len(profile.cut_bytes) else "-",
        ]
        for i, u in enumerate(profile.units)
    ]
    header = ["#", "unit", "kind", "fwd ms", "bwd ms", "params", "saved act.", "cut after"]
    head = (
        f"autopipe profile: {profile.model} ({profile.mode}, {profile.tracer} trace) on "
        f"{profile.device}, {profile.dtype}, batch {profile.batch_size}, {len(profile.units)} units"
    )
    text = head + "\n\n" + _table(header, rows, right={0, 3, 4, 5, 6, 7})
    groups = profile.shared_groups()
    if groups:
        verb = "counted" if profile.mode == "analytic" else "measured"
        sharing = sum(len(g) for g in groups.values())
        plural = "s" if len(groups) > 1 else ""
        text += (
            f"\n\nshared         {sharing} units share {len(groups)} measurement{plural} "
            f"(identical computations, {verb} once)"
        )
        if verbose:
            for rep, members in groups.items():
                text += (
                    f"\n  {printable(rep)}: {verb} once for {_span(members)} ({len(members)} units)"
                )
        else:
            text += "; -v lists them"
    if profile.measurement is not None and profile.measurement.meta_init:
        text += "\n\nmeta-init      built on meta, measured one unit at a time"
    if profile.measurement is not None and profile.measurement.compile:
        text += "\n\ncompiled       units timed torch.compile'd (element-wise ops fused)"
    return text


def _span(names: list[str]) -> str:
    """``blocks.1 .. blocks.12`` for a run of numbered names, else the names listed."""
    names = [printable(n) for n in names]
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} .. {names[-1]}"


def format_scaling(rows: list[dict]) -> str:
    """One row per GPU count from ``autopipe.planner.scaling_report``."""
    table = []
    for r in rows:
        if not r["feasible"]:
            table.append([str(r["gpus"]), "does not fit", "", "", "", "", ""])
            continue
        table.append(
            [
                str(r["gpus"]),
                format_seconds(r["iteration_time_s"]),
                f"{r['throughput']:.4g}",
                f"{r['speedup']:.2f}x",
                f"{100 * r['efficiency']:.0f}%",
                str(r["microbatches"]),
                format_bytes(r["max_memory_bytes"]),
            ]
        )
    header = ["K", "iteration", "samples/s", "speedup", "efficiency", "M", "max memory"]
    fits = [r["gpus"] for r in rows if r["feasible"]]
    last = f"fewest GPUs that fit: {fits[0]}" if fits else "no GPU count in this range fits"
    return (
        "scaling with the number of stages\n\n"
        + _table(header, table, right={0, 1, 2, 3, 4, 5, 6})
        + "\n"
        + last
    )


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def format_bench(result: BenchResult) -> str:
    """The bench table: per stage predicted vs measured forward/backward, then the iteration."""
    groups = result.predicted.device_groups()
    plan = result.plan
    clock = "thread-CPU" if result.clock == "thread_cpu" else "wall"
    shared = [g for g in groups if len(g) > 1]
    placement = (
        f"{plan.num_stages} stages on {len(groups)} device(s); simulated as sharing: "
        + ", ".join("stages " + "+".join(map(str, g)) for g in shared)
        if shared
        else f"{plan.num_stages} stages on {len(groups)} dedicated devices"
    )
    lines = [
        f"autopipe bench: {plan.model or 'model'}, M = {plan.microbatches} x "
        f"{plan.microbatch_size} samples, {plan.schedule}, {result.steps} measured steps",
        placement,
        "",
        _bench_table(result),
        "",
        f"per micro-batch on the {clock} clock; medians over micro-batches and steps; err = "
        "(predicted - measured) / measured; the last stage includes the loss "
        + (
            "(run once per batch by the executor, divided by M)"
            if plan.schedule == "gpipe"
            else f"(run per micro-batch in its forward and backward, in {plan.schedule}'s order)"
        ),
        f"iteration      predicted {result.iteration_predicted_s * 1e3:.1f} ms, measured "
        f"{result.iteration_measured_s * 1e3:.1f} ms {clock} ({_pct(result.iteration_error)}); "
        f"wall {result.iteration_wall_s * 1e3:.1f} ms, whole step incl. optimizer "
        f"{result.step_measured_s * 1e3:.1f} ms wall",
        f"largest stage error {100 * result.max_stage_error:.1f}%",
    ]
    of, ob = result.executor_overhead_s
    if of or ob:
        lines.insert(
            -2,
            f"predictions include the executor's cost per task, calibrated on tiny stages: "
            f"forward {of * 1e6:.0f} us, backward {ob * 1e6:.0f} us",
        )
    if shared:
        lines.append(
            f"the plan's own prediction (one dedicated device per stage) is "
            f"{plan.iteration_time_s * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def _bench_table(result: BenchResult) -> str:
    """Per stage, predicted and measured forward and backward ms and their errors."""
    rows = []
    for s in result.stages:
        rows.append(
            [
                str(s.stage),
                s.device,
                _ms(s.forward_predicted_s),
                _ms(s.forward_measured_s),
                _pct(s.forward_error),
                _ms(s.backward_predicted_s),
                _ms(s.backward_measured_s),
                _pct(s.backward_error),
            ]
        )
    header = [
        "stage",
        "device",
        "fwd pred ms",
        "fwd meas ms",
        "err",
        "bwd pred ms",
        "bwd meas ms",
        "err",
    ]
    return _table(header, rows, right={0, 2, 3, 4, 5, 6, 7})
