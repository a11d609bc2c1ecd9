"""What every ``autopipe`` command shares: errors and exit codes, argument types, output,
loaders for model files, profiles and plans, output-path checks, the shared flags and their
translation into the application layer's values (the devices, the profiling request).

Command modules (``autopipe/cli/plan.py``, ``run.py``, ...) import this module and the library,
never each other or the package's ``__init__`` (which dispatches to them): imports point one
way. Exit codes: 0 success, 1 failure (e.g. no plan fits memory), 2 bad usage or bad input;
``UsageError`` and ``Failure`` carry the one-line message ``main`` prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe import device_target
from autopipe.core.catalog import DeviceListError
from autopipe.core.datafile import (
    atomic_write_json,
    atomic_write_text,
    not_a_regular_file,
    strict_json,
)
from autopipe.core.errors import Failure, UsageError
from autopipe.core.humanize import parse_bandwidth, parse_bytes
from autopipe.core.mesh_rules import mesh_problems
from autopipe.core.optimizer import CLI_OPTIMIZERS
from autopipe.core.plan import PlanFormatError, load_plan
from autopipe.core.profile import Profile, ProfileFormatError
from autopipe.core.schedule_rules import preflight
from autopipe.modelfile import ModelFileError, load_model_file
from autopipe.outputs import check_output
from autopipe.profiling import ProfileRequest

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "Failure", "UsageError"]

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.device_target import DeviceTarget
    from autopipe.modelfile import ModelFile

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
    """What ``add_subparsers`` returns: each command module's ``register`` adds itself to it."""

log = logging.getLogger("autopipe")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# -- argument types ---------------------------------------------------------------------------


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
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


positive_int = int_at_least(1, "a positive integer")
nonnegative_int = int_at_least(0, "an integer >= 0")


def positive_float(
    what: str, *, at_least: float | None = None, at_most: float | None = None
) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (``what`` names it, with its unit, in the error):
    0, negatives, ``nan`` and ``inf`` are refused with one line, not a traceback later.
    ``at_least`` / ``at_most``: bounds past which the value cannot be honoured (an overflow
    or a timeout no clock takes), stated in the error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(
                f"expected {what}, got {text!r}: the minimum is {at_least:g}"
            )
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(
                f"expected {what}, got {text!r}: the maximum is {at_most:g}"
            )
        return value

    return parse


def microbatches(text: str) -> int | str:
    """An argparse type: ``auto`` or a positive integer (``--microbatches``, ``--data-parallel``)."""
    return "auto" if text == "auto" else positive_int(text)


def unit_patterns(text: str) -> list[str]:
    """An argparse type: comma-separated fnmatch patterns over module paths (``--units``)."""
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise argparse.ArgumentTypeError("expected module-path patterns, e.g. 'model.layers.*'")
    return patterns


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, ``80GiB``, ``40GB``, ``16e9`` (``--memory``)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bandwidth(text: str) -> float:
    """An argparse type: bytes per second, ``50GB/s``, ``50GB``, or bits, ``400Gb``,
    ``400Gbit/s`` (``--allreduce-bandwidth``, ``--inter-node-bandwidth``); an ambiguous
    unit (``gb``, ``50G``) is refused (:func:`autopipe.core.humanize.parse_bandwidth`)."""
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def image_formats(text: str) -> tuple[str, ...]:
    """An argparse type: ``png``, ``svg`` or ``png,svg`` (``--format`` of plot and bench)."""
    formats = tuple(f.strip().lower() for f in text.split(",") if f.strip())
    bad = [f for f in formats if f not in ("png", "svg")]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"formats must be png and/or svg, got {text!r}")
    return formats


# -- output -----------------------------------------------------------------------------------


def emit_text(text: str, target: str | None) -> None:
    """``text`` to stdout (``target`` None or ``-``) or, atomically, to the file ``target``."""
    if target is None or target == "-":
        sys.stdout.write(text)
        return

    atomic_write_text(target, text)


def emit_json(obj: Any, target: str | None) -> None:
    """``--json`` alone writes to stdout; ``--json PATH`` writes a file atomically. Either
    way strict JSON: non-finite numbers become null."""
    if target is None:
        return
    obj = strict_json(obj)
    if target == "-":
        sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False) + "\n")
        return
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


def line_prefix() -> str:
    """What every line the CLI prints starts with now (empty unless ``set_line_prefix``)."""
    return _line_prefix


def prefixed(text: str) -> str:
    """``text`` with the line prefix before each of its lines."""
    return "\n".join(_line_prefix + line for line in text.split("\n")) if _line_prefix else text


def say(args: argparse.Namespace, text: str) -> None:
    """Human output: suppressed by -q and when --json goes to stdout."""
    if args.quiet or getattr(args, "json", None) == "-":
        return
    print(prefixed(text))


# -- loaders ----------------------------------------------------------------------------------


def load_plan_file(path: str) -> Plan:
    """The Plan saved at ``path``; a missing or malformed file is a UsageError."""
    if not Path(path).is_file():
        what = not_a_regular_file(path)  # it exists: "not found" would send the user looking
        if what:
            raise UsageError(f"{path} is {what}, not a plan file (a JSON file `plan --json` wrote)")
        raise UsageError(f"plan file not found: {path} (write one with `autopipe plan --json`)")
    try:
        return load_plan(path)
    except PlanFormatError as exc:
        raise UsageError(str(exc)) from exc
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a JSON text file") from None


def load_profile_file(path: str) -> Profile:
    """The Profile saved at ``path``; a missing or malformed file is a UsageError."""
    if not Path(path).is_file():
        what = not_a_regular_file(path)
        if what:
            raise UsageError(f"{path} is {what}, not a profile file (a JSON file)")
        raise UsageError(f"profile file not found: {path}")
    try:
        return Profile.load(path)
    except ProfileFormatError as exc:
        raise UsageError(str(exc)) from exc
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a JSON text file") from None


