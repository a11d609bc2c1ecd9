"""``autopipe replay TRACE.json --plan PLAN.json``: a run's own durations through the planner's
simulator: the simulated step against the measured one, the bubble, each rank's idle time,
and the runtime's work between the actions by name (:mod:`autopipe.planner.replay`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autopipe.cli import common
from autopipe.core.timeline import TimelineFormatError, load_chrome_trace
from autopipe.replay_report import ReplayError, format_report, replay

EPILOG = """\
examples:
  autopipe plan examples/gpt.py --gpus 2 --json plan.json
  torchrun --nproc-per-node 2 -m autopipe run examples/gpt.py --plan plan.json --trace trace.json
  autopipe replay trace.json --plan plan.json             # each action's own durations
  autopipe replay trace.json --plan plan.json --medians   # one duration per chunk and phase
"""


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe replay TRACE.json --plan PLAN.json [--medians] [--step N]``."""
    p = sub.add_parser(
        "replay",
        help="replay a run's trace through the planner's simulator (measured vs simulated step)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Give the durations a run recorded (`autopipe run --trace`) to the simulator the "
            "planner prices plans with, in the plan's schedule order, and compare the step it "
            "simulates with the measured one; print the bubble, each rank's idle time and the "
            "runtime's work between actions (loss, dispatch, transfers, step set-up and end, "
            "optimizer)."
        ),
        epilog=EPILOG,
    )
    p.add_argument("trace", help="TRACE.json written by `autopipe run --trace`")
    p.add_argument(
        "--plan", required=True, metavar="PLAN.json", help="the plan the traced run used"
    )
    p.add_argument(
        "--medians",
        action="store_true",
        help="give every action of a chunk and phase their median duration (as the planner "
        "sees a chunk) instead of its own",
    )
    p.add_argument(
        "--step",
        type=common.positive_int,
        metavar="N",
        help="the step to show in detail (default: the last)",
    )
    common.json_option(p, "write every step's figures as JSON to PATH (stdout if no PATH)")
    common.add_common_flags(p)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    common.check_output_path(args.json, "--json", inputs=[args.trace, args.plan])
    if not Path(args.trace).is_file():
        raise common.UsageError(
            f"trace file not found: {args.trace} (record one with `autopipe run --trace`)"
        )
    plan = common.load_plan_file(args.plan)
    try:
        timeline = load_chrome_trace(args.trace)
    except TimelineFormatError as exc:
        raise common.UsageError(f"{args.trace}: {exc}") from exc
    try:
        report = replay(timeline, plan, medians=args.medians)
        text = format_report(report, detail_step=args.step)
    except ReplayError as exc:
        raise common.UsageError(f"{args.trace}: {exc}") from exc
    common.say(args, text)
    if args.json is not None:
        common.emit_json(report.to_dict(), args.json)
    return common.EXIT_OK
