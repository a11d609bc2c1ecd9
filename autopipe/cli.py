"""The ``autopipe`` command line.

Exit codes: 0 success, 1 failure (e.g. no plan fits memory), 2 bad usage or bad input.
Errors are one line on stderr; ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("autopipe")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input from the user: exit 2."""


class Failure(Exception):
    """The input was fine but the work could not be done: exit 1."""


# -- argument types ---------------------------------------------------------------------------


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (``what`` names it in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def positive_float(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (``what`` names it, with its unit, in the error):
    0, negatives, ``nan`` and ``inf`` are refused with one line, not a traceback later."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _microbatches(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _unit_patterns(text: str) -> list[str]:
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise argparse.ArgumentTypeError("expected module-path patterns, e.g. 'model.layers.*'")
    return patterns


def _memory(text: str) -> int:
    from autopipe.humanize import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- shared pieces ----------------------------------------------------------------------------


def _strict_json(obj: Any) -> Any:
    """``obj`` with NaN and infinities as null: bare ``NaN`` is not JSON (jq, JavaScript and
    most parsers reject it)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def _emit_json(obj: Any, target: str | None) -> None:
    """``--json`` alone writes to stdout; ``--json PATH`` writes a file atomically. Either
    way strict JSON: non-finite numbers become null."""
    if target is None:
        return
    obj = _strict_json(obj)
    if target == "-":
        sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False) + "\n")
        return
    from autopipe.profiler.profile import atomic_write_json

    atomic_write_json(Path(target), obj, strict=True)


_line_prefix = ""
"""Put before every line the CLI prints (``autopipe run`` sets ``[rank N] ``)."""


def set_line_prefix(prefix: str) -> None:
    """Start every line of output, warning, log record and error with ``prefix`` from now on
    (each rank of ``autopipe run`` names itself, so interleaved output stays readable)."""
    global _line_prefix
    _line_prefix = prefix
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(message)s"))


def _prefixed(text: str) -> str:
    return "\n".join(_line_prefix + line for line in text.split("\n")) if _line_prefix else text


def _say(args: argparse.Namespace, text: str) -> None:
    """Human output: suppressed by -q and when --json goes to stdout."""
    if args.quiet or getattr(args, "json", None) == "-":
        return
    print(_prefixed(text))


def load_plan_file(path: str) -> Any:
    """The Plan saved at ``path``; a missing or malformed file is a UsageError."""
    from autopipe.planner.plan import PlanFormatError, load_plan

    if not Path(path).is_file():
        raise UsageError(f"plan file not found: {path} (write one with `autopipe plan --json`)")
    try:
        return load_plan(path)
    except PlanFormatError as exc:
        raise UsageError(str(exc)) from exc
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a JSON text file") from None


def load_profile_file(path: str) -> Any:
    """The Profile saved at ``path``; a missing or malformed file is a UsageError."""
    from autopipe.profiler.profile import Profile, ProfileFormatError

    if not Path(path).is_file():
        raise UsageError(f"profile file not found: {path}")
    try:
        return Profile.load(path)
    except ProfileFormatError as exc:
        raise UsageError(str(exc)) from exc
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a JSON text file") from None


def load_model_arg(spec: str) -> Any:
    """The ``MODEL.py[:FACTORY]`` argument as a ModelFile; a bad one is a UsageError."""
    from autopipe.modelfile import ModelFileError, load_model_file

    try:
        return load_model_file(spec)
    except ModelFileError as exc:
        raise UsageError(str(exc)) from exc


def check_output_path(
    path: str | None,
    flag: str,
    *,
    directory: bool = False,
    inputs: Sequence[str | None] = (),
) -> None:
    """Refuse an output path that cannot be written, before any work is done (exit 2).

    ``directory``: ``path`` is a folder to write into; otherwise a file. Either way the
    nearest existing folder must take a new file (tried, not guessed from permission bits:
    root, read-only mounts and ACLs all decide), and missing folders are created on write.
    ``inputs``: files the command reads (a ``MODEL.py:FACTORY`` spec counts as its file);
    writing over one of them would destroy it.
    """
    if path is None or path == "-":
        return
    out = Path(path)
    if out.exists() and out.is_dir() != directory:
        kind = "a file" if directory else "a directory"
        raise UsageError(f"{flag} {path} is {kind}; give a {'directory' if directory else 'file'}")
    if not directory and out.exists():
        for given in inputs:
            source = _input_file(given)
            if source is not None and os.path.samefile(source, out):
                raise UsageError(
                    f"{flag} {path} is the input {given}; writing there would destroy it: "
                    "give another path"
                )
    folder = out if directory and out.exists() else out.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".autopipe-write-check-")
    except OSError as exc:
        raise UsageError(
            f"{flag} {path}: cannot write in {folder} ({exc.strerror or exc}); give a writable path"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _input_file(given: str | None) -> Path | None:
    """The file behind an input argument (``MODEL.py[:FACTORY]`` or a path), if it exists."""
    if not given:
        return None
    for candidate in (given, given.rpartition(":")[0]):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def check_distinct_outputs(*outputs: tuple[str | None, str]) -> None:
    """Refuse two output flags naming one file (``(path, flag)`` pairs): the second write
    would silently replace the first."""
    seen: dict[str, str] = {}
    for path, flag in outputs:
        if path is None or path == "-":
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"{seen[key]} and {flag} both write {path}; give two paths")
        seen[key] = flag


def check_local_device(name: str, flag: str) -> None:
    """``name`` is a torch device this machine has (cpu, an existing cuda:i, ...): exit 2 if not."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag}: {name!r} is not a torch device (e.g. cpu, cuda:0)") from None
    if device.type == "meta":
        raise UsageError(f"{flag}: the meta device holds no data; nothing can run on it")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"{flag}: {name} is not here: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )


def _load_profile_or_model(args: argparse.Namespace) -> Any:
    """Profile from ``args.model``: a saved profile JSON, or a model file to profile now."""
    if not args.model.endswith(".json"):
        return _profile_model_file(args)
    profile = load_profile_file(args.model)
    # Flags that shape profiling would be silently ignored for a saved profile: refuse them.
    ignored = [
        flag
        for flag, value in (
            ("--device-spec", args.device_spec),
            ("--dtype", args.dtype),
            ("--granularity", args.granularity),
            ("--units", args.units),
            ("--no-cache", args.no_cache),
            ("--meta-init", args.meta_init),
            ("--no-share", args.no_share),
        )
        if value
    ]
    single = args.device if args.device and not _device_list(args.device) else None
    if single and not _profiled_on(profile, single):
        ignored.insert(0, f"--device {single}")
    if ignored:
        raise UsageError(
            f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} only when "
            f"profiling a model file; {args.model} was profiled on {profile.device} "
            f"({profile.mode}): profile MODEL.py with {'it' if len(ignored) == 1 else 'them'}"
        )
    return profile


