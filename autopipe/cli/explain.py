"""``autopipe explain``: a saved plan's reasoning in sentences."""

from __future__ import annotations

import argparse

from autopipe.cli import common
from autopipe.core.plantext import mesh_record_problem
from autopipe.explain import explain


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe explain PLAN.json [--json]`` to the CLI's subparsers."""
    p = sub.add_parser(
        "explain", help="print a plan's reasoning", epilog="example: autopipe explain plan.json"
    )
    p.add_argument("plan", help="PLAN.json written by `autopipe plan --json`")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_common_flags(p)
    p.set_defaults(func=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    p = common.load_plan_file(args.plan)
    common.refuse_broken_rules(p, args.plan)  # explaining it would pass it as runnable
    stale = mesh_record_problem(p)
    if stale is not None:  # its figures and notes would explain another mesh
        raise common.UsageError(f"{args.plan}: {stale}")

    text = explain(p)
    if args.json:
        common.emit_json({"explanation": text.splitlines(), "plan": p.to_dict()}, "-")
    else:
        common.say(args, text)
    return common.EXIT_OK
