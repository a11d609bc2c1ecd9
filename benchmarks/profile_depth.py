"""Measured profiling cost and plan stability against depth: identical blocks measured once.

A stack of ``nn.TransformerEncoderLayer`` blocks (d_model 256, batch 8, seq 64;
benchmarks/models/encoder_stack.py) at 4, 16 and 48 layers:

1. ``autopipe profile`` wall time (the whole command, imports included), with identical
   blocks measured once (default) and every block measured (``--no-share``, as before),
   interleaved, ``--runs`` times; per run the ratio 48 / 4 blocks of each way, and the
   median (min..max) over the runs; target: 48 blocks within 1.5x of 4 blocks;
2. plan stability: the 48-layer stack re-profiled ``--reprofiles`` times each way and
   planned on 7 stages (48 = 6 x 7 + 6: which stage gets 6 layers is decided by the costs),
   distinct plans counted, and the spread of the 48 copies' measured times.

    .venv/bin/python benchmarks/profile_depth.py [--runs 5] [--reprofiles 5] [--only cost|stability]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spread import MACHINE, add_runs_argument, spread

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models"
AUTOPIPE = Path(sys.executable).parent / "autopipe"
DEPTHS = (4, 16, 48)


def profile_command_s(layers: int, share: bool) -> float:
    command = [
        str(AUTOPIPE), "profile", f"{MODELS / 'encoder_stack.py'}:layers_{layers}",
        "--no-cache", "-q", *([] if share else ["--no-share"]),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def cost_and_ratio(runs: int) -> None:
    times: dict[tuple[int, bool], list[float]] = {(d, s): [] for d in DEPTHS for s in (True, False)}
    for run in range(runs):
        for share in (True, False):
            for depth in DEPTHS:
                times[depth, share].append(profile_command_s(depth, share))
        print(f"run {run + 1}/{runs} done", file=sys.stderr)
    print(f"autopipe profile wall time, median (min..max) of {runs} interleaved runs ({MACHINE})")
    print(f"{'layers':>6}  {'every block measured':>24}  {'identical measured once':>24}")
    for depth in DEPTHS:
        cells = [spread(times[depth, share], "{:.1f}", " s") for share in (False, True)]
        print(f"{depth:>6}  {cells[0]:>24}  {cells[1]:>24}")
    for share, label in ((False, "every block measured"), (True, "identical measured once")):
        # Each run's own ratio: its 48- and 4-layer commands ran minutes apart at most.
        ratios = [a / b for a, b in zip(times[48, share], times[4, share], strict=True)]
        med = statistics.median(ratios)
        verdict = "" if not share else f"  (target <= 1.5: {'pass' if med <= 1.5 else 'FAIL'})"
        print(f"48 / 4 blocks, {label}: {spread(ratios, unit='x')}{verdict}")


def stability(reprofiles: int, layers: int = 48, stages: int = 7) -> None:
    sys.path.insert(0, str(MODELS))
    import encoder_stack
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest

    model, x = encoder_stack.build_model(layers), encoder_stack.example_inputs(8)
    print(f"\nplan stability: {layers} layers on {stages} stages, {reprofiles} re-profiles each")
    for share, label in ((False, "every block measured"), (True, "identical measured once")):
        plans, spreads, gaps = [], [], []
        profiles = []
        for _ in range(reprofiles):
            p = profile(model, x, MeasureOptions(share=share), progress=False)
            blocks = [u.forward_s + u.backward_s for u in p.units[1:-1]]
            spreads.append(max(blocks) / min(blocks) - 1)
            plans.append(plan(p, PlanRequest(gpus=stages, baselines=False)))
            profiles.append(p)
        distinct = sorted({tuple(q.balance) for q in plans})
        # How far apart the distinct plans are, judged by each profile's own costs.
        for p, q in zip(profiles, plans, strict=True):
            times = [iteration_s(p, b, q.microbatches) for b in distinct]
            gaps.append(max(times) / min(times) - 1)
        print(
            f"  {label:<24} {len(distinct)} distinct plan(s) in {reprofiles}; "
            f"copies' fwd+bwd spread {100 * statistics.median(spreads):.1f}% (median); "
            f"the plans' predicted iterations differ by {100 * max(gaps):.2f}% at most; "
            f"balances: {distinct}"
        )


def iteration_s(profile: object, balance: tuple[int, ...], microbatches: int) -> float:
    """Predicted GPipe iteration of the partition ``balance`` under ``profile``'s costs."""
    from autopipe.planner import Cluster, Device
    from autopipe.planner.assemble import simulate_costs
    from autopipe.planner.costs import CostModel

    cluster = Cluster([Device(name="cpu")] * len(balance))
    cm = CostModel(
        profile, cluster, batch_size=profile.batch_size, microbatches=microbatches,
        schedule="gpipe", checkpoint="never", state_bytes_per_parameter=16.0, headroom=0.1,
    )  # fmt: skip
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    return simulate_costs(cm.stage_costs(bounds), microbatches, "gpipe").iteration_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_runs_argument(parser)
    parser.add_argument("--reprofiles", type=int, default=5)
    parser.add_argument("--only", choices=["cost", "stability"], help="run one part")
    args = parser.parse_args()
    if args.only != "stability":
        cost_and_ratio(args.runs)
    if args.only != "cost":
        stability(args.reprofiles)


if __name__ == "__main__":
    main()