def _profiled_on(profile: Any, device: str) -> bool:
    """Whether ``--device device`` names the device ``profile`` was measured or counted on."""
    if profile.mode != "analytic":
        return device == profile.device
    from autopipe.profiler.catalog import get_device

    try:
        return get_device(device).name == profile.device
    except ValueError:
        return False


def _profile_model_file(args: argparse.Namespace) -> Any:
    from autopipe.modelfile import ModelFileError
    from autopipe.profiler.analytic import AnalyticProfileError
    from autopipe.profiler.catalog import DeviceSpecError
    from autopipe.profiler.measure import ProfilingError
    from autopipe.profiler.trace import TraceError
    from autopipe.profiler.units import UnitPatternError

    mf = load_model_arg(args.model)
    batch_size = args.batch_size or mf.default_batch_size()
    progress = not args.quiet
    # Kept on args: cmd_plan plans for this device's memory and links.
    device_spec = args._spec = _resolve_device_spec(args)
    try:
        if device_spec is not None:
            model = mf.build(device="meta")
            inputs = mf.inputs(batch_size)
            from autopipe.profiler.analytic import profile_analytic

            if args.meta_init:
                raise UsageError(
                    "--meta-init measures unit by unit; with --device NAME nothing is measured "
                    "(the model is counted on meta anyway): drop one of them"
                )
            try:
                profile = profile_analytic(
                    model,
                    inputs,
                    device_spec,
                    dtype=args.dtype or "bfloat16",
                    granularity=args.granularity or "block",
                    loss_fn=mf.loss_fn,
                    progress=not args.quiet,
                    optimizer=args.optimizer or "auto",
                    bytes_per_parameter=args.bytes_per_parameter,
                    share=not args.no_share,
                    units=args.units,
                )
            except (AnalyticProfileError, DeviceSpecError) as exc:
                raise UsageError(str(exc)) from exc
        else:
            meta_init = args.meta_init or _too_big_to_build(mf, args.device_measure)
            model = mf.build(device="meta" if meta_init else None)
            inputs = mf.inputs(batch_size)
            from autopipe.profiler.measure import profile as measure_profile

            profile = measure_profile(
                model,
                inputs,
                device=args.device_measure,
                granularity=args.granularity or "block",
                loss_fn=mf.loss_fn,
                progress=progress,
                cache=not args.no_cache and not meta_init,
                optimizer=args.optimizer or "auto",
                bytes_per_parameter=args.bytes_per_parameter,
                meta_init=meta_init,
                share=not args.no_share,
                units=args.units,
            )
    except (
        ModelFileError,
        AnalyticProfileError,
        DeviceSpecError,
        TraceError,
        ProfilingError,
        UnitPatternError,
    ) as exc:
        raise UsageError(str(exc)) from exc
    except MODEL_ERRORS as exc:
        raise model_failed(mf, batch_size, exc) from exc
    profile.model = mf.label
    return profile


MODEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError)
"""What a model's own code raises on inputs it cannot take (wrong shapes or dtypes)."""


def model_failed(mf: Any, batch_size: int | None, exc: BaseException) -> UsageError:
    """The UsageError for a model that failed on its example inputs: bad input, whichever
    command ran it (profile, plan, bench), not an autopipe failure. Out of memory is no bad
    input: it is re-raised (exit 1)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        raise exc
    return UsageError(
        f"{mf.label}: the model failed on example_inputs({batch_size or ''}): "
        f"{type(exc).__name__}: {exc}"
    )


def available_memory_bytes(device: str | None) -> int | None:
    """Free memory of the profiling device: ``torch.cuda.mem_get_info`` on CUDA, else the
    host's ``MemAvailable`` (Linux); None when unknown."""
    import torch

    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _too_big_to_build(mf: Any, device: str | None) -> bool:
    """Whether the model's parameters and their gradients would not fit in the profiling
    device's free memory, so it must be measured unit by unit from the meta device (what
    ``--meta-init`` asks for). Builds the model on meta to count its bytes: O(parameters)."""
    try:
        model = mf.build(device="meta")
    except Exception:  # a factory that cannot run on meta is built for real
        return False
    state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    free = available_memory_bytes(device)
    if free is None or 2 * state <= free:
        return False
    from autopipe.humanize import format_bytes

    log.info(
        "%s holds %s of parameters and buffers; with gradients that is more than the %s free "
        "on %s, so it is built on meta and measured one unit at a time (--meta-init)",
        mf.label,
        format_bytes(state),
        format_bytes(free),
        device or "cpu",
    )
    return True


def _device_list(text: str | None) -> list[tuple[str, int]] | None:
    """``"a100-80gb:4,v100-32gb:4"`` -> ``[("a100-80gb", 4), ("v100-32gb", 4)]``: catalog
    devices in pipeline order with counts; ``None`` for a single device name (or none)."""
    if not text or text.startswith(("cuda", "cpu", "mps")) or ("," not in text and ":" not in text):
        return None
    out = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        if not name or n < 1:
            raise UsageError(
                f"--device {text!r}: expected NAME[:COUNT],... in pipeline order, e.g. a100-80gb:4,v100-32gb:4"
            )
        out.append((name, n))
    return out


