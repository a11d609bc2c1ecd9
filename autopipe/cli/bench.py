"""``autopipe bench``: run a plan with the GPipe executor on this machine and compare the
predicted and measured times (writes Chrome traces, the comparison plot and ``bench.json``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from autopipe.cli import common

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
    plan = common.load_plan_file(args.plan)
    common.refuse_too_many_tasks(plan)
    from autopipe.modelfile import ModelFileError

    mf = common.load_model_arg(args.model)
    devices = None
    if args.devices:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        if len(devices) != plan.num_stages:
            raise common.UsageError(
                f"--devices lists {len(devices)} devices but the plan has {plan.num_stages} "
                "stages; give one per stage (devices may repeat)"
            )
    import torch

    from autopipe.device_target import check_local_device

    for device in devices or []:
        check_local_device(device, "--devices")
    cpu_only = (
        all(d.startswith("cpu") for d in devices) if devices else not torch.cuda.is_available()
    )
    # The profiler measures CPU units single-threaded by default; run the same way.
    torch.set_num_threads(args.threads or (1 if cpu_only else torch.get_num_threads()))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if load > cores:
        common.log.warning(
            "load average %.1f on %d cores: other processes share the CPU, timings are noisy",
            load,
            cores,
        )
    try:
        model = mf.build()
        inputs = mf.inputs(plan.batch_size)
    except ModelFileError as exc:
        raise common.UsageError(str(exc)) from exc
    from autopipe.bench_report import run_bench
    from autopipe.profiler.measure import ProfilingError
    from autopipe.profiling import MODEL_ERRORS, model_failed

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
        raise common.UsageError(str(exc)) from exc
    except MODEL_ERRORS as exc:
        raise model_failed(mf, plan.batch_size, exc) from exc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from autopipe.core.datafile import atomic_write_json
    from autopipe.core.timeline import to_chrome_trace
    from autopipe.viz.gantt import plot_timeline

    trace_path = out / "trace.json"
    atomic_write_json(trace_path, to_chrome_trace(result.measured))
    predicted_trace = out / "trace_predicted.json"
    atomic_write_json(predicted_trace, to_chrome_trace(result.predicted))
    files = [trace_path, predicted_trace]
    files += plot_timeline(
        result.predicted,
        out / "timeline_compare",
        compare=result.measured,
        formats=args.format,
        titles=result.compare_titles(),
    )
    report = result.to_dict()
    report["files"] = [str(p) for p in files]
    # Strict JSON: an error against a measured 0 s is infinite, and bare Infinity is no JSON.
    atomic_write_json(out / "bench.json", common.strict_json(report), strict=True)
    files.append(out / "bench.json")
    if args.json:
        common.emit_json(report, "-")
    else:
        from autopipe.report import format_bench

        common.say(args, format_bench(result))
        common.say(args, "wrote " + ", ".join(str(p) for p in files))
    return common.EXIT_OK
