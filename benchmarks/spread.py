"""The spread over runs that every benchmark prints: ``median (min..max)``, and ``--runs``.

A figure in the README is the median over ``--runs`` repeats of a benchmark, with the range
beside it, never the best run (issue 24). Benchmarks import this module as ``spread`` (their
folder is on ``sys.path`` when run as ``python benchmarks/NAME.py``). Running it does nothing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

MACHINE = "2-vCPU CPU VM, shared"
"""Where the README's figures were measured (the development VM; other jobs ran beside)."""


def spread(values: Sequence[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median (min..max)`` of ``values`` formatted with ``fmt`` and ``unit`` (e.g. ``"x"``,
    ``" s"``); one value alone is printed as it is, with ``(1 run)``."""
    if not values:
        raise ValueError("spread of no values")
    med = fmt.format(statistics.median(values)) + unit
    if len(values) == 1:
        return f"{med} (1 run)"
    return f"{med} ({fmt.format(min(values))}..{fmt.format(max(values))}{unit})"


def add_runs_argument(parser: argparse.ArgumentParser, default: int = 5, why: str = "") -> None:
    """``--runs N``: how many times the benchmark repeats its measurement (default ``default``;
    ``why`` says why a default is below 5)."""
    note = f"; {why}" if why else ""
    parser.add_argument(
        "--runs",
        type=int,
        default=default,
        help=f"repeat the measurement N times and print median (min..max) (default {default}{note})",
    )
