"""A model larger than this machine, profiled by measurement: examples/gpt.py:gpt_7b.

6.86 B parameters are 25.6 GiB in fp32, more than this machine's memory. ``autopipe plan``
builds the model on the meta device and measures one unit at a time: each distinct unit's
weights are materialized, the unit is timed on the previous unit's real outputs, and freed
(identical blocks are measured once). Prints the command's wall time, its peak resident
memory, and the measured stage costs of the plan it made.

    .venv/bin/python benchmarks/meta_init_profile.py [--gpus 8] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    model_bytes = parameter_bytes()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    print(
        f"gpt_7b: {model_bytes / 2**30:.1f} GiB of fp32 parameters; this machine has {total / 2**30:.1f} GiB"
    )
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        command = [
            str(AUTOPIPE), "plan", f"{ROOT / 'examples' / 'gpt.py'}:gpt_7b",
            "--gpus", str(args.gpus), "--batch-size", str(args.batch_size),
            "--memory", "80GB", "--json", str(plan_path), "--no-cache",
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        if done.returncode != 0:
            print(done.stdout, done.stderr)
            raise SystemExit(done.returncode)
        plan = json.loads(plan_path.read_text())
    profile = plan["profile"]
    print(done.stdout.strip())
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
    print(f"command wall time   {wall_s:.0f} s (trace, measure, plan; imports included)")
    print(
        f"peak RSS            {peak_rss / 2**30:.2f} GiB ({100 * peak_rss / model_bytes:.0f}% of the model's parameters)"
    )


if __name__ == "__main__":
    main()
