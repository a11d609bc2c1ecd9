"""``autopipe profile``: measure (or count) per-unit time and memory and save a profile."""

from __future__ import annotations

import argparse

from autopipe import profiling
from autopipe.cli import common
from autopipe.report import format_profile


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe profile MODEL.py [--out PROFILE.json]`` to the CLI's subparsers."""
    p = sub.add_parser(
        "profile",
        help="measure (or count) per-unit time and memory and save a profile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  autopipe profile examples/gpt.py --out profile.json",
    )
    p.add_argument("model", help="MODEL.py[:FACTORY]")
    p.add_argument("--out", "-o", metavar="PATH", help="write the profile JSON here")
    common.json_option(p, "also write the profile JSON to PATH (stdout if no PATH)")
    common.model_options(p)
    common.add_common_flags(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    common.check_output_path(args.out, "--out", inputs=[args.model])
    common.check_output_path(args.json, "--json", inputs=[args.model])
    common.check_distinct_outputs((args.out, "--out"), (args.json, "--json"))

    devices = common.device_flags(args)
    profile = profiling.profile_model_file(args.model, devices, common.profile_request(args))

    if args.out:
        profile.save(args.out)
    common.say(args, format_profile(profile, verbose=args.verbose))
    if args.out:
        common.say(args, f"profile written to {args.out}")
    common.emit_json(profile.to_dict(), args.json)
    return common.EXIT_OK
