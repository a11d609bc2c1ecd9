"""``autopipe plot``: redraw a saved plan's timeline, bubble, balance and scaling plots.

With ``--timeline`` it also draws a measured run (a Chrome trace from ``autopipe bench``), and
with ``--compare`` predicted over measured on one time axis.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopipe.cli import common

EPILOG = """\
examples:
  autopipe plan examples/gpt.py --gpus 8 --json plan.json --plot out/
  autopipe plot plan.json --out out/                       # redraw from the plan alone
  autopipe plot plan.json --profile profile.json --out out/ --format png,svg
  autopipe plot plan.json --timeline bench-out/trace.json --compare --out out/
  autopipe plot plan.json --schedules --out out/           # every schedule, side by side
"""


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe plot PLAN.json --out DIR [--timeline TRACE.json] [--compare]``."""
    p = sub.add_parser(
        "plot",
        help="draw a plan's timeline, bubble, balance and scaling plots (PNG/SVG)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Redraw the plots of a saved plan: the simulated timeline, bubble overhead vs "
            "micro-batches, stage balance vs the uniform/parameters baselines and scaling vs "
            "devices; with --timeline also the measured run (a Chrome trace from `autopipe "
            "bench`), with --compare both on one time axis."
        ),
        epilog=EPILOG,
    )
    p.add_argument("plan", help="PLAN.json written by `autopipe plan --json`")
    p.add_argument("--out", "-o", required=True, metavar="DIR", help="directory for the images")
    p.add_argument("--timeline", metavar="TRACE.json", help="measured run as a Chrome trace JSON")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also draw predicted over measured on one time axis (needs --timeline)",
    )
    p.add_argument(
        "--schedules",
        action="store_true",
        help="also plan the plan's profile with every schedule and draw their timelines and "
        "memory side by side (schedules.png, schedules_memory.png; needs the profile)",
    )
    p.add_argument(
        "--profile",
        metavar="PROFILE.json",
        help="the plan's profile, to (re)compute the bubble/balance/scaling data",
    )
    p.add_argument(
        "--gpus",
        type=common.positive_int,
        metavar="N",
        help="scaling plot up to N devices (default: the plan's stages; needs the profile)",
    )
    p.add_argument(
        "--format",
        type=common.image_formats,
        default=("png",),
        metavar="png,svg",
        help="image formats (default: png)",
    )
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    common.add_common_flags(p)
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    common.check_output_path(args.out, "--out", directory=True)
    plan = common.load_plan_file(args.plan)
    common.refuse_broken_rules(plan, args.plan)  # before any folder is made
    common.refuse_too_many_tasks(plan)
    if args.compare and not args.timeline:
        raise common.UsageError("--compare needs --timeline TRACE.json (the measured run)")
    timeline = _load_timeline(args.timeline, plan.num_stages) if args.timeline else None
    profile = None
    if args.profile:
        profile = common.load_profile_file(args.profile)
        planned = [u for s in plan.stages for u in s.units]
        if planned != profile.unit_names:
            raise common.UsageError(
                f"{args.profile} does not match {args.plan}: the plan's units are not the "
                "profile's; pass the profile the plan was made from"
            )
    elif plan.profile is not None:
        # `autopipe plan --json` keeps the profile in the plan so plots can be redrawn later.
        profile = plan.profile
    if args.schedules and profile is None:  # refused before any drawing
        raise common.UsageError(
            "--schedules re-plans the plan's profile: pass --profile PROFILE.json (plans "
            "written by `autopipe plan --json` carry it)"
        )
    from autopipe.viz import plot_all

    paths = plot_all(
        plan,
        args.out,
        profile=profile,
        timeline=timeline,
        formats=args.format,
        compare=args.compare,
        max_gpus=args.gpus,
        progress=not args.quiet and not args.json,
    )
    if args.schedules:
        paths += _plot_schedules(plan, profile, args)
    if args.json:
        common.emit_json({"files": [str(p) for p in paths]}, "-")
    else:
        common.say(args, "plots: " + ", ".join(str(p) for p in paths))
    return common.EXIT_OK


def _plot_schedules(plan: Any, profile: Any, args: argparse.Namespace) -> list[Path]:
    """``--schedules``: the plan's request planned once per schedule, drawn side by side."""
    import dataclasses

    from autopipe.core.request import PlanRequest
    from autopipe.planner.sweep import plan_each_schedule
    from autopipe.viz.memory import plot_schedules

    request = plan.request or PlanRequest(
        gpus=plan.num_stages,
        batch_size=plan.batch_size,
        memory_per_device=plan.memory_per_device,
    )
    # Each schedule picks its own V (and M, when the request let the planner choose it).
    request = dataclasses.replace(request, virtual_stages="auto")
    plans = plan_each_schedule(profile, request)
    if not any(not isinstance(p, str) for p in plans.values()):
        raise common.Failure("no schedule has a plan: " + "; ".join(map(str, plans.values())))
    return plot_schedules(plans, args.out, formats=args.format)


def _load_timeline(path: str, num_stages: int) -> Any:
    from autopipe.core.timeline import TimelineFormatError, load_chrome_trace

    if not Path(path).is_file():
        raise common.UsageError(f"timeline file not found: {path} (a Chrome trace JSON)")
    try:
        timeline = load_chrome_trace(path, num_stages=num_stages, label="measured")
    except TimelineFormatError as exc:
        raise common.UsageError(str(exc)) from exc
    if timeline.num_stages != num_stages:
        raise common.UsageError(
            f"{path} has {timeline.num_stages} stages but the plan has {num_stages}; pass the "
            "trace of a run of this plan"
        )
    return timeline
