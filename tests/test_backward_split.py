"""The profile's backward split into B (input gradient) and W (weight gradient), measured and
analytic, and old profiles without it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.calibrate import reprice, spec_of
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from runtime_helpers import load_example

from autopipe.core.profile import Profile, UnitProfile


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """Linear / ReLU units wide enough (milliseconds each) that timer overheads are small."""
    torch.manual_seed(0)
    return load_example("mlp").mlp((512, 1024, 1024, 512, 128)), torch.randn(64, 512)


def test_measured_b_plus_w_is_the_whole_backward_on_an_mlp() -> None:
    """For the wide Linear units, B + W is within 35% of the backward timed whole, and over
    the model within 25% (the split walks the graph twice and pays Python overhead twice);
    up to three attempts on a shared host."""
    model, x = _mlp()
    ratios = []
    for _ in range(3):
        p = profile(
            model, x, MeasureOptions(warmup=2, repeat=5, microbatch_sizes=()), progress=False
        )
        linear = [u for u in p.units if u.kind == "Linear"]
        total = sum(u.backward_input_s + u.backward_weight_s for u in p.units)
        ratios.append(total / sum(u.backward_s for u in p.units))
        # The wide middle layers (the small last one pays the split's Python overhead).
        wide = sorted(linear[1:], key=lambda u: u.parameter_count)[-2:]
        per_unit = [(u.backward_input_s + u.backward_weight_s) / u.backward_s for u in wide]
        if abs(ratios[-1] - 1) < 0.25 and all(abs(r - 1) < 0.35 for r in per_unit):
            break
    assert min(abs(r - 1) for r in ratios) < 0.25, ratios
    assert all(abs(r - 1) < 0.35 for r in per_unit), per_unit
    first, *rest = linear
    # The first unit's input needs no gradient: its backward is all W.
    assert first.backward_input_s < 0.05 * first.backward_weight_s
    for u in rest:  # dX and dW: one matmul each
        assert u.backward_input_s > 0 and u.backward_weight_s > 0, u
    for u in p.units:
        if u.kind == "ReLU":  # no parameters: all B
            assert u.backward_weight_s < 0.1 * u.backward_input_s, u


def test_shared_units_share_the_split_and_it_can_be_switched_off() -> None:
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=128, n_layer=2, d_model=32, seq_len=8)
    model = gpt.build_model(**vars(cfg))
    idx = gpt.example_inputs(4, cfg)
    fast = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())
    p = profile(model, idx, fast, loss_fn=gpt.loss_fn, progress=False)
    blocks = {u.name: u for u in p.units}
    assert blocks["blocks.1"].measured_as == "blocks.0"
    assert blocks["blocks.1"].backward_input_s == blocks["blocks.0"].backward_input_s > 0
    assert blocks["blocks.1"].backward_weight_s == blocks["blocks.0"].backward_weight_s > 0
    off = profile(
        model,
        idx,
        dataclasses.replace(fast, split_backward=False),
        loss_fn=gpt.loss_fn,
        progress=False,
    )
    assert all(u.backward_input_s == u.backward_weight_s == 0.0 for u in off.units)


def test_analytic_split_sums_to_the_analytic_backward() -> None:
    model, x = _mlp()
    p = profile_analytic(model, x, device="a100", progress=False)
    for u in p.units:
        assert u.backward_input_s + u.backward_weight_s == pytest.approx(u.backward_s, rel=1e-12)
    linear = [u for u in p.units if u.kind == "Linear"]
    # dW redoes the forward matmul; dX is the other one (none for the first unit).
    assert linear[0].backward_input_s == 0 and linear[0].backward_weight_s > 0
    for u in linear[1:]:
        assert u.backward_weight_s == pytest.approx(u.backward_input_s, rel=0.05)
    assert all(u.backward_weight_s == 0 for u in p.units if u.kind == "ReLU")
    # Re-pricing for another device keeps the split consistent.
    spec = spec_of(p)
    slower = reprice(
        p,
        dataclasses.replace(
            spec,
            peak_flops_per_s={k: v / 2 for k, v in spec.peak_flops_per_s.items()},
            memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s / 2,
        ),
    )
    assert slower.units[2].backward_s > p.units[2].backward_s
    for u in slower.units:
        assert u.backward_input_s + u.backward_weight_s == pytest.approx(u.backward_s, rel=1e-12)


def test_a_profile_without_the_split_loads_as_not_split(tmp_path: Path) -> None:
    """Profiles written before the split have neither field: they load with both 0, which
    means "not split" (the planner's stated default applies)."""
    p = Profile(
        units=[
            UnitProfile(name="a", forward_s=1e-3, backward_s=2e-3, backward_input_s=1e-3),
            UnitProfile(name="b", forward_s=1e-3, backward_s=2e-3),
        ],
        cut_bytes=[64],
        batch_size=8,
    )
    data = p.to_dict()
    for unit in data["units"]:
        del unit["backward_input_s"], unit["backward_weight_s"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = Profile.load(path)
    assert [(u.backward_input_s, u.backward_weight_s) for u in old.units] == [(0.0, 0.0)] * 2
    assert old.units[0].backward_s == 2e-3


def test_cli_profile_no_split_backward(tmp_path: Path) -> None:
    """``autopipe profile --no-split-backward`` leaves the split out (both 0: the planner's
    stated default applies); by default the measured profile carries it; a saved profile
    refuses the flag (exit 2) instead of ignoring it."""
    from autopipe.cli import main

    mlp = str(Path(__file__).resolve().parents[1] / "examples" / "mlp.py")
    split, whole = tmp_path / "split.json", tmp_path / "whole.json"
    assert main(["profile", mlp, "--out", str(split), "-q", "--no-cache"]) == 0
    assert (
        main(["profile", mlp, "--out", str(whole), "-q", "--no-cache", "--no-split-backward"]) == 0
    )
    with_params = [u for u in Profile.load(split).units if u.parameter_count > 0]
    assert with_params and all(u.backward_input_s + u.backward_weight_s > 0 for u in with_params)
    assert all(u.backward_input_s == u.backward_weight_s == 0 for u in Profile.load(whole).units)
    assert main(["plan", str(whole), "--gpus", "2", "-q", "--no-split-backward"]) == 2


def test_split_measured_at_every_size_gets_its_own_per_call_part() -> None:
    """B and W are timed at each micro-batch size and fitted ``a + c b`` each: the per-call
    parts are never above the totals, and the Linear units' W pays one (its autograd call
    per parameter group)."""
    model, x = _mlp()
    p = profile(
        model, x, MeasureOptions(warmup=1, repeat=3, microbatch_sizes=(16, 4)), progress=False
    )
    for u in p.units:
        assert 0.0 <= u.backward_input_overhead_s <= u.backward_input_s, u
        assert 0.0 <= u.backward_weight_overhead_s <= u.backward_weight_s, u
    assert any(u.split_fitted for u in p.units if u.kind == "Linear")
    # One size: nothing to fit, so B and W scale as the whole backward.
    one = profile(model, x, MeasureOptions(warmup=0, repeat=1, microbatch_sizes=()), progress=False)
    assert not any(u.split_fitted for u in one.units)


def test_cost_model_scales_b_and_w_by_their_own_fits() -> None:
    """Batch 16, a unit with B = 4 s (1 s per call) and W = 4 s (3 s per call), whole
    backward 8 s (1 s per call). At micro-batch 4: B = 1 + 3/4, W = 3 + 1/4: 5 s run split
    (the whole backward at 4 is 2.75 s), of which B is 35%. Before the fit both scaled as
    the whole backward: 2.75 s split half and half."""
    from autopipe.planner.costs import CostModel

    from autopipe.core.cluster import Cluster

    unit = UnitProfile(
        name="u", kind="Linear", forward_s=1.0, backward_s=8.0, backward_overhead_s=1.0,
        backward_input_s=4.0, backward_weight_s=4.0, backward_input_overhead_s=1.0,
        backward_weight_overhead_s=3.0, parameter_count=10,
    )  # fmt: skip
    prof = Profile(units=[unit], cut_bytes=[], batch_size=16, input_bytes=0)

    cm = CostModel(
        prof, Cluster.homogeneous(1), batch_size=16, microbatches=4, schedule="zbv",
        checkpoint="never", state_bytes_per_parameter=16.0, headroom=0.0,
    )  # fmt: skip
    assert cm.bwd_prefix[-1] == pytest.approx(2.75)
    assert cm.bwd_split_prefix[-1] == pytest.approx(5.0)
    assert cm.bwd_input_prefix[-1] == pytest.approx(1.75)


def test_scale_to_reference_makes_the_units_add_up_to_the_whole_model() -> None:
    model, x = _mlp()
    options = MeasureOptions(warmup=1, repeat=3, microbatch_sizes=(64, 16), scale_to_reference=True)
    p = profile(model, x, options, progress=False)
    assert p.measurement is not None
    scale = p.measurement.reference_scale
    assert p.total_forward_s > 0 and p.total_backward_s > 0
    assert sum(u.forward_s for u in p.units) == pytest.approx(p.total_forward_s, rel=1e-9)
    assert sum(u.backward_s for u in p.units) == pytest.approx(p.total_backward_s, rel=1e-9)
    assert scale["forward"] > 0 and scale["backward"] > 0
    for u in p.units:  # every part is scaled alike, so none exceeds its total
        assert u.forward_overhead_s <= u.forward_s and u.backward_overhead_s <= u.backward_s
        assert u.backward_weight_overhead_s <= u.backward_weight_s
    with pytest.raises(ValueError, match="reference=True"):
        profile(model, x, MeasureOptions(scale_to_reference=True, reference=False), progress=False)


def test_cli_scale_to_reference_is_refused_for_a_saved_profile(tmp_path: Path) -> None:
    from autopipe.cli import main

    saved = tmp_path / "p.json"
    model, x = _mlp()
    profile(model, x, MeasureOptions(warmup=0, repeat=1, microbatch_sizes=()), progress=False).save(
        saved
    )
    assert main(["plan", str(saved), "--gpus", "2", "-q", "--scale-to-reference"]) == 2
