"""A model larger than this machine, profiled by measurement: examples/gpt.py:gpt_7b.

6.86 B parameters are 25.6 GiB in fp32, more than this machine's memory. ``autopipe plan``
builds the model on the meta device and measures one unit at a time: each distinct unit's
weights are materialized, the unit is timed on the previous unit's real outputs, and freed
(identical blocks are measured once). Prints the command's wall time and its peak resident
memory, median (min..max) over ``--runs`` runs (default 3, not 5: one run takes about two
minutes on 2 vCPUs), and the plan the last run made.

    .venv/bin/python benchmarks/meta_init_profile.py [--runs 3] [--gpus 8] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spread import MACHINE, add_runs_argument, spread

ROOT = Path(__file__).resolve().parent.parent
AUTOPIPE = Path(sys.executable).parent / "autopipe"


def parameter_bytes() -> int:
    """fp32 bytes of gpt_7b's parameters, counted on the meta device."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    with torch.device("meta"):
        model = gpt.gpt_7b()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_once(command: list[str]) -> tuple[float, int, str, str, int]:
    """(wall seconds, peak RSS bytes, stdout, stderr, exit status) of one process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        # wait4: this child's own peak RSS (RUSAGE_CHILDREN would keep the largest of all runs).
        _, status, usage = os.wait4(proc.pid, 0)
        wall_s = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return wall_s, usage.ru_maxrss * 1024, out.read(), err.read(), proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1)
    add_runs_argument(parser, 3, "one run takes about two minutes")
    args = parser.parse_args()
    model_bytes = parameter_bytes()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    print(
        f"gpt_7b: {model_bytes / 2**30:.1f} GiB of fp32 parameters; this machine has {total / 2**30:.1f} GiB"
    )
    walls, peaks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        command = [
            str(AUTOPIPE), "plan", f"{ROOT / 'examples' / 'gpt.py'}:gpt_7b",
            "--gpus", str(args.gpus), "--batch-size", str(args.batch_size),
            "--memory", "80GB", "--json", str(plan_path), "--no-cache",
        ]  # fmt: skip
        for run in range(args.runs):
            wall_s, peak_rss, stdout, stderr, status = run_once(command)
            if status != 0:
                print(stdout, stderr)
                raise SystemExit(status)
            walls.append(wall_s)
            peaks.append(peak_rss)
            print(f"run {run + 1}/{args.runs}: {wall_s:.0f} s", file=sys.stderr)
        plan = json.loads(plan_path.read_text())
    profile = plan["report"]["profile"]
    print(stdout.strip())
    print()
    print(
        f"profile mode        {profile['mode']} (meta_init={(profile.get('measurement') or {}).get('meta_init')})"
    )
    groups: dict[str, int] = {}
    for u in profile["units"]:
        if u.get("measured_as"):
            groups[u["measured_as"]] = groups.get(u["measured_as"], 1) + 1
    print(
        f"units measured      {len(profile['units']) - sum(g - 1 for g in groups.values())} of {len(profile['units'])}"
    )
    print(
        f"largest materialized {profile['meta']['materialized_peak_bytes'] / 2**30:.2f} GiB of weights at once"
    )
    print(f"{args.runs} runs ({MACHINE}), median (min..max):")
    print(
        f"command wall time   {spread(walls, '{:.0f}', ' s')} (trace, measure, plan; imports included)"
    )
    print(
        f"peak RSS            {spread([b / 2**30 for b in peaks], unit=' GiB')} "
        f"({100 * max(peaks) / model_bytes:.0f}% of the model's parameters at most)"
    )


if __name__ == "__main__":
    main()
