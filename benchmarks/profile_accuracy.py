"""Analytic vs measured profiles on this machine's CPU, for each example model.

For gpt, resnet and mlp (examples/, default sizes, fp32) it prints per unit:
the share of the training step (forward + backward) each unit takes according to

* the analytic profile priced with the nominal ``"cpu"`` catalog spec,
* the same analytic profile after ``calibrate`` fitted its three factors to the measured run,
* the measured profile (``autopipe.profiler.measure.profile`` when available, otherwise
  per-aten-op wall-clock timing of a real run booked to units exactly like the analytic
  counts; the header says which),

then the memory comparison: whole-model bytes saved for backward counted in a real fp32 CPU
step (``saved_tensors_hooks``) vs the analytic estimate. Medians of ``--repeats`` runs.

    .venv/bin/python benchmarks/profile_accuracy.py [--repeats 5] [--models gpt,resnet,mlp]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from autopipe.profiler.analytic import _AutogradTagger, _UnitInterpreter, profile_analytic
from autopipe.profiler.calibrate import calibrate, reprice
from autopipe.profiler.profile import Profile, UnitProfile
from autopipe.profiler.tree import float_tensor_leaves, tensor_leaves
from autopipe.profiler.units import trace_units
from torch.utils._python_dispatch import TorchDispatchMode

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> Any:
    key = f"_bench_example_{name}"
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


class _OpTimer(TorchDispatchMode):
    """Wall-clock seconds of each aten op, booked to the current unit and phase."""

    def __init__(self, n_units: int) -> None:
        super().__init__()
        self.unit = 0
        self.phase = "forward"
        self.seconds = {"forward": [0.0] * n_units, "backward": [0.0] * n_units}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[self.phase][self.unit] += time.perf_counter() - start
        return out


def measure_by_ops(model: torch.nn.Module, inputs: Any, loss_fn: Any, repeats: int) -> Profile:
    """Per-unit forward/backward seconds of real fp32 steps (median over ``repeats``)."""
    units = trace_units(model, inputs, "block")
    runs: list[_OpTimer] = []
    for _ in range(repeats + 1):  # the first run warms up allocator and caches
        timer = _OpTimer(units.num_units)
        with _AutogradTagger(timer), timer:
            out = _UnitInterpreter(units.graph_module, units.node_unit, timer).run(
                *units.flat_inputs(inputs), enable_io_processing=False
            )
            out = units.unflatten_output(out)
            timer.unit = units.num_units - 1
            loss = (
                loss_fn(out, inputs) if loss_fn else sum(t.sum() for t in float_tensor_leaves(out))
            )
            timer.phase = "backward"
            loss.backward()
        model.zero_grad(set_to_none=True)
        runs.append(timer)
    runs = runs[1:]
    unit_profiles = []
    for i, name in enumerate(units.unit_names):
        unit_profiles.append(
            UnitProfile(
                name=name,
                kind=units.unit_kinds[i],
                forward_s=statistics.median(r.seconds["forward"][i] for r in runs),
                backward_s=statistics.median(r.seconds["backward"][i] for r in runs),
            )
        )
    batch = tensor_leaves(inputs)[0].shape[0]
    return Profile(units=unit_profiles, cut_bytes=[0] * (len(unit_profiles) - 1), batch_size=batch)


def measure(model: torch.nn.Module, inputs: Any, loss_fn: Any, repeats: int) -> tuple[Profile, str]:
    try:
        from autopipe.profiler.measure import profile as measured_profile
    except ImportError:
        return measure_by_ops(model, inputs, loss_fn, repeats), "per-op timing (benchmark fallback)"
    kwargs: dict[str, Any] = {"loss_fn": loss_fn} if loss_fn else {}
    measured = measured_profile(model, inputs, progress=False, repeat=repeats, **kwargs)
    return measured, "autopipe.profiler.measure.profile"


def measured_saved_bytes(model: torch.nn.Module, inputs: Any, loss_fn: Any) -> int:
    """Whole-model bytes saved for backward in one real step, deduplicated by storage."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs)
        loss = loss_fn(out, inputs) if loss_fn else out.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def shares(profile: Profile) -> list[float]:
    total = sum(u.forward_s + u.backward_s for u in profile.units)
    return [(u.forward_s + u.backward_s) / total for u in profile.units]


def compare(name: str, repeats: int) -> dict[str, float]:
    example = load_example(name)
    model = example.build_model()
    inputs = example.example_inputs()
    loss_fn = getattr(example, "loss_fn", None)
    analytic = profile_analytic(
        model, inputs, "cpu", dtype="float32", loss_fn=loss_fn, model_name=name
    )
    measured, how = measure(model, inputs, loss_fn, repeats)
    if measured.unit_names != analytic.unit_names:
        raise SystemExit(
            f"{name}: measured units {measured.unit_names} != analytic {analytic.unit_names}"
        )
    fitted = reprice(analytic, calibrate(analytic, measured))
    a, c, m = shares(analytic), shares(fitted), shares(measured)
    print(f"\n== {name}: batch {analytic.batch_size}, fp32, measured by {how}")
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
    saved = measured_saved_bytes(model, inputs, loss_fn)
    ratio = analytic.total_activation_bytes / saved
    print(
        f"saved activations: measured {saved / 2**20:.2f} MiB, analytic "
        f"{analytic.total_activation_bytes / 2**20:.2f} MiB, ratio {ratio:.3f}; "
        f"analytic run took {analytic.meta['analytic_seconds']:.2f} s"
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
