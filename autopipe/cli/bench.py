"""``autopipe bench``: run a plan with the GPipe executor on this machine and compare the
predicted and measured times (writes Chrome traces, the comparison plot and ``bench.json``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autopipe.benchmarking import BenchRequest, bench_model_file
from autopipe.cli import common
from autopipe.report import format_bench

EPILOG = """\
examples:
  autopipe plan examples/gpt.py --gpus 4 --json plan.json
  autopipe bench examples/gpt.py --plan plan.json --steps 10 --out bench-out/
On CPU the profiler measures single-threaded thread-CPU time by default and bench compares on
the same clock (--clock auto), so other processes on the host do not skew the comparison.
Stages on the same device (here all four are this CPU) are simulated as sharing it, so the
prediction is of what really runs.
"""


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe bench MODEL.py --plan PLAN.json [--steps N]``."""
    p = sub.add_parser(
        "bench",
        help="run a plan with the executor and compare predicted vs measured times",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train a few steps of a plan with the GPipe executor on the local devices, record "
            "the measured timeline, write it as a Chrome trace with the predicted-vs-measured "
            "plot, and print predicted vs measured per-stage and iteration times."
        ),
        epilog=EPILOG,
    )
    common.model_and_plan_args(p)
    p.add_argument(
        "--steps", type=common.positive_int, default=5, help="measured steps (default 5)"
    )
    p.add_argument(
        "--warmup",
        type=common.nonnegative_int,
        default=1,
        metavar="N",
        help="unmeasured steps first (default 1)",
    )
    p.add_argument(
        "--devices",
        metavar="D0,D1,...",
        help="one device per stage, may repeat (default: the K CUDA devices, else K x cpu)",
    )
    p.add_argument(
        "--threads",
        type=common.positive_int,
        help="torch CPU threads (default: 1 when every stage is on the CPU, as the profiler)",
    )
    p.add_argument(
        "--clock",
        choices=["auto", "wall", "thread_cpu"],
        default="auto",
        help="measured times from the wall clock or thread CPU time (default auto: thread CPU "
        "time for single-threaded CPU runs, which other processes on the host do not inflate)",
    )
    p.add_argument(
        "--no-executor-overhead",
        action="store_true",
        help="do not add the executor's calibrated per-task cost to the prediction",
    )
    p.add_argument(
        "--out",
        "-o",
        default="bench-out",
        metavar="DIR",
        help="where trace.json, timeline_compare.png and bench.json go (default: bench-out)",
    )
    p.add_argument(
        "--format",
        type=common.image_formats,
        default=("png",),
        metavar="png,svg",
        help="plot formats",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON on stdout")
    common.add_common_flags(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    common.check_output_path(args.out, "--out", directory=True)
    devices = None
    if args.devices:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    request = BenchRequest(
        model=args.model,
        plan=common.load_plan_file(args.plan),
        out_dir=Path(args.out),
        steps=args.steps,
        warmup=args.warmup,
        devices=devices,
        threads=args.threads,
        clock=args.clock,
        executor_overhead=not args.no_executor_overhead,
        formats=args.format,
        progress=not args.quiet and not args.json,
    )
    run = bench_model_file(request)
    if args.json:
        common.emit_json(run.report, "-")
    else:
        common.say(args, format_bench(run.result))
        common.say(args, "wrote " + ", ".join(str(p) for p in run.files))
    return common.EXIT_OK
