"""``autopipe emit``: a saved plan in the words of another framework, after the same
pre-flight as ``plan`` and ``run`` (:func:`autopipe.planner.emit.emit`)."""

from __future__ import annotations

import argparse

from autopipe.cli import common
from autopipe.planner.emit import EMIT_ALIASES, EMIT_FORMATS, EmitError, emit

EPILOG = """\
examples:
  autopipe emit plan.json torch                 # split_spec for torch.distributed.pipelining
  autopipe emit plan.json torchtitan -o pp.toml # torchtitan 0.2.2 job config (TOML);
                                                # also named torchtitan-0.2
  autopipe emit plan.json torchtitan-python -o autopipe_pp.py \
      --base torchtitan.models.llama3.config_registry:llama3_8b
                                                # torchtitan 0.3.0 (the current release)
                                                # config module, also named torchtitan-0.3:
                                                # --module autopipe_pp --config autopipe_config
  autopipe emit plan.json megatron              # Megatron-LM layout, batch, recompute flags

A plan torch would refuse (a hand-edited schedule, V, M or placement) is refused first,
naming the pre-flight rule (exit 2, nothing written).
"""


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe emit PLAN.json FORMAT [--out PATH]`` to the CLI's subparsers."""
    p = sub.add_parser(
        "emit",
        help="hand a saved plan to torch, torchtitan or Megatron-Core in their own words",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument("plan", help="PLAN.json written by `autopipe plan --json`")
    p.add_argument("format", choices=EMIT_FORMATS, help="the framework to emit for")
    p.add_argument("--out", "-o", metavar="PATH", help="write to PATH (default: stdout)")
    p.add_argument(
        "--base",
        metavar="MODULE:FUNCTION",
        default="",
        help="torchtitan-python only: the config function of the model the plan was made "
        "for, which autopipe_config() applies the plan to",
    )
    common.add_common_flags(p)
    p.set_defaults(func=cmd_emit)


def cmd_emit(args: argparse.Namespace) -> int:
    common.check_output_path(args.out, "--out", inputs=[args.plan])
    if args.base and EMIT_ALIASES.get(args.format, args.format) != "torchtitan-python":
        raise common.UsageError("--base is the torchtitan-python config's base: drop it")
    plan = common.load_plan_file(args.plan)
    try:
        text = emit(plan, args.format, args.base)
    except EmitError as exc:
        raise common.UsageError(f"{args.plan}: {exc}") from exc
    common.emit_text(text, args.out)
    if args.out and args.out != "-":  # `-o -` is stdout, as in Unix tools
        common.say(args, f"{args.format} config written to {args.out}")
    return common.EXIT_OK
