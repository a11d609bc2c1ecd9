"""``autopipe plot``: redraw a saved plan's timeline, bubble, balance and scaling plots.

With ``--timeline`` it also draws a measured run (a Chrome trace from ``autopipe bench``), and
with ``--compare`` predicted over measured on one time axis.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autopipe.cli import common
from autopipe.core.timeline import Timeline, TimelineFormatError, load_chrome_trace
from autopipe.plotting import PlotRequest, PlotSources, plot_plan

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
    if args.compare and not args.timeline:
        raise common.UsageError("--compare needs --timeline TRACE.json (the measured run)")
    request = PlotRequest(
        plan=plan,
        out_dir=Path(args.out),
        timeline=_load_timeline(args.timeline, plan.num_stages) if args.timeline else None,
        profile=common.load_profile_file(args.profile) if args.profile else None,
        compare=args.compare,
        schedules=args.schedules,
        max_gpus=args.gpus,
        formats=args.format,
        progress=not args.quiet and not args.json,
        sources=PlotSources(
            plan=args.plan, profile=args.profile or "", timeline=args.timeline or ""
        ),
    )
    paths = plot_plan(request)
    if args.json:
        common.emit_json({"files": [str(p) for p in paths]}, "-")
    else:
        common.say(args, "plots: " + ", ".join(str(p) for p in paths))
    return common.EXIT_OK


def _load_timeline(path: str, num_stages: int) -> Timeline:
    """The measured run in the Chrome trace ``path`` (at least ``num_stages`` rows); a
    missing or malformed file is a UsageError."""
    if not Path(path).is_file():
        raise common.UsageError(f"timeline file not found: {path} (a Chrome trace JSON)")
    try:
        return load_chrome_trace(path, num_stages=num_stages, label="measured")
    except TimelineFormatError as exc:
        raise common.UsageError(str(exc)) from exc
