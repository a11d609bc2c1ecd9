"""A Plan as the text the CLI prints: the stage table, the pipeline-level figures, the
framework-defaults table and the notes (``autopipe plan``'s output, ``Plan.summary()``,
``str(plan)``).

Torch-free and reading only the plan's own fields, so ``Plan`` can print itself without
the layers above core (``autopipe.report`` re-exports :func:`format_plan` beside the
profile and bench tables).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.core.humanize import format_bytes, format_seconds, printable
from autopipe.core.optimizer import describe_training_state
from autopipe.core.vocabulary import FRAMEWORK_DEFAULTS, FRAMEWORK_LABELS

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.core.plan_records import MeshReport


def table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Columns as wide as their widest cell, two spaces apart, a dashed rule under the
    header; columns in ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def ms(s: float) -> str:
    """Seconds as milliseconds with two decimals, for table cells headed "ms"."""
    return f"{s * 1e3:.2f}"


SOLVER_LABELS = {
    "dp": "dynamic-programming cut",
    "ilp": "ILP cut",
    "brute-force": "brute-force cut",
}
"""How a report names the exact solvers that cut the stages: ``dp`` (the value plan files
and ``--strategy`` keep) is dynamic programming, never to be read as the data-parallel
``dp`` of a mesh."""


def solver_label(strategy: str) -> str:
    """``"dp"`` -> ``"dynamic-programming cut"``; a baseline's name as it is."""
    return SOLVER_LABELS.get(strategy, f"{strategy} cut")


def plural(n: int, word: str) -> str:
    """``plural(1, "stage") == "1 stage"``, ``plural(4, "stage") == "4 stages"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def optimizer_words(plan: Plan) -> str:
    """`` + optimizer step 12.3 ms`` when the plan's step includes one
    (``PlanReport.optimizer_s``), else ``""``."""
    if plan.report.optimizer_s <= 0:
        return ""
    return f" + optimizer step {format_seconds(plan.report.optimizer_s)}"


def module_span(first: str, last: str) -> str:
    """``"tok_emb .. head"``, or ``"head"`` when a stage holds one module."""
    first, last = printable(first), printable(last)
    return first if first == last else f"{first} .. {last}"


def format_plan(plan: Plan) -> str:
    """The plan as a table, one row per stage, then the pipeline-level figures."""
    where = (
        plural(plan.num_stages, "stage")
        if plan.virtual_stages == 1
        else f"{plural(plan.num_stages, 'rank')} x {plan.virtual_stages} virtual stages"
    )
    lines = [
        f"autopipe plan: {plan.model or 'model'} on {where} "
        f"({solver_label(plan.strategy)}, {plan.profile_mode} costs)",
        "",
        _stage_table(plan),
        "",
        *_figure_lines(plan),
    ]
    lines += _baselines_line(plan)
    if plan.mesh is not None:
        lines += ["", format_mesh(plan, plan.mesh)]
    frameworks = framework_table(plan)
    if frameworks:
        where = (
            "the same devices" if plan.mesh is None else "the same mesh, DP communication included"
        )
        lines += ["", f"framework defaults on {where} (predicted):", *frameworks, ""]
    for note in [*advice_notes(plan), *plan.notes]:
        lines.append(f"note           {printable(note)}")  # notes quote unit names
    return "\n".join(lines)


def advice_notes(plan: Plan) -> list[str]:
    """What to do about a plan that reads wrong at first sight: one no faster than one
    device, and a framework's default split (it runs another schedule) faster than it."""
    notes = []
    if plan.world_size > 1 and 0 < plan.speedup < 1.005:
        notes.append(
            f"this plan is no faster than one device ({plan.speedup:.2f}x): with "
            f"M = {plan.microbatches} the pipeline idles in its bubble and sends more than "
            "splitting the model saves; give a larger --batch-size (more micro-batches), "
            "--schedule auto, or fewer GPUs (--scaling shows each K)"
        )
    faster = []
    for name in FRAMEWORK_DEFAULTS:
        b = plan.baselines.get(name) or {}
        time_s = b.get("iteration_time_s")
        if time_s and b.get("feasible", True) and time_s < plan.iteration_time_s * 0.995:
            if _same_shape(plan, b) and b.get("dp_comm_s") is not None:
                notes.append(
                    f"{FRAMEWORK_LABELS[name]} is faster than this plan per step "
                    f"({time_s / plan.iteration_time_s:.2f}x): its cut exposes "
                    f"{format_seconds(b['dp_comm_s'])} of DP communication against this "
                    f"plan's {format_seconds(plan.allreduce_s)}; autopipe's cut minimizes the "
                    "pipeline time, not the gradient reduction after it"
                )
                continue
            schedule = b.get("schedule") or "another schedule"
            faster.append((time_s, FRAMEWORK_LABELS[name], schedule))
    if faster:
        time_s, label, schedule = min(faster)
        notes.append(
            f"{label} is faster than this plan ({time_s / plan.iteration_time_s:.2f}x its "
            f"iteration): it runs {schedule}, a schedule this plan was not asked to weigh "
            f"(--schedule {plan.request.schedule if plan.request else plan.schedule}); plan "
            "with --schedule auto to weigh every schedule"
        )
    return notes


