"""Measured profiler self-consistency on this machine, for each example model.

For gpt, resnet and mlp (examples/, default sizes, fp32, CPU) it profiles with
``autopipe.profiler.measure.profile`` ``--trials`` times and prints, side by side, the sum
of the per-unit forward+backward seconds and the whole model's forward+backward seconds
timed in the same interleaved rounds (median over trials and their ratio), the per-unit
saved-activation bytes against the whole model's, and parameter bytes against
``sum(p.numel() * p.element_size())``. ``--clock wall`` shows the wall-clock figures, which
on a shared host include other processes' time.

    .venv/bin/python benchmarks/measured_profile_check.py [--trials 3] [--clock auto|wall|thread_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions

from autopipe.modelfile import ModelFile, load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModelFile:
    """examples/<name>.py as the CLI loads it (factory, inputs, optional loss)."""
    return load_model_file(str(EXAMPLES / f"{name}.py"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--clock", default="auto", choices=["auto", "wall", "thread_cpu"])
    parser.add_argument("--models", default="gpt,resnet,mlp")
    args = parser.parse_args()

    print(
        f"{'model':8s} {'units':>5s} {'sum(units) ms':>13s} {'whole ms':>9s} {'time %':>7s}"
        f" {'act. units MiB':>14s} {'act. whole MiB':>14s} {'act. %':>7s} {'params exact':>12s}"
        f" {'profile s':>9s}"
    )
    for name in args.models.split(","):
        ex = load_example(name)
        model = ex.build()
        inputs = ex.inputs(None)
        loss_fn = ex.loss_fn
        units_s, whole_s, seconds = [], [], []
        for _ in range(args.trials):
            t0 = time.perf_counter()
            p = profile(
                model,
                inputs,
                MeasureOptions(
                    repeat=args.repeat,
                    microbatch_sizes=(),
                    clock=args.clock,
                    reference=True,  # the whole model in one piece: what the units must add up to
                ),
                loss_fn=loss_fn,
                progress=False,
            )
            seconds.append(time.perf_counter() - t0)
            units_s.append(sum(u.forward_s + u.backward_s for u in p.units))
            whole_s.append(p.total_forward_s + p.total_backward_s)
        u_med, w_med = statistics.median(units_s), statistics.median(whole_s)
        act_units = sum(u.activation_bytes for u in p.units)
        exact = p.parameter_bytes_total == sum(
            q.numel() * q.element_size() for q in model.parameters()
        )
        print(
            f"{name:8s} {len(p.units):5d} {u_med * 1e3:13.1f} {w_med * 1e3:9.1f}"
            f" {100 * (u_med / w_med - 1):+6.1f}% {act_units / 2**20:14.2f}"
            f" {p.total_activation_bytes / 2**20:14.2f}"
            f" {100 * (act_units / p.total_activation_bytes - 1):+6.2f}% {str(exact):>12s}"
            f" {statistics.median(seconds):9.1f}"
        )
    print(
        f"clock={p.measurement.clock} threads={p.measurement.threads} trials={args.trials} repeat={args.repeat}"
    )


if __name__ == "__main__":
    main()