def load_model_arg(spec: str) -> ModelFile:
    """The ``MODEL.py[:FACTORY]`` argument as a ModelFile; a bad one is a UsageError."""
    try:
        return load_model_file(spec)
    except ModelFileError as exc:
        raise UsageError(str(exc)) from exc


# -- checks before any work -------------------------------------------------------------------


def check_output_path(
    path: str | None,
    flag: str,
    *,
    directory: bool = False,
    inputs: Sequence[str | None] = (),
) -> None:
    """Refuse an output path that cannot be written, before any work is done (exit 2):
    :func:`autopipe.outputs.output_path_problem`, naming ``flag``. ``None`` and ``-``
    (stdout) are always fine; an empty path is refused."""
    if path == "":  # Path("") is the current folder: never what an empty argument meant
        raise UsageError(
            f"{flag} is empty; give a path" + ("" if directory else " (or - for stdout)")
        )
    if path is None or path == "-":
        return
    check_output(path, flag, directory=directory, inputs=inputs)


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


def refuse_broken_rules(plan: Plan, path: str) -> None:
    """A plan the pre-flight refuses (``autopipe.core.schedule_rules``: one torch would not
    build a schedule for) cannot run: exit 2 in one line naming ``path`` and the first rule."""
    problems = preflight(plan) + mesh_problems(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"{path}: the plan cannot run: {problems[0]}{more}")


# -- devices and profiling requests from the flags --------------------------------------------


def device_flags(args: argparse.Namespace) -> DeviceTarget:
    """What ``--device`` / ``--device-spec`` ask for, resolved once per command
    (:func:`autopipe.device_target.resolve_devices`). A malformed list, an unknown name or a bad
    spec file is a UsageError; a local device is checked when something is measured on it."""
    try:
        # through the module, so that a test counting the calls (test_placement) sees them
        return device_target.resolve_devices(
            getattr(args, "device", None), getattr(args, "device_spec", None)
        )
    except DeviceListError as exc:
        raise UsageError(f"--device {exc}") from exc
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


def profile_request(args: argparse.Namespace) -> ProfileRequest:
    """The flags of :func:`model_options` as a :class:`autopipe.profiling.ProfileRequest`."""
    return ProfileRequest(
        batch_size=args.batch_size,
        dtype=args.dtype,
        granularity=args.granularity,
        units=tuple(args.units or ()),
        cache=not args.no_cache,
        optimizer=args.optimizer or "auto",
        bytes_per_parameter=args.bytes_per_parameter,
        share=not args.no_share,
        split_backward=not args.no_split_backward,
        scale_to_reference=args.scale_to_reference,
        meta_init=args.meta_init,
        compile=args.compile,
        progress=not args.quiet,
    )


# -- flags several commands take --------------------------------------------------------------


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """``-q``/``--quiet`` and ``-v``/``--verbose``, which every command takes."""
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


def model_options(p: argparse.ArgumentParser) -> None:
    """The flags that say how to profile a model file (``plan`` and ``profile``)."""
    _model_unit_flags(p)
    _training_state_flags(p)
    _measurement_flags(p)


def _model_unit_flags(p: argparse.ArgumentParser) -> None:
    """The batch, the device (measured or a catalog spec), the dtype, what a unit is, the cache."""
    p.add_argument(
        "--batch-size",
        type=positive_int,
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
        type=unit_patterns,
        metavar="PATTERNS",
        help="name the units yourself: comma-separated fnmatch patterns over module paths, "
        "e.g. 'model.layers.*' (every match is a unit, and so is every module beside them)",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="re-measure even if a cached profile matches"
    )


def _training_state_flags(p: argparse.ArgumentParser) -> None:
    """The training state per parameter: the optimizer, or its bytes."""
    p.add_argument(
        "--optimizer",
        choices=CLI_OPTIMIZERS,
        help="training state per parameter: weights, gradients and this optimizer's state "
        "(default: mixed-adam for 16-bit parameters, 16 B; adam for fp32, 16 B)",
    )
    p.add_argument(
        "--bytes-per-parameter",
        # 10^6 B/parameter keeps a 10^12-parameter model's bytes well inside 64-bit integers.
        type=positive_float("a positive number of bytes", at_most=1e6),
        metavar="BYTES",
        help="training-state bytes per parameter (weights + gradients + optimizer state), "
        "overriding --optimizer",
    )


def _measurement_flags(p: argparse.ArgumentParser) -> None:
    """How a measured profile is taken: sharing, the split backward, scaling, meta init."""
    p.add_argument(
        "--no-share",
        action="store_true",
        help="measure (or count) every unit, even identical ones (slower and, measured, "
        "noisier: for comparison)",
    )
    p.add_argument(
        "--no-split-backward",
        action="store_true",
        help="measured: do not time each unit's backward split into input and weight "
        "gradients (one forward and backward less per unit and round; the zero-bubble "
        "schedules are then planned with the stated default split, docs/cost-model.md)",
    )
    p.add_argument(
        "--scale-to-reference",
        action="store_true",
        help="measured: also time the whole model in one piece and scale the units' times "
        "to add up to it (units timed alone run with hot caches, faster than in the chain)",
    )
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build the model on the meta device and measure it one unit at a time, "
        "materializing only that unit's weights (for models larger than the device; "
        "automatic when parameters and gradients would not fit)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the trainer torch.compile's its stages: time each measured unit compiled "
        "(element-wise ops fused; inductor compiles each distinct unit once, untimed; no "
        "input/weight backward split timed). Counted profiles (--device NAME) cannot be "
        "compiled; `plan --compile` also rules out the split-backward schedules",
    )
