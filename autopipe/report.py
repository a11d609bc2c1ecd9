"""Human-readable text for Plans, Profiles and bench results (the CLI's tables)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.core.humanize import format_bytes, format_seconds, printable
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.explain import framework_table
from autopipe.planner.baselines import FRAMEWORK_DEFAULTS

if TYPE_CHECKING:
    from autopipe.bench import BenchResult


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def format_plan(plan: Plan) -> str:
    """The plan as a table, one row per stage, then the pipeline-level figures."""
    bottleneck_s = max((s.time_s for s in plan.stages), default=0.0) or 1.0
    rows = []
    for s in plan.stages:
        first, last = printable(s.first_module), printable(s.last_module)
        span = first if s.first_module == s.last_module else f"{first} .. {last}"
        rows.append(
            [
                str(s.index) if plan.virtual_stages == 1 else f"{s.index} (rank {s.rank})",
                s.device,
                f"{span} ({len(s.units)})",
                _ms(s.forward_s),
                _ms(s.backward_s + s.recompute_s),
                _ms(s.send_s),
                "yes" if s.checkpoint else "no",
                format_bytes(s.memory_bytes),
                f"{100 * s.time_s / bottleneck_s:.0f}%",
            ]
        )
    header = [
        "stage",
        "device",
        "modules (units)",
        "fwd ms",
        "bwd ms",
        "send ms",
        "ckpt",
        "memory",
        "load",
    ]
    where = (
        f"{plan.num_stages} stages"
        if plan.virtual_stages == 1
        else f"{plan.num_stages} ranks x {plan.virtual_stages} virtual stages"
    )
    lines = [
        f"autopipe plan: {plan.model or 'model'} on {where} "
        f"({plan.strategy}, {plan.profile_mode} costs)",
        "",
        _table(header, rows, right={0, 3, 4, 5, 7, 8}),
        "",
        "times are per micro-batch; load = stage time / bottleneck stage time",
        f"micro-batches  M = {plan.microbatches} x {plan.microbatch_size} samples "
        f"(batch {plan.batch_size}), schedule {plan.schedule}",
        f"iteration      {format_seconds(plan.iteration_time_s)} predicted, "
        f"{plan.throughput:.4g} samples/s, {plan.speedup:.2f}x over one device",
        f"bubble         {100 * plan.bubble_fraction:.1f}% idle",
    ]
    if plan.lower_bound_s > 0:
        lines.append(
            f"lower bound    {format_seconds(plan.lower_bound_s)} (proven, any cut at this "
            f"schedule, V and M); gap at most {100 * plan.lower_bound_gap:.1f}%"
            + (
                " (the cut is exact at V = 1: the bound leaves out the bubble)"
                if plan.virtual_stages == 1
                else ""
            )
        )
    if plan.memory_per_device:
        lines.append(f"memory limit   {format_bytes(plan.memory_per_device)} per device")
    shared = plan.host_throughput
    if shared is not None:
        lines.append(
            f"host           the {plan.num_stages} ranks share one host that runs {shared:g} "
            "of them at full speed (simulated as processor sharing)"
        )
    if plan.state_bytes_per_parameter:
        lines.append(f"training state {_training_state(plan)}")
    own = {k: v for k, v in plan.baselines.items() if k not in FRAMEWORK_DEFAULTS}
    if own:
        names = ["autopipe", *own]
        times: list[float | None] = [plan.iteration_time_s]
        for b in own.values():
            times.append(b.get("iteration_time_s") if b.get("feasible", True) else None)
        ratio = " / ".join(
            "infeasible" if t is None else f"{t / plan.iteration_time_s:.2f}" for t in times
        )
        lines.append(f"vs baselines   {' vs '.join(names)}: {ratio} x iteration time")
    if "mesh" in plan.meta:
        lines += ["", format_mesh(plan)]
    table = framework_table(plan)
    if table:
        lines += ["", "framework defaults on the same devices (predicted):", *table, ""]
    for note in plan.notes:
        lines.append(f"note           {printable(note)}")  # notes quote unit names
    return "\n".join(lines)


def format_mesh(plan: Plan, runners_up: int = 12) -> str:
    """The chosen device mesh and a table of the runner-up meshes (shape, step, peak memory
    per device, why each loses), from ``plan.meta["mesh"]`` (``autopipe.planner.mesh``)."""
    mesh = plan.meta["mesh"]
    pp, dp, tp = plan.mesh_shape
    gather = mesh.get("gather_buffer_bytes") or 0
    lines = [
        f"mesh           pp {pp} x dp {dp} x tp {tp} = {plan.world_size} GPUs "
        f"({mesh['gpus_per_node']} per node), shard {plan.shard}; peak "
        f"{format_bytes(mesh['peak_bytes'])} per device"
        + (f" (gather buffers {format_bytes(gather)} included)" if gather else ""),
        f"step           {format_seconds(plan.iteration_time_s)} = pipeline "
        f"{format_seconds(plan.meta['pipeline_iteration_s'])} + exposed DP communication "
        f"{format_seconds(plan.meta['allreduce_s'])}; TP collectives "
        f"{format_seconds(mesh['tp_comm_s'])} of the busiest rank's step",
    ]
    rows = []
    for c in mesh["candidates"][: runners_up + 1]:
        rows.append(
            [
                f"{c['pp']} x {c['dp']} x {c['tp']}",
                c["shard"],
                format_seconds(c["step_s"]) if c["step_s"] is not None else "-",
                format_bytes(c["peak_bytes"]) if c["peak_bytes"] else "-",
                printable(c["reason"]),
            ]
        )
    more = len(mesh["candidates"]) - len(rows)
    table = _table(["pp x dp x tp", "shard", "step", "peak/device", "why"], rows, right={2, 3})
    tail = f"\n({more} more meshes in the plan's meta.mesh.candidates)" if more > 0 else ""
    return "\n".join(lines) + "\n\nmeshes, fastest first:\n" + table + tail


def _training_state(plan: Plan) -> str:
    """``16 B/parameter (mixed-adam: 2 weight + 2 gradient + 12 fp32 master, m, v)``."""
    bpp = plan.state_bytes_per_parameter
    text = f"{bpp:g} B/parameter"
    if plan.optimizer and plan.optimizer != "custom":
        from autopipe.core.optimizer import describe_training_state

        size = round(plan.meta.get("parameter_size_bytes", 0)) or None
        if size:
            return f"{text} ({describe_training_state(plan.optimizer, size)})"
        return f"{text} ({plan.optimizer})"
    return f"{text} (--bytes-per-parameter)" if plan.optimizer == "custom" else text


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
    if profile.meta.get("meta_init"):
        text += "\n\nmeta-init      built on meta, measured one unit at a time"
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
        _table(header, rows, right={0, 2, 3, 4, 5, 6, 7}),
        "",
        f"per micro-batch on the {clock} clock; medians over micro-batches and steps; err = "
        "(predicted - measured) / measured; the last stage includes the loss (run once per "
        "batch by the executor, divided by M)",
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
