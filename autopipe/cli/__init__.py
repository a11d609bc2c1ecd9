"""The ``autopipe`` command line: ``main`` parses the arguments and runs one command.

Each command is a module here (``plan``, ``profile``, ``devices``, ``explain``, ``emit``, ``plot``,
``bench``, ``run``, ``replay``) with ``register(subparsers)`` and its ``cmd_*`` function; they share only
``common`` (errors, exit codes, argument types, output, loaders) and the library. This module
imports the commands, never the other way round.

Exit codes: 0 success, 1 failure (e.g. no plan fits memory), 2 bad usage or bad input.
Errors are one line on stderr; ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from autopipe import __version__
from autopipe.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Failure,
    UsageError,
    line_prefix,
)
from autopipe.cli.run import fix_hash_seed, record_error_for_torchrun

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "Failure", "UsageError", "build_parser", "main"]

COMMANDS = ("plan", "profile", "devices", "explain", "emit", "plot", "bench", "run", "replay")
"""The command modules, in the order ``autopipe --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``autopipe`` argument parser with every command's subparser."""
    parser = argparse.ArgumentParser(
        prog="autopipe",
        description="Automatic GPipe-style pipeline parallelism for PyTorch: profile, plan, run.",
        epilog="example: autopipe plan examples/gpt.py --gpus 8",
    )

    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"autopipe.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopipe`` command line on ``argv`` (default: ``sys.argv[1:]``); returns the
    exit code.

    With ``argv`` None (the console script, ``python -m autopipe``: this process's own
    command line), ``autopipe run`` first re-executes the process with a fixed
    ``PYTHONHASHSEED`` when none is set (:func:`autopipe.cli.run.fix_hash_seed`)."""
    if argv is None:
        fix_hash_seed(sys.argv[1:])
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
        print(f"{line_prefix()}autopipe: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else is still one line unless -v
        return _fail(args, exc, EXIT_FAILURE, prefix=f"{type(exc).__name__}: ")


def console() -> NoReturn:
    """The ``autopipe`` console script and ``python -m autopipe``: :func:`main` on this
    process's command line, then exit with its code.

    A torchrun rank leaves without Python's teardown
    (:func:`autopipe.runtime.distributed.process.exit_process`): the teardown can destroy the
    process group's C++ threads while they are joinable and abort the rank (SIGABRT) after
    a clean run or instead of the failure's exit code. Everything is written by then."""
    code = main()
    dist = sys.modules.get("torch.distributed")
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    if dist is not None and dist.is_available() and (launched or dist.is_initialized()):
        from autopipe.runtime.distributed.process import exit_process

        exit_process(code)
    raise SystemExit(code)


def _warning_line(message: Warning | str, *_: Any, **__: Any) -> None:
    text = str(message).strip().splitlines()
    _end_progress_bars()
    print(
        f"{line_prefix()}autopipe: warning: {text[0] if text else type(message).__name__}",
        file=sys.stderr,
    )


def _end_progress_bars() -> None:
    """Close progress bars an error interrupted, so the message starts its own line.

    A bar left open holds a half-written line on stderr (tqdm redraws it with carriage
    returns, never a newline): closing it clears it on a terminal; in a log, where the
    clearing shows as spaces, a newline ends it."""
    # Without tqdm imported there is no bar; importing it only to find none would delay
    # the error line (a rank that torchrun is about to stop has little time).
    module = sys.modules.get("tqdm")
    if module is None:
        return
    bars = list(getattr(module.tqdm, "_instances", ()))
    for bar in bars:
        bar.close()
    if bars and not sys.stderr.isatty():
        sys.stderr.write("\n")


def _fail(args: argparse.Namespace, exc: BaseException, code: int, prefix: str = "") -> int:
    _end_progress_bars()
    if args.verbose:
        traceback.print_exc()
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # One write: ranks under torchrun share stderr, and a line written in two parts (text,
    # then print's newline) can be split by another rank's line.
    line = f"autopipe {args.command}: error: {prefix}{message}"
    sys.stderr.write(f"{line_prefix()}{line}\n")
    sys.stderr.flush()
    if args.command == "run":  # under torchrun, the line also ends its failure summary
        record_error_for_torchrun(line)
    return code
