"""Plan quality: the plan against other splits of the same model, over several fresh profiles.

    .venv/bin/python benchmarks/plan_quality.py [--runs 5] [--gpus 8] [--model examples/gpt.py]

Runs ``autopipe plan MODEL --gpus K --no-cache --json PATH`` ``--runs`` times (each a fresh
profile of the model on this machine), reads each plan's own ``baselines`` (the rows that
``autopipe plan`` prints: other cuts of the same units at the plan's schedule and M, and
each framework's default split under the schedule that framework runs), and prints one
Markdown table: every split's predicted iteration time relative to the plan, median and
range over the runs. docs/benchmarks.md quotes its output verbatim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from spread import MACHINE, add_runs_argument, spread

ROOT = Path(__file__).resolve().parents[1]

LABELS = {
    "uniform": "`uniform`: equal unit counts",
    "parameters": "`parameters`: equal parameter counts",
    "greedy-time": "`greedy-time` (torchgpipe's `balance_by_time`, from its description)",
    "torchtitan-even": "torchtitan 0.2.2, even split",
    "megatron-uniform": "Megatron-Core 0.16, uniform layers",
    "deepspeed-parameters": 'DeepSpeed 0.19, `"parameters"`',
}
"""The rows in the order ``autopipe plan`` prints them (``Plan.baselines`` keys)."""


def one_run(model: str, gpus: int, directory: Path) -> dict[str, object]:
    """One ``autopipe plan`` run with a fresh profile; returns the plan's JSON."""
    out = directory / "plan.json"
    env = dict(os.environ, AUTOPIPE_CACHE_DIR=str(directory / "cache"))
    command = [
        sys.executable, "-m", "autopipe", "plan", model, "--gpus", str(gpus),
        "--no-cache", "--json", str(out), "-q",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    data = json.loads(out.read_text())
    plan: dict[str, object] = {**data, **data.pop("report")}  # the plan and its figures
    return plan


def ratio_cell(ratios: list[float], reasons: list[str], runs: int) -> str:
    """``median (min..max)`` of the feasible runs, or why the split was not priced."""
    if not ratios:
        return f"n/a: {reasons[0]}" if reasons else "n/a"
    text = spread(ratios) if len(ratios) > 1 else f"{ratios[0]:.2f}"
    if len(ratios) < runs:
        text += f", priced in {len(ratios)} of {runs} runs"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_runs_argument(parser)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--model", default="examples/gpt.py")
    args = parser.parse_args()
    plans = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            plans.append(one_run(args.model, args.gpus, Path(tmp)))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    times = [float(p["iteration_time_s"]) for p in plans]  # type: ignore[arg-type]
    schedules = sorted({str(p["schedule"]) for p in plans})
    ms = sorted({int(p["microbatches"]) for p in plans})  # type: ignore[call-overload]
    print(
        f"`autopipe plan {args.model} --gpus {args.gpus}`, {args.runs} runs ({MACHINE}), each "
        f"a fresh profile; the plan: schedule {'/'.join(schedules)}, M = {'/'.join(map(str, ms))}, "
        f"predicted iteration {spread([t * 1e3 for t in times], '{:.0f}', ' ms')}."
    )
    print()
    print("| split | iteration time vs the plan: median (range) |")
    print("|---|---|")
    print("| autopipe (the plan) | 1.00 |")
    for name, label in LABELS.items():
        ratios, reasons = [], []
        for plan, time_s in zip(plans, times, strict=True):
            row = plan.get("baselines", {}).get(name)  # type: ignore[attr-defined]
            if row is None:
                continue
            if row.get("feasible") and row.get("iteration_time_s"):
                ratios.append(float(row["iteration_time_s"]) / time_s)
            elif row.get("reason"):
                reasons.append(str(row["reason"]))
        print(f"| {label} | {ratio_cell(ratios, reasons, args.runs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
