"""Measured profiling cost and plan stability against depth: identical blocks measured once.

A stack of ``nn.TransformerEncoderLayer`` blocks (d_model 256, batch 8, seq 64;
benchmarks/models/encoder_stack.py) at 4, 16 and 48 layers:

1. ``autopipe profile`` wall time (the whole command, imports included), with identical
   blocks measured once (default) and every block measured (``--no-share``, as before),
   interleaved runs, medians; target: 48 blocks within 1.5x of 4 blocks;
2. plan stability: the 48-layer stack re-profiled ``--reprofiles`` times each way and
   planned on 7 stages (48 = 6 x 7 + 6: which stage gets 6 layers is decided by the costs),
   distinct plans counted, and the spread of the 48 copies' measured times.

    .venv/bin/python benchmarks/profile_depth.py [--repeats 3] [--reprofiles 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def cost_and_ratio(repeats: int) -> None:
    times: dict[tuple[int, bool], list[float]] = {(d, s): [] for d in DEPTHS for s in (True, False)}
    for _ in range(repeats):
        for share in (True, False):
            for depth in DEPTHS:
                times[depth, share].append(profile_command_s(depth, share))
    print("autopipe profile wall time, medians of", repeats, "interleaved runs")
    print(f"{'layers':>6}  {'every block measured':>20}  {'identical measured once':>23}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for depth in DEPTHS:
        print(f"{depth:>6}  {med[depth, False]:>18.1f} s  {med[depth, True]:>21.1f} s")
    for share, label in ((False, "every block measured"), (True, "identical measured once")):
        ratio = med[48, share] / med[4, share]
        verdict = (
            ""
            if not share
            else ("  (target <= 1.5: pass)" if ratio <= 1.5 else "  (target <= 1.5: FAIL)")
        )
        print(f"48 / 4 blocks, {label}: {ratio:.2f}x{verdict}")


def stability(reprofiles: int, layers: int = 48, stages: int = 7) -> None:
    sys.path.insert(0, str(MODELS))
    import encoder_stack
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile

    model, x = encoder_stack.build_model(layers), encoder_stack.example_inputs(8)
    print(f"\nplan stability: {layers} layers on {stages} stages, {reprofiles} re-profiles each")
    for share, label in ((False, "every block measured"), (True, "identical measured once")):
        plans, spreads = [], []
        for _ in range(reprofiles):
            p = profile(model, x, progress=False, share=share)
            blocks = [u.forward_s + u.backward_s for u in p.units[1:-1]]
            spreads.append(max(blocks) / min(blocks) - 1)
            plans.append(tuple(plan(p, stages, baselines=False).balance))
        print(
            f"  {label:<24} {len(set(plans))} distinct plan(s) in {reprofiles}; "
            f"copies' fwd+bwd spread {100 * statistics.median(spreads):.1f}% (median); "
            f"balances: {sorted(set(plans))}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reprofiles", type=int, default=5)
    args = parser.parse_args()
    cost_and_ratio(args.repeats)
    stability(args.reprofiles)


if __name__ == "__main__":
    main()
