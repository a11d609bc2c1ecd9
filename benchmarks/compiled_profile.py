"""Eager vs compiled measured profile of the examples' GPT, unit by unit (issue #34).

Profiles examples/gpt.py (default size, fp32, CPU, one thread, the thread-CPU clock) with
``MeasureOptions(compile=False)`` and ``compile=True`` (each measured unit's submodule
``torch.compile``'d, inductor) and prints, per measured unit, forward and backward medians
side by side with the compiled / eager ratio, saved-activation bytes of each, and the
totals over all units (shared units counted as often as they occur). Prints, asserts
nothing. Inductor compiles each distinct unit once (C++ on CPU): a few minutes.

    .venv/bin/python benchmarks/compiled_profile.py [--repeat 7] [--batch-size 16] [--device cuda]

On a GPU (``--device cuda``: CUDA events) the fused element-wise kernels are where compiling
pays; on the CPU the blocks are matmul-bound.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions

from autopipe.core.profile import Profile
from autopipe.modelfile import load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _measure(
    compiled: bool, repeat: int, batch_size: int | None, device: str
) -> tuple[Profile, float]:
    """examples/gpt.py profiled eager or compiled on ``device``, and the seconds it took."""
    ex = load_model_file(str(EXAMPLES / "gpt.py"))
    model, inputs = ex.build(), ex.inputs(batch_size)
    options = MeasureOptions(
        device=device, warmup=2, repeat=repeat, microbatch_sizes=(), compile=compiled
    )
    t0 = time.perf_counter()
    p = profile(model, inputs, options, loss_fn=ex.loss_fn, progress=False)
    return p, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    eager, eager_s = _measure(False, args.repeat, args.batch_size, args.device)
    compiled, compiled_s = _measure(True, args.repeat, args.batch_size, args.device)
    print(
        f"{'unit':10s} {'fwd eager ms':>12s} {'compiled':>9s} {'ratio':>6s}"
        f" {'bwd eager ms':>12s} {'compiled':>9s} {'ratio':>6s}"
        f" {'saved eager KiB':>15s} {'compiled':>9s}"
    )
    for e, c in zip(eager.units, compiled.units, strict=True):
        if e.measured_as:
            continue  # shares the measurement of an earlier unit: same figures
        copies = 1 + sum(u.measured_as == e.name for u in eager.units)
        name = e.name + (f" x{copies}" if copies > 1 else "")
        print(
            f"{name:10s} {e.forward_s * 1e3:12.3f} {c.forward_s * 1e3:9.3f}"
            f" {c.forward_s / e.forward_s:6.2f} {e.backward_s * 1e3:12.3f}"
            f" {c.backward_s * 1e3:9.3f} {c.backward_s / e.backward_s:6.2f}"
            f" {e.activation_bytes / 2**10:15.1f} {c.activation_bytes / 2**10:9.1f}"
        )
    ef, cf = (sum(u.forward_s for u in p.units) for p in (eager, compiled))
    eb, cb = (sum(u.backward_s for u in p.units) for p in (eager, compiled))
    ea, ca = (sum(u.activation_bytes for u in p.units) for p in (eager, compiled))
    print(
        f"{'all units':10s} {ef * 1e3:12.3f} {cf * 1e3:9.3f} {cf / ef:6.2f}"
        f" {eb * 1e3:12.3f} {cb * 1e3:9.3f} {cb / eb:6.2f}"
        f" {ea / 2**10:15.1f} {ca / 2**10:9.1f}"
    )
    m = compiled.measurement
    assert m is not None
    print(
        f"{eager.device}, batch {eager.batch_size}, clock={m.clock} threads={m.threads} warmup={m.warmup}"
        f" repeat={m.repeat}; profiling took {eager_s:.1f} s eager, {compiled_s:.1f} s compiled"
    )


if __name__ == "__main__":
    main()