def _heterogeneous_cluster(profile: Any, args: argparse.Namespace) -> Any:
    """A Cluster for ``--device A:n,B:m``: each device's memory and link from the catalog, its
    speed relative to the profiled device from re-pricing the analytic profile for it."""
    from autopipe.planner.cluster import Cluster
    from autopipe.profiler.calibrate import CalibrationError, reprice
    from autopipe.profiler.catalog import get_device, to_planner_device

    entries = _device_list(args.device) or []
    if profile.mode != "analytic":
        raise UsageError(
            "a device list needs analytic costs: profile with --device NAME (a catalog device)"
        )
    base_s = sum(u.forward_s + u.backward_s for u in profile.units)
    devices = []
    for name, count in entries:
        try:
            spec = get_device(name)
            repriced = profile if spec.name == profile.device else reprice(profile, spec)
        except (ValueError, CalibrationError) as exc:
            raise UsageError(str(exc)) from exc
        device = to_planner_device(spec, memory_bytes=args.memory)
        device.speed = base_s / sum(u.forward_s + u.backward_s for u in repriced.units)
        devices += [device] * count
    return Cluster(devices)


def _resolve_device_spec(args: argparse.Namespace) -> Any:
    """The analytic device from --device NAME / --device-spec FILE, or None to measure (on
    ``args.device_measure``: cpu, cuda[:i] or None for the default)."""
    name = getattr(args, "device", None)
    entries = _device_list(name)
    if entries:
        name = entries[0][0]  # costs are counted on the first device, then re-priced per device
    spec_path = getattr(args, "device_spec", None)
    args.device_measure = None
    if spec_path:
        from autopipe.profiler.catalog import load_device_spec

        try:
            return load_device_spec(spec_path)
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from exc
    if name is None or name in ("cpu", "mps") or name.startswith("cuda"):
        if name is not None:
            check_local_device(name, "--device")
        args.device_measure = name
        return None
    from autopipe.profiler.catalog import get_device

    try:
        return get_device(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


# -- commands ---------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    check_output_path(args.json, "--json", inputs=[args.model])
    check_output_path(args.save_profile, "--save-profile", inputs=[args.model])
    check_output_path(args.plot, "--plot", directory=True)
    check_distinct_outputs((args.json, "--json"), (args.save_profile, "--save-profile"))
    listed = sum(n for _, n in _device_list(args.device) or [])
    if listed and listed != args.gpus:
        raise UsageError(f"--device {args.device} lists {listed} devices but --gpus is {args.gpus}")
    if (
        args.data_parallel
        and args.allreduce_bandwidth is None
        and not (args.device or args.device_spec or args.model.endswith(".json"))
    ):
        raise UsageError(_NEED_BANDWIDTH)  # say so before spending time profiling
    if isinstance(args.data_parallel, int) and args.gpus % args.data_parallel:
        raise UsageError(
            f"--data-parallel {args.data_parallel} does not divide --gpus {args.gpus}: the "
            "GPUs are K stages x D replicas; give a divisor of --gpus or auto"
        )
    profile = _load_profile_or_model(args)
    from autopipe.planner import PlanningError, plan

    if args.gpus > len(profile.units) and not args.data_parallel:
        raise UsageError(
            f"--gpus {args.gpus} is more than the model's {len(profile.units)} units; use at most "
            f"{len(profile.units)} or a finer --granularity (module or node)"
        )
    batch = args.batch_size or profile.batch_size
    m = args.microbatches
    if isinstance(m, int) and batch % m:  # bad input (the planner would call it a failure)
        from autopipe.planner.search import divisor_hint

        raise UsageError(
            f"--microbatches {m} does not divide the batch size {batch}; " + divisor_hint(batch, m)
        )
    if args.save_profile:
        profile.save(args.save_profile)
    gpus, memory, cluster = args.gpus, args.memory, None
    spec = _analytic_spec_for(profile, args)
    if _device_list(args.device):
        cluster = _heterogeneous_cluster(profile, args)
        gpus = memory = None
    elif spec is not None:
        # Plan for the catalog device's capacity and links unless --memory overrides it.
        from autopipe.profiler.catalog import to_planner_cluster

        cluster = to_planner_cluster(spec, args.gpus, memory_bytes=args.memory)
        gpus = memory = None
    options = {
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "checkpoint": args.checkpoint,
        "strategy": args.strategy,
        "optimizer": args.optimizer or "auto",
        "bytes_per_parameter": args.bytes_per_parameter,
    }
    try:
        if args.data_parallel:
            result = _plan_data_parallel(profile, args, cluster, memory, options)
        else:
            result = plan(profile, gpus=gpus, memory_per_device=memory, cluster=cluster, **options)
    except PlanningError as exc:
        raise Failure(str(exc)) from exc
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    from autopipe.report import format_plan, format_scaling

    _say(args, format_plan(result))
    if args.scaling:
        from autopipe.planner import scaling_report

        rows = scaling_report(
            profile,
            args.gpus,
            device=cluster.devices[0] if cluster is not None else None,
            memory_per_device=memory,
            batch_size=args.batch_size,
            microbatches=args.microbatches,
            schedule=args.schedule,
            checkpoint=args.checkpoint,
            optimizer=args.optimizer or "auto",
            bytes_per_parameter=args.bytes_per_parameter,
        )
        result.meta["scaling"] = rows
        _say(args, "\n" + format_scaling(rows))
    if args.plot:
        # Before the JSON: plot_all stores what `autopipe plot` needs to redraw in plan.meta.
        from autopipe.viz import plot_all, too_many_tasks

        too_many = too_many_tasks(result)
        if too_many is not None:  # the plan itself is fine: keep it, skip only the plots
            warnings.warn(f"--plot skipped: {too_many}", stacklevel=1)
        else:
            paths = plot_all(result, args.plot, profile=profile, progress=not args.quiet)
            _say(args, "plots: " + ", ".join(str(p) for p in paths))
    # The profile travels with the plan: `autopipe plot` and tools can re-plan from it.
    result.meta.setdefault("profile", profile.to_dict())
    _emit_json(result.to_dict(), args.json)
    if args.json and args.json != "-":
        _say(args, f"plan written to {args.json}")
    return EXIT_OK


_NEED_BANDWIDTH = (
    "--data-parallel needs the gradient all-reduce bandwidth: pass --allreduce-bandwidth "
    "(bytes/s, e.g. 100GB) or plan for a catalog --device"
)


def _plan_data_parallel(
    profile: Any, args: argparse.Namespace, cluster: Any, memory: int | None, options: dict
) -> Any:
    """``--data-parallel auto|D``: ``--gpus`` devices as K stages x D replicas."""
    from autopipe.planner import plan_data_parallel

    if _device_list(args.device):
        raise UsageError("--data-parallel needs one kind of device; drop the NAME:COUNT list")
    device = cluster.devices[0] if cluster is not None else None
    bandwidth = args.allreduce_bandwidth
    if (
        bandwidth is None
        and device is not None
        and device.link_bandwidth_bytes_per_s < float("inf")
    ):
        bandwidth = device.link_bandwidth_bytes_per_s
    if bandwidth is None:
        raise UsageError(_NEED_BANDWIDTH)
    return plan_data_parallel(
        profile,
        args.gpus,
        replicas=args.data_parallel,
        allreduce_bandwidth_bytes_per_s=bandwidth,
        device=device,
        memory_per_device=memory,
        **options,
    )


def _analytic_spec_for(profile: Any, args: argparse.Namespace) -> Any:
    """The device an analytic profile was counted for (from the flags, or the saved profile)."""
    spec = getattr(args, "_spec", None)
    if spec is not None or profile.mode != "analytic":
        return spec
    from autopipe.profiler.catalog import get_device, is_catalog_device

    return get_device(profile.device) if is_catalog_device(profile.device) else None


def cmd_profile(args: argparse.Namespace) -> int:
    check_output_path(args.out, "--out", inputs=[args.model])
    check_output_path(args.json, "--json", inputs=[args.model])
    check_distinct_outputs((args.out, "--out"), (args.json, "--json"))
    profile = _profile_model_file(args)
    from autopipe.report import format_profile

    if args.out:
        profile.save(args.out)
    _say(args, format_profile(profile, verbose=args.verbose))
    if args.out:
        _say(args, f"profile written to {args.out}")
    _emit_json(profile.to_dict(), args.json)
    return EXIT_OK


def cmd_devices(args: argparse.Namespace) -> int:
    from autopipe.profiler.catalog import CATALOG

    rows = list(CATALOG.values())
    if args.json:
        import dataclasses

        _emit_json([dataclasses.asdict(s) for s in rows], "-")
        return EXIT_OK
    from autopipe.profiler.catalog import format_catalog

    _say(args, format_catalog(rows))
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    p = load_plan_file(args.plan)
    from autopipe.explain import explain

    text = explain(p)
    if args.json:
        _emit_json({"explanation": text.splitlines(), "plan": p.to_dict()}, "-")
    else:
        _say(args, text)
    return EXIT_OK


# -- parser -----------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, tracebacks on errors"
    )


