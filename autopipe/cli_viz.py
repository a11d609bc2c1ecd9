"""``autopipe plot`` and ``autopipe bench``.

``register_plot(sub)`` and ``register_bench(sub)`` add the commands to the CLI's argparse
subparsers (``autopipe.cli.build_parser``). Conventions are the CLI's: ``--json`` prints
machine-readable output on stdout, ``-q``/``-v``, ``cli.UsageError`` -> exit 2,
``cli.Failure`` -> exit 1, one-line errors.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from autopipe import cli

PLOT_EPILOG = """\
examples:
  autopipe plan examples/gpt.py --gpus 8 --json plan.json --plot out/
  autopipe plot plan.json --out out/                       # redraw from the plan alone
  autopipe plot plan.json --profile profile.json --out out/ --format png,svg
  autopipe plot plan.json --timeline bench-out/trace.json --compare --out out/
"""

BENCH_EPILOG = """\
examples:
  autopipe plan examples/gpt.py --gpus 4 --json plan.json
  autopipe bench examples/gpt.py --plan plan.json --steps 10 --out bench-out/
On CPU the profiler measures single-threaded thread-CPU time by default and bench compares on
the same clock (--clock auto), so other processes on the host do not skew the comparison.
Stages on the same device (here all four are this CPU) are simulated as sharing it, so the
prediction is of what really runs.
"""


def _formats(text: str) -> tuple[str, ...]:
    formats = tuple(f.strip().lower() for f in text.split(",") if f.strip())
    bad = [f for f in formats if f not in ("png", "svg")]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"formats must be png and/or svg, got {text!r}")
    return formats


def _load_timeline(path: str, num_stages: int) -> Any:
    from autopipe.viz.timeline import TimelineFormatError, timeline_from_chrome_trace

    if not Path(path).is_file():
        raise cli.UsageError(f"timeline file not found: {path} (a Chrome trace JSON)")
    try:
        timeline = timeline_from_chrome_trace(path, num_stages=num_stages, label="measured")
    except TimelineFormatError as exc:
        raise cli.UsageError(str(exc)) from exc
    if timeline.num_stages != num_stages:
        raise cli.UsageError(
            f"{path} has {timeline.num_stages} stages but the plan has {num_stages}; pass the "
            "trace of a run of this plan"
        )
    return timeline


# -- plot ---------------------------------------------------------------------------------------


def cmd_plot(args: argparse.Namespace) -> int:
    cli.check_output_path(args.out, "--out", directory=True)
    plan = cli.load_plan_file(args.plan)
    _refuse_too_many_tasks(plan)
    if args.compare and not args.timeline:
        raise cli.UsageError("--compare needs --timeline TRACE.json (the measured run)")
    timeline = _load_timeline(args.timeline, plan.num_stages) if args.timeline else None
    profile = None
    if args.profile:
        profile = cli.load_profile_file(args.profile)
        planned = [u for s in plan.stages for u in s.units]
        if planned != profile.unit_names:
            raise cli.UsageError(
                f"{args.profile} does not match {args.plan}: the plan's units are not the "
                "profile's; pass the profile the plan was made from"
            )
    elif isinstance(plan.meta.get("profile"), dict):
        # `autopipe plan --json` keeps the profile in the plan so plots can be redrawn later.
        from autopipe.profiler.profile import Profile, ProfileFormatError

        try:
            profile = Profile.from_dict(plan.meta["profile"])
        except ProfileFormatError as exc:
            raise cli.UsageError(f"{args.plan}: the embedded profile is unusable: {exc}") from exc
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
    if args.json:
        cli._emit_json({"files": [str(p) for p in paths]}, "-")
    else:
        cli._say(args, "plots: " + ", ".join(str(p) for p in paths))
    return cli.EXIT_OK


def register_plot(sub: Any) -> None:
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
        epilog=PLOT_EPILOG,
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
        "--profile",
        metavar="PROFILE.json",
        help="the plan's profile, to (re)compute the bubble/balance/scaling data",
    )
    p.add_argument(
        "--gpus",
        type=cli._positive_int,
        metavar="N",
        help="scaling plot up to N devices (default: the plan's stages; needs the profile)",
    )
    p.add_argument(
        "--format",
        type=_formats,
        default=("png",),
        metavar="png,svg",
        help="image formats (default: png)",
    )
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    cli._common(p)
    p.set_defaults(func=cmd_plot)


# -- bench --------------------------------------------------------------------------------------


def _refuse_too_many_tasks(plan: Any) -> None:
    from autopipe.viz import too_many_tasks

    reason = too_many_tasks(plan)
    if reason is not None:
        raise cli.UsageError(reason)


def cmd_bench(args: argparse.Namespace) -> int:
    cli.check_output_path(args.out, "--out", directory=True)
    plan = cli.load_plan_file(args.plan)
    _refuse_too_many_tasks(plan)
    from autopipe.modelfile import ModelFileError

    mf = cli.load_model_arg(args.model)
    devices = None
    if args.devices:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        if len(devices) != plan.num_stages:
            raise cli.UsageError(
                f"--devices lists {len(devices)} devices but the plan has {plan.num_stages} "
                "stages; give one per stage (devices may repeat)"
            )
    import torch

    for device in devices or []:
        cli.check_local_device(device, "--devices")
    cpu_only = (
        all(d.startswith("cpu") for d in devices) if devices else not torch.cuda.is_available()
    )
    # The profiler measures CPU units single-threaded by default; run the same way.
    torch.set_num_threads(args.threads or (1 if cpu_only else torch.get_num_threads()))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if load > cores:
        cli.log.warning(
            "load average %.1f on %d cores: other processes share the CPU, timings are noisy",
            load,
            cores,
        )
    try:
        model = mf.build()
        inputs = mf.inputs(plan.batch_size)
    except ModelFileError as exc:
        raise cli.UsageError(str(exc)) from exc
    from autopipe.bench import run_bench
    from autopipe.profiler.measure import ProfilingError

    try:
        result = run_bench(
            model,
            inputs,
            plan,
            devices=devices,
            steps=args.steps,
            warmup=args.warmup,
            loss_fn=mf.loss_fn,
            clock=args.clock,
            executor_overhead=not args.no_executor_overhead,
            progress=not args.quiet and not args.json,
        )
    except (ValueError, ProfilingError) as exc:
        # parallelize's errors on a mismatched plan/model/devices are one clear line; so is
        # a model without a loss_fn whose output cannot drive backward.
        raise cli.UsageError(str(exc)) from exc
    except cli.MODEL_ERRORS as exc:
        raise cli.model_failed(mf, plan.batch_size, exc) from exc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from autopipe.profiler.profile import atomic_write_json
    from autopipe.viz.gantt import plot_timeline
    from autopipe.viz.timeline import timeline_to_chrome_trace

    trace_path = out / "trace.json"
    atomic_write_json(trace_path, timeline_to_chrome_trace(result.measured))
    predicted_trace = out / "trace_predicted.json"
    atomic_write_json(predicted_trace, timeline_to_chrome_trace(result.predicted))
    files = [trace_path, predicted_trace]
    files += plot_timeline(
        result.predicted, out / "timeline_compare", compare=result.measured, formats=args.format
    )
    report = result.to_dict()
    report["files"] = [str(p) for p in files]
    # Strict JSON: an error against a measured 0 s is infinite, and bare Infinity is no JSON.
    atomic_write_json(out / "bench.json", cli._strict_json(report), strict=True)
    files.append(out / "bench.json")
    if args.json:
        cli._emit_json(report, "-")
    else:
        from autopipe.report import format_bench

        cli._say(args, format_bench(result))
        cli._say(args, "wrote " + ", ".join(str(p) for p in files))
    return cli.EXIT_OK


def register_bench(sub: Any) -> None:
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
        epilog=BENCH_EPILOG,
    )
    cli.model_and_plan_args(p)
    p.add_argument("--steps", type=cli._positive_int, default=5, help="measured steps (default 5)")
    p.add_argument(
        "--warmup",
        type=cli._nonnegative_int,
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
        type=cli._positive_int,
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
        "--format", type=_formats, default=("png",), metavar="png,svg", help="plot formats"
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON on stdout")
    cli._common(p)
    p.set_defaults(func=cmd_bench)
