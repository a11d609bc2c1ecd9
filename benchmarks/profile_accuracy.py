"""Analytic vs measured profiles on this machine's CPU, for each example model.

For gpt, resnet and mlp (examples/, default sizes, fp32) it prints per unit:
the share of the training step (forward + backward) each unit takes according to

* the analytic profile priced with the nominal ``"cpu"`` catalog spec,
* the same analytic profile after ``calibrate`` fitted its three factors to the measured run,
* the measured profile (``autopipe.profiler.measure.profile``),

then the memory comparison: whole-model bytes saved for backward counted in a real fp32 CPU
step (``whole_model_saved_bytes``) vs the analytic estimate. Medians of ``--repeats`` runs.

    .venv/bin/python benchmarks/profile_accuracy.py [--repeats 5] [--models gpt,resnet,mlp]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.calibrate import calibrate, reprice
from autopipe.profiler.measure import profile as measured_profile
from autopipe.profiler.measure import whole_model_saved_bytes
from autopipe.profiler.options import AnalyticOptions, MeasureOptions

from autopipe.core.profile import Profile
from autopipe.modelfile import ModelFile, load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModelFile:
    """examples/<name>.py as the CLI loads it (factory, inputs, optional loss)."""
    return load_model_file(str(EXAMPLES / f"{name}.py"))


def measure(model: torch.nn.Module, inputs: Any, loss_fn: Any, repeats: int) -> Profile:
    """The measured profile of ``model`` on this machine's CPU (``repeat`` timed rounds)."""
    kwargs: dict[str, Any] = {"loss_fn": loss_fn} if loss_fn else {}
    return measured_profile(model, inputs, MeasureOptions(repeat=repeats), progress=False, **kwargs)


def shares(profile: Profile) -> list[float]:
    total = sum(u.forward_s + u.backward_s for u in profile.units)
    return [(u.forward_s + u.backward_s) / total for u in profile.units]


def compare(name: str, repeats: int) -> dict[str, float]:
    example = load_example(name)
    model = example.build()
    inputs = example.inputs(None)
    loss_fn = example.loss_fn
    analytic = profile_analytic(
        model, inputs, "cpu", AnalyticOptions(dtype="float32", model_name=name), loss_fn=loss_fn
    )
    measured = measure(model, inputs, loss_fn, repeats)
    if measured.unit_names != analytic.unit_names:
        raise SystemExit(
            f"{name}: measured units {measured.unit_names} != analytic {analytic.unit_names}"
        )
    fitted = reprice(analytic, calibrate(analytic, measured))
    a, c, m = shares(analytic), shares(fitted), shares(measured)
    print(f"\n== {name}: batch {analytic.batch_size}, fp32, measured by autopipe.profiler.measure")
    print(
        f"{'unit':<12} {'analytic':>9} {'calibr.':>9} {'measured':>9}   {'meas. ms':>9} {'GFLOP':>8}"
    )
    for i, unit in enumerate(analytic.units):
        ms = (measured.units[i].forward_s + measured.units[i].backward_s) * 1e3
        gflop = (unit.forward_flops + unit.backward_flops) / 1e9
        print(f"{unit.name:<12} {a[i]:>9.1%} {c[i]:>9.1%} {m[i]:>9.1%}   {ms:>9.3f} {gflop:>8.3f}")
    total_measured = measured.total_forward_s + measured.total_backward_s
    if not total_measured:
        total_measured = sum(u.forward_s + u.backward_s for u in measured.units)
    total_analytic = analytic.total_forward_s + analytic.total_backward_s
    max_err_nominal = max(abs(x - y) for x, y in zip(a, m, strict=True))
    max_err_fitted = max(abs(x - y) for x, y in zip(c, m, strict=True))
    print(
        f"step time: analytic(nominal cpu) {total_analytic * 1e3:.1f} ms, measured {total_measured * 1e3:.1f} ms; "
        f"max |share error| nominal {max_err_nominal:.1%}, calibrated {max_err_fitted:.1%}"
    )
    saved = whole_model_saved_bytes(model, inputs, loss_fn)
    ratio = analytic.total_activation_bytes / saved
    print(
        f"saved activations: measured {saved / 2**20:.2f} MiB, analytic "
        f"{analytic.total_activation_bytes / 2**20:.2f} MiB, ratio {ratio:.3f}; "
        f"analytic run took {analytic.counting.seconds if analytic.counting else 0.0:.2f} s"
    )
    return {
        "share_err_nominal": max_err_nominal,
        "share_err_fitted": max_err_fitted,
        "memory_ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="gpt,resnet,mlp")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # shared 2-core machine: one thread gives stable timings
    results = {name: compare(name, args.repeats) for name in args.models.split(",")}
    print("\nsummary (max per-unit share error, memory ratio analytic/measured):")
    for name, r in results.items():
        print(
            f"  {name:<7} nominal {r['share_err_nominal']:6.1%}  calibrated {r['share_err_fitted']:6.1%}  "
            f"memory {r['memory_ratio']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