def json_option(p: argparse.ArgumentParser, help_text: str) -> None:
    """``--json`` alone: JSON on stdout (human output off); ``--json PATH``: a file."""
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help=help_text)


def model_and_plan_args(p: argparse.ArgumentParser) -> None:
    """``MODEL.py[:FACTORY] --plan PLAN.json``: what the commands that run a plan take."""
    p.add_argument("model", help="MODEL.py[:FACTORY] the plan was made for")
    p.add_argument(
        "--plan", required=True, metavar="PLAN.json", help="written by `autopipe plan --json`"
    )


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        help="mini-batch size B (default: example_inputs' default)",
    )
    p.add_argument(
        "--device",
        help="measure on 'cpu'/'cuda[:i]' (default: cpu), or plan for a catalog GPU analytically (see `autopipe devices`)",
    )
    p.add_argument(
        "--device-spec",
        metavar="FILE",
        help="your own device spec (YAML or JSON) for analytic costs",
    )
    p.add_argument("--dtype", help="analytic dtype (default bfloat16)")
    p.add_argument(
        "--granularity",
        choices=["block", "module", "node"],
        help="what a unit is (default: block)",
    )
    p.add_argument(
        "--units",
        type=_unit_patterns,
        metavar="PATTERNS",
        help="name the units yourself: comma-separated fnmatch patterns over module paths, "
        "e.g. 'model.layers.*' (every match is a unit, and so is every module beside them)",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="re-measure even if a cached profile matches"
    )
    from autopipe.profiler.optimizer_state import CLI_OPTIMIZERS

    p.add_argument(
        "--optimizer",
        choices=CLI_OPTIMIZERS,
        help="training state per parameter: weights, gradients and this optimizer's state "
        "(default: mixed-adam for 16-bit parameters, 16 B; adam for fp32, 16 B)",
    )
    p.add_argument(
        "--bytes-per-parameter",
        type=positive_float("a positive number of bytes"),
        metavar="BYTES",
        help="training-state bytes per parameter (weights + gradients + optimizer state), "
        "overriding --optimizer",
    )
    p.add_argument(
        "--no-share",
        action="store_true",
        help="measure (or count) every unit, even identical ones (slower and, measured, "
        "noisier: for comparison)",
    )
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build the model on the meta device and measure it one unit at a time, "
        "materializing only that unit's weights (for models larger than the device; "
        "automatic when parameters and gradients would not fit)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopipe",
        description="Automatic GPipe-style pipeline parallelism for PyTorch: profile, plan, run.",
        epilog="example: autopipe plan examples/gpt.py --gpus 8",
    )
    from autopipe import __version__

    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "plan",
        help="profile a model (or read a profile) and print the best pipeline plan",
        formatter_class=fmt,
        description="Cut a model into K pipeline stages, choose micro-batches and re-materialization.",
        epilog="examples:\n  autopipe plan examples/gpt.py --gpus 8 --json plan.json\n"
        "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb\n"
        "  autopipe plan profile.json --gpus 4 --memory 16GiB\n"
        "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb:4,v100-32gb:4 --dtype float16",
    )
    p.add_argument("model", help="MODEL.py[:FACTORY] or a saved PROFILE.json")
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of pipeline stages K")
    p.add_argument(
        "--microbatches", type=_microbatches, default="auto", help="M, or 'auto' (default)"
    )
    p.add_argument(
        "--memory",
        type=_memory,
        help="memory per device, e.g. 80GiB (default: unlimited, or the catalog device's)",
    )
    p.add_argument(
        "--checkpoint",
        choices=["never", "auto", "always", "except_last"],
        default="auto",
        help="re-materialization (default: auto, only where memory needs it)",
    )
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "auto"], default="gpipe")
    p.add_argument(
        "--strategy", choices=["dp", "ilp", "uniform", "parameters", "greedy-time"], default="dp"
    )
    json_option(p, "write the plan as JSON to PATH (stdout if no PATH)")
    p.add_argument(
        "--plot", metavar="DIR", help="write the timeline, bubble, balance and scaling plots to DIR"
    )
    p.add_argument("--save-profile", metavar="PATH", help="also save the profile as JSON")
    p.add_argument(
        "--data-parallel",
        metavar="auto|D",
        type=_microbatches,
        help="use --gpus devices as K stages x D data-parallel replicas; 'auto' picks D",
    )
    p.add_argument(
        "--allreduce-bandwidth",
        type=_memory,
        metavar="BYTES_PER_S",
        help="gradient all-reduce bandwidth per device for --data-parallel, e.g. 100GB "
        "(default: the catalog device's link)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also plan K = 1..--gpus and print throughput and memory per K (and the fewest GPUs that fit)",
    )
    _model_options(p)
    _common(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "profile",
        help="measure (or count) per-unit time and memory and save a profile",
        formatter_class=fmt,
        epilog="example:\n  autopipe profile examples/gpt.py --out profile.json",
    )
    p.add_argument("model", help="MODEL.py[:FACTORY]")
    p.add_argument("--out", "-o", metavar="PATH", help="write the profile JSON here")
    json_option(p, "also write the profile JSON to PATH (stdout if no PATH)")
    _model_options(p)
    _common(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser(
        "devices",
        help="list the built-in device catalog",
        epilog="example: autopipe devices --json",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    _common(p)
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser(
        "explain", help="print a plan's reasoning", epilog="example: autopipe explain plan.json"
    )
    p.add_argument("plan", help="PLAN.json written by `autopipe plan --json`")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    _common(p)
    p.set_defaults(func=cmd_explain)

    # plot, bench and run live beside the plotting and distributed code.
    from autopipe.cli_run import register_run
    from autopipe.cli_viz import register_bench, register_plot

    for register in (register_plot, register_bench, register_run):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
        format="%(message)s",
    )
    try:
        with warnings.catch_warnings():
            if not args.verbose:  # one line each, as errors are; -v keeps Python's format
                warnings.showwarning = _warning_line
            return args.func(args)
    except UsageError as exc:
        return _fail(args, exc, EXIT_USAGE)
    except (Failure, MemoryError) as exc:
        return _fail(args, exc, EXIT_FAILURE)
    except KeyboardInterrupt:
        _end_progress_bars()
        print(f"{_line_prefix}autopipe: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else is still one line unless -v
        return _fail(args, exc, EXIT_FAILURE, prefix=f"{type(exc).__name__}: ")


def _warning_line(message: Warning | str, *_: Any, **__: Any) -> None:
    text = str(message).strip().splitlines()
    _end_progress_bars()
    print(
        f"{_line_prefix}autopipe: warning: {text[0] if text else type(message).__name__}",
        file=sys.stderr,
    )


def _end_progress_bars() -> None:
    """Close progress bars an error interrupted, so the message starts its own line.

    A bar left open holds a half-written line on stderr (tqdm redraws it with carriage
    returns, never a newline): closing it clears it on a terminal; in a log, where the
    clearing shows as spaces, a newline ends it."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    bars = list(getattr(tqdm, "_instances", ()))
    for bar in bars:
        bar.close()
    if bars and not sys.stderr.isatty():
        sys.stderr.write("\n")


def _fail(args: argparse.Namespace, exc: BaseException, code: int, prefix: str = "") -> int:
    _end_progress_bars()
    if args.verbose:
        traceback.print_exc()
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(f"{_line_prefix}autopipe {args.command}: error: {prefix}{message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    # Run the package's copy of this module, not __main__'s: commands in other modules
    # (cli_run, cli_viz) raise autopipe.cli's exception classes, which main() must catch.
    from autopipe.cli import main as _main

    raise SystemExit(_main())
