"""Bench a plan on this machine as ``autopipe bench`` does, for the CLI and the Python API alike.

:func:`bench_model_file` trains a few steps of the plan with the GPipe executor on the local
devices (:func:`autopipe.bench_report.run_bench`), compares the predicted and measured times
and writes the run's files into a folder: the measured and predicted iterations as Chrome
traces (``trace.json``, ``trace_predicted.json``), predicted over measured on one time axis
(``timeline_compare.<fmt>``) and the comparison (``bench.json``, strict JSON). A bad plan,
model file, device list or model is a ``UsageError``, raised before any training step.

Typical use::

    run = bench_model_file(BenchRequest("examples/gpt.py", load_plan("plan.json")))
    print(format_bench(run.result))  # autopipe.report
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe.bench_report import BenchResult, run_bench
from autopipe.core.datafile import atomic_write_json, strict_json
from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.timeline import to_chrome_trace
from autopipe.device_target import check_local_device
from autopipe.modelfile import load_model_file
from autopipe.outputs import check_output
from autopipe.profiling import MODEL_ERRORS, model_failed
from autopipe.viz import too_many_tasks
from autopipe.viz.gantt import plot_timeline

if TYPE_CHECKING:
    from autopipe.modelfile import ModelFile

__all__ = ["BenchRequest", "BenchRun", "bench_model_file", "write_bench_files"]

log = logging.getLogger("autopipe")


@dataclass(frozen=True)
class BenchRequest:
    """What to bench and how (the arguments of ``autopipe bench``)."""

    model: str
    """``MODEL.py[:FACTORY]``: the model file the plan was made for."""
    plan: Plan
    out_dir: Path = Path("bench-out")
    """Where the traces, the plot and ``bench.json`` go (created when missing)."""
    steps: int = 5
    """Measured training steps."""
    warmup: int = 1
    """Unmeasured steps first."""
    devices: tuple[str, ...] | None = None
    """One torch device per stage, may repeat; None: the K CUDA devices, else K x ``cpu``."""
    threads: int | None = None
    """torch CPU threads; None: 1 when every stage is on the CPU (as the profiler measures),
    else torch's own count."""
    clock: str = "auto"
    """What measured times are read from: ``wall``, ``thread_cpu`` or ``auto``
    (:func:`autopipe.bench_report.choose_clock`)."""
    executor_overhead: bool = True
    """Add the executor's calibrated per-task cost to the prediction (thread-CPU clock)."""
    formats: tuple[str, ...] = ("png",)
    """Image formats of the plot: ``png``, ``svg``."""
    progress: bool = False
    """Show a progress bar over the steps."""


@dataclass
class BenchRun:
    """What :func:`bench_model_file` measured and wrote."""

    result: BenchResult
    report: dict[str, Any]
    """``bench.json``'s content: :meth:`BenchResult.to_dict`, non-finite numbers as null, and
    ``files``: the traces and plots written beside it."""
    files: list[Path]
    """Every file written, ``bench.json`` last."""


def bench_model_file(request: BenchRequest) -> BenchRun:
    """Train ``request.warmup + request.steps`` steps of ``request.plan`` on ``request.model``
    with the GPipe executor, compare them with the plan's prediction and write the files into
    ``request.out_dir``. Raises ``UsageError`` for a plan with too many tasks to draw, a bad
    model file, device list, output folder or model, before any training step."""
    plan = request.plan
    reason = too_many_tasks(plan)
    if reason is not None:
        raise UsageError(reason)
    mf = load_model_file(request.model)
    _check_devices(request.devices, plan)
    check_output(request.out_dir, "out_dir", directory=True)
    _set_threads(request.devices, request.threads)
    _warn_if_loaded()
    result = _measure(mf, request)
    return write_bench_files(result, request.out_dir, request.formats)


def _check_devices(devices: tuple[str, ...] | None, plan: Plan) -> None:
    """One local torch device per stage (``UsageError`` naming ``--devices`` otherwise)."""
    if devices is None:
        return
    if len(devices) != plan.num_stages:
        raise UsageError(
            f"--devices lists {len(devices)} devices but the plan has {plan.num_stages} "
            "stages; give one per stage (devices may repeat)"
        )
    for device in devices:
        check_local_device(device, "--devices")


def _set_threads(devices: tuple[str, ...] | None, threads: int | None) -> None:
    """torch's CPU threads: ``threads``, else one when every stage runs on the CPU."""
    import torch

    cpu_only = (
        all(d.startswith("cpu") for d in devices) if devices else not torch.cuda.is_available()
    )
    # The profiler measures CPU units single-threaded by default; run the same way.
    torch.set_num_threads(threads or (1 if cpu_only else torch.get_num_threads()))


def _warn_if_loaded() -> None:
    """Warn when other processes keep every core busy: timings are then noisy."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if load > cores:
        log.warning(
            "load average %.1f on %d cores: other processes share the CPU, timings are noisy",
            load,
            cores,
        )


def _measure(mf: ModelFile, request: BenchRequest) -> BenchResult:
    """Build the model and its mini-batch and run :func:`run_bench`; the model's own errors
    are bad input (``UsageError``), as in profiling."""
    from autopipe.profiler.measure import ProfilingError

    plan = request.plan
    model = mf.build()
    inputs = mf.inputs(plan.batch_size)
    try:
        return run_bench(
            model,
            inputs,
            plan,
            devices=list(request.devices) if request.devices is not None else None,
            steps=request.steps,
            warmup=request.warmup,
            loss_fn=mf.loss_fn,
            clock=request.clock,
            executor_overhead=request.executor_overhead,
            progress=request.progress,
        )
    except (ValueError, ProfilingError) as exc:
        # parallelize's errors on a mismatched plan/model/devices are one clear line; so is
        # a model without a loss_fn whose output cannot drive backward.
        raise UsageError(str(exc)) from exc
    except MODEL_ERRORS as exc:
        raise model_failed(mf, plan.batch_size, exc) from exc


def write_bench_files(
    result: BenchResult, out_dir: str | Path, formats: tuple[str, ...] = ("png",)
) -> BenchRun:
    """Write ``trace.json``, ``trace_predicted.json``, ``timeline_compare.<fmt>`` and
    ``bench.json`` for ``result`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "trace.json"
    atomic_write_json(trace_path, to_chrome_trace(result.measured))
    predicted_trace = out / "trace_predicted.json"
    atomic_write_json(predicted_trace, to_chrome_trace(result.predicted))
    files = [trace_path, predicted_trace]
    files += plot_timeline(
        result.predicted,
        out / "timeline_compare",
        compare=result.measured,
        formats=formats,
        titles=result.compare_titles(),
    )
    report = result.to_dict()
    report["files"] = [str(p) for p in files]
    # Strict JSON: an error against a measured 0 s is infinite, and bare Infinity is no JSON.
    report = strict_json(report)
    atomic_write_json(out / "bench.json", report, strict=True)
    return BenchRun(result, report, [*files, out / "bench.json"])
