"""The whole ``autopipe plan`` command in analytic mode on Llama-2-7B and a 70B-class config.

Hugging Face ``LlamaForCausalLM`` built from Llama-2's shapes on the meta device
(benchmarks/models/hf_llama.py, random weights, nothing downloaded), batch 8 x 4096 tokens,
planned for H100s: 7B (32 layers) on 8, 70B (80 layers) on 32. Each command runs in a fresh
process, so imports (torch, transformers) count. Repeated blocks counted once (default) vs
every block counted (``--no-share``, as before), interleaved, ``--runs`` times: median
(min..max) of wall time and median of the process's CPU time (user + system, which other
load on a shared host inflates less), and each run's ratio of the two ways.
Targets: 7B within 8 s, 70B within 10 s.

    .venv/bin/python benchmarks/analytic_llama.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spread import MACHINE, add_runs_argument, spread

ROOT = Path(__file__).resolve().parent.parent
AUTOPIPE = Path(sys.executable).parent / "autopipe"
CASES = {"llama2_7b": (8, 8.0), "llama2_70b": (32, 10.0)}


def run(factory: str, gpus: int, share: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``autopipe plan`` process."""
    command = [
        str(AUTOPIPE), "plan", f"{ROOT / 'benchmarks' / 'models' / 'hf_llama.py'}:{factory}",
        "--gpus", str(gpus), "--device", "h100", "-q", *([] if share else ["--no-share"]),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_runs_argument(parser)
    args = parser.parse_args()
    runs: dict[tuple[str, bool], list[tuple[float, float]]] = {
        (f, s): [] for f in CASES for s in (True, False)
    }
    for run_index in range(args.runs):
        for share in (True, False):
            for factory, (gpus, _) in CASES.items():
                runs[factory, share].append(run(factory, gpus, share))
        print(f"run {run_index + 1}/{args.runs} done", file=sys.stderr)
    print(
        f"autopipe plan --device h100, {args.runs} interleaved runs ({MACHINE}): wall median "
        "(min..max) / CPU median"
    )
    print(f"{'model':<12} {'every block counted':>28} {'repeated blocks once':>28} {'target':>8}")
    for factory, (_, target) in CASES.items():
        cells = []
        for share in (False, True):
            wall = spread([w for w, _ in runs[factory, share]], "{:.1f}", " s")
            cpu = statistics.median(c for _, c in runs[factory, share])
            cells.append(f"{wall} / {cpu:.1f} s")
        wall_after = statistics.median(w for w, _ in runs[factory, True])
        verdict = "pass" if wall_after <= target else "FAIL"
        print(f"{factory:<12} {cells[0]:>28} {cells[1]:>28} {target:>5.0f} s {verdict}")
        ratios = [
            a / b for (a, _), (b, _) in zip(runs[factory, False], runs[factory, True], strict=True)
        ]
        print(f"{'':<12} every block / repeated once, per run: {spread(ratios, unit='x')}")


if __name__ == "__main__":
    main()