def _same_shape(plan: Plan, row: dict[str, object]) -> bool:
    """Whether a baseline row runs the plan's own schedule and stages per rank."""
    return row.get("schedule") == plan.schedule and row.get("virtual_stages", 1) == (
        plan.virtual_stages
    )


def _stage_table(plan: Plan) -> str:
    """One row per stage: device, modules, per-micro-batch ms, checkpointing, memory, load."""
    bottleneck_s = max((s.time_s for s in plan.stages), default=0.0) or 1.0
    rows = []
    for s in plan.stages:
        span = module_span(s.first_module, s.last_module)
        rows.append(
            [
                str(s.index) if plan.virtual_stages == 1 else f"{s.index} (rank {s.rank})",
                s.device,
                f"{span} ({len(s.units)})",
                ms(s.forward_s),
                ms(s.backward_s + s.recompute_s),
                ms(s.send_s),
                ("per unit" if s.checkpoint_granularity == "unit" else "per stage")
                if s.checkpoint
                else "no",
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
    return table(header, rows, right={0, 3, 4, 5, 7, 8})


def _figure_lines(plan: Plan) -> list[str]:
    """The pipeline-level figures: M, the iteration, the bubble, the bound, memory, host,
    the training state, the trainer options other than the defaults (as their flags)."""
    lines = [
        "times are per micro-batch; load = stage time / bottleneck stage time",
        f"micro-batches  M = {plan.microbatches} x {plan.microbatch_size} samples "
        f"({_batch_words(plan)}), schedule {plan.schedule}",
        f"iteration      {format_seconds(plan.iteration_time_s)} predicted, "
        f"{plan.throughput:.4g} samples/s, {plan.speedup:.2f}x over one device",
    ]
    if plan.data_parallel > 1 and plan.pipeline_iteration_s > 0:
        lines.append(
            "               (iteration = one training step: the pipeline's "
            f"{format_seconds(plan.pipeline_iteration_s)} + exposed DP communication "
            f"{format_seconds(plan.allreduce_s)}{optimizer_words(plan)}; notes that say "
            "pipeline mean the first)"
        )
    lines.append(f"bubble         {100 * plan.bubble_fraction:.1f}% idle")
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
    flags = plan.trainer.flags()
    if flags:
        lines.append(f"trainer        {' '.join(flags)} (what the plan was priced for)")
    return lines


def _batch_words(plan: Plan) -> str:
    """``batch 8``, or with D replicas ``batch 8 per replica, 16 global over dp 2``."""
    if plan.data_parallel == 1:
        return f"batch {plan.batch_size}"
    return (
        f"batch {plan.batch_size} per replica, {plan.batch_size * plan.data_parallel} global "
        f"over dp {plan.data_parallel}"
    )


def _baselines_line(plan: Plan) -> list[str]:
    """The plan's iteration time against its own baselines' (not the framework defaults')."""
    own = {k: v for k, v in plan.baselines.items() if k not in FRAMEWORK_DEFAULTS}
    if not own:
        return []
    names = ["autopipe", *own]
    times: list[float | None] = [plan.iteration_time_s]
    for b in own.values():
        times.append(b.get("iteration_time_s") if b.get("feasible", True) else None)
    ratio = " / ".join(
        "infeasible" if t is None else f"{t / plan.iteration_time_s:.2f}" for t in times
    )
    return [f"vs baselines   {' vs '.join(names)}: {ratio} x iteration time"]


def mesh_record_problem(plan: Plan) -> str | None:
    """Why the plan's ``mesh`` record (the search's chosen mesh and its runners-up) is not
    the plan's own mesh, in one line, or None: a plan edited after planning (its
    ``num_stages``, ``data_parallel``, ``tensor_parallel`` or ``shard``) keeps the old record,
    whose figures and notes would describe another mesh."""
    mesh = plan.mesh
    if mesh is None or not mesh.candidates:
        return None
    chosen = next((c for c in mesh.candidates if c.reason == "chosen"), mesh.candidates[0])
    own = (*plan.mesh_shape, plan.shard)
    if (chosen.pp, chosen.dp, chosen.tp, chosen.shard) == own and mesh.gpus == plan.world_size:
        return None
    return (
        f"the plan's mesh record chose pp {chosen.pp} x dp {chosen.dp} x tp {chosen.tp} "
        f"(shard {chosen.shard}) of {mesh.gpus} GPUs but the plan is pp {own[0]} x dp "
        f"{own[1]} x tp {own[2]} (shard {own[3]}): it was edited after planning; plan it "
        "again with autopipe plan"
    )


def format_mesh(plan: Plan, mesh: MeshReport, runners_up: int = 12) -> str:
    """The chosen device mesh and a table of the runner-up meshes (shape, step, peak memory
    per device, why each loses), from the plan's ``mesh`` (``autopipe.planner.mesh``)."""
    pp, dp, tp = plan.mesh_shape
    gather = mesh.gather_buffer_bytes
    cp, ep = plan.context_parallel, plan.expert_parallel
    more_dims = (f" x cp {cp}" if cp > 1 else "") + (f", ep {ep}" if ep > 1 else "")
    lines = [
        f"mesh           pp {pp} x dp {dp} x tp {tp}{more_dims} = {plan.world_size} GPUs "
        f"({mesh.gpus_per_node} per node), shard {plan.shard}; peak "
        f"{format_bytes(mesh.peak_bytes)} per device"
        + (f" (gather buffers {format_bytes(gather)} included)" if gather else ""),
        f"step           {format_seconds(plan.iteration_time_s)} = pipeline "
        f"{format_seconds(plan.pipeline_iteration_s)} + exposed DP communication "
        f"{format_seconds(plan.allreduce_s)}{optimizer_words(plan)}; TP collectives "
        f"{format_seconds(mesh.tp_comm_s)} of the busiest rank's step",
    ]
    rows = []
    wide = any(c.cp > 1 or c.ep > 1 for c in mesh.candidates)  # CP and EP columns
    for c in mesh.candidates[: runners_up + 1]:
        rows.append(
            [
                f"{c.pp} x {c.dp} x {c.tp}",
                *([str(c.cp), str(c.ep)] if wide else []),
                c.shard,
                format_seconds(c.step_s) if c.step_s is not None else "-",
                format_bytes(c.peak_bytes) if c.peak_bytes else "-",
                printable(c.reason),
            ]
        )
    more = len(mesh.candidates) - len(rows)
    head = ["pp x dp x tp", *(["cp", "ep"] if wide else []), "shard", "step", "peak/device", "why"]
    listed = table(head, rows, right={4, 5} if wide else {2, 3})
    tail = f"\n({more} more meshes in the plan's mesh.candidates)" if more > 0 else ""
    return "\n".join(lines) + "\n\nmeshes, fastest first:\n" + listed + tail


def _training_state(plan: Plan) -> str:
    """``16 B/parameter (mixed-adam: 2 weight + 2 gradient + 12 fp32 master, m, v)``."""
    bpp = plan.state_bytes_per_parameter
    text = f"{bpp:g} B/parameter"
    if plan.optimizer and plan.optimizer != "custom":
        size = plan.parameter_size_bytes or None
        if size:
            return f"{text} ({describe_training_state(plan.optimizer, size)})"
        return f"{text} ({plan.optimizer})"
    return f"{text} (--bytes-per-parameter)" if plan.optimizer == "custom" else text


def framework_table(plan: Plan) -> list[str]:
    """Rows comparing the plan with the split each framework makes by default, each
    evaluated by the planner with the plan's profile and M under the schedule and stages
    per rank that framework runs, shown as ``[schedule, V]`` (``Plan.baselines``);
    empty when the plan was made without baselines. See docs/frameworks.md."""
    rows = [
        f"{'split':52} {'units per stage':>22} {'iteration':>11} {'vs plan':>8}  memory",
        f"{'autopipe (this plan)':52} {'/'.join(map(str, plan.balance)):>22} "
        f"{format_seconds(plan.iteration_time_s):>11} {'1.00x':>8}  fits",
    ]
    found = False
    for name in FRAMEWORK_DEFAULTS:
        b = plan.baselines.get(name)
        if b is None:
            continue
        found = True
        label = FRAMEWORK_LABELS[name]
        if b.get("schedule"):  # the schedule and stages per rank the framework runs
            label = f"{label} [{b['schedule']}, V={b.get('virtual_stages', 1)}]"
        if b.get("iteration_time_s") is None:
            rows.append(f"{label:52} {'-':>22} {'-':>11} {'-':>8}  n/a: {b.get('reason', '')}")
            continue
        ratio = b["iteration_time_s"] / plan.iteration_time_s
        balance = "/".join(map(str, b.get("balance", [])))
        fits = "fits" if b.get("feasible", True) else "does not fit"
        rows.append(
            f"{label:52} {balance:>22} {format_seconds(b['iteration_time_s']):>11} "
            f"{ratio:>7.2f}x  {fits}"
        )
    return rows if found else []
