"""``autopipe devices``: the built-in device catalog for analytic planning."""

from __future__ import annotations

import argparse
import dataclasses

from autopipe.cli import common
from autopipe.core.catalog import CATALOG, format_catalog


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe devices [--json]`` to the CLI's subparsers."""
    p = sub.add_parser(
        "devices",
        help="list the built-in device catalog",
        epilog="example: autopipe devices --json",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_common_flags(p)
    p.set_defaults(func=cmd_devices)


def cmd_devices(args: argparse.Namespace) -> int:
    rows = list(CATALOG.values())
    if args.json:
        common.emit_json([dataclasses.asdict(s) for s in rows], "-")
        return common.EXIT_OK

    common.say(args, format_catalog(rows))
    return common.EXIT_OK
