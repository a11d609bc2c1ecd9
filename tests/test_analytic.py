"""Analytic profiles on the meta device: textbook FLOPs, bytes, memory vs a real CPU run."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from autopipe.planner import plan as plan_for
from autopipe.profiler.analytic import AnalyticProfileError, profile_analytic
from autopipe.profiler.calibrate import CalibrationError, calibrate, reprice, spec_of
from autopipe.profiler.measure import profile as measured_profile
from autopipe.profiler.measure import whole_model_saved_bytes
from autopipe.profiler.options import AnalyticOptions, MeasureOptions
from profiler_models import (
    DataBranch,
    ShapeBranch,
    SkipCNN,
    TiedDecoder,
    decoder_inputs,
    load_example,
)

from autopipe.core.catalog import DeviceSpecError, get_device
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

gpt = load_example("gpt")
resnet = load_example("resnet")
mlp = load_example("mlp")

B, T, D, V, L = 2, 32, 64, 512, 3
CFG = gpt.GPTConfig(vocab_size=V, seq_len=T, d_model=D, n_layer=L, n_head=4)


def small_gpt(**overrides):
    cfg = dataclasses.replace(CFG, **overrides)
    return gpt.GPT(cfg), gpt.example_inputs(B, cfg)


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    model, x = small_gpt()
    return profile_analytic(model, x, "a100", AnalyticOptions(dtype="float32"), loss_fn=gpt.loss_fn)


def test_gpt_units_and_textbook_flops(gpt_profile: Profile) -> None:
    p = gpt_profile
    assert p.mode == "analytic" and p.device == "A100-80GB" and p.dtype == "float32"
    assert p.unit_names == [
        "tok_emb",
        "pos_emb",
        "drop",
        *[f"blocks.{i}" for i in range(L)],
        "ln_f",
        "head",
    ]
    tokens = B * T
    linear_params = 12 * D * D  # qkv 3d^2 + proj d^2 + fc 4d^2 + proj 4d^2 (weights only)
    attention = 4 * B * T * T * D  # QK^T and PV, full (non-causal) count as in FlopCounterMode
    block = p.units[3]
    assert block.forward_flops == pytest.approx(2 * tokens * linear_params + attention, rel=0.01)
    # backward: 2x the matmuls, 2.5x attention (FlopCounterMode's flash-backward formula)
    assert block.backward_flops == pytest.approx(
        4 * tokens * linear_params + 2.5 * attention, rel=0.01
    )
    head = p.units[-1]
    assert head.forward_flops == pytest.approx(2 * tokens * D * V, rel=0.01)
    assert head.backward_flops == pytest.approx(4 * tokens * D * V, rel=0.01)
    assert p.units[0].forward_flops == 0  # embedding lookups are memory-bound
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in p.units if u.name != "drop")


def test_linear_forward_flops_are_the_weight_matmuls_by_hand(gpt_profile: Profile) -> None:
    """Each unit's ``linear_forward_flops`` is 2 x in x out x tokens summed over its
    nn.Linear calls (what ``precision="fp8"`` runs at the FP8 peak): a block's qkv, proj, fc
    and proj (12 D^2 weights, biases not matmuls), the head's D x V; an embedding, a norm and
    the attention's QK^T / PV (no parameter operand) none. A tied head counts its call, and a
    linear called twice counts twice."""
    tokens = B * T
    block = 2 * tokens * 12 * D * D
    head = 2 * tokens * D * V
    assert [u.linear_forward_flops for u in gpt_profile.units] == [0, 0, 0, *[block] * L, 0, head]
    assert block == 6_291_456 and head == 4_194_304
    model, x = small_gpt(tie_weights=True)
    tied = profile_analytic(model, x, "h100", AnalyticOptions(), loss_fn=gpt.loss_fn)
    assert tied.units[-1].linear_forward_flops == head
    assert tied.units[0].linear_forward_flops == 0

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(self.a(x)))

    twice = profile_analytic(Twice(), torch.randn(6, 8), "h100", AnalyticOptions())
    assert sum(u.linear_forward_flops for u in twice.units) == 2 * 6 * (8 * 8 * 2 + 8 * 4)


def test_gpt_bytes_and_shapes(gpt_profile: Profile) -> None:
    p = gpt_profile
    act = B * T * D * 4  # one fp32 hidden state
    blocks = [u for u in p.units if u.name.startswith("blocks.")]
    assert [u.output_bytes for u in blocks] == [act] * L
    assert p.units[-1].output_bytes == B * T * V * 4  # logits
    assert p.cut_bytes[3:5] == [act, act]  # between blocks exactly one hidden state is live
    per_block = 12 * D * D + 13 * D  # weights + biases + two LayerNorms
    assert [u.parameter_count for u in blocks] == [per_block] * L
    assert all(u.parameter_bytes == 4 * per_block for u in blocks)
    assert sum(u.parameter_count for u in p.units) == gpt.num_parameters(small_gpt()[0])
    assert p.parameter_bytes_total == 4 * gpt.num_parameters(small_gpt()[0])
    details = p.counting.units[3]
    assert blocks[0].gradient_bytes == 4 * per_block
    assert blocks[0].optimizer_bytes == 8 * per_block  # Adam: two fp32 moments
    assert p.optimizer == "adam" and p.granularity == "block" and p.tracer == "fx"
    # identical blocks cost the same
    assert len({(u.forward_s, u.backward_s, u.activation_bytes) for u in blocks}) == 1
    # the fixed per-micro-batch part: at least the kernel launches, well below the total
    launches = details["forward"]["kernels"] * get_device("a100").kernel_launch_overhead_s
    assert launches <= blocks[0].forward_overhead_s < blocks[0].forward_s
    assert p.counting.smaller_sizes[0]["microbatch_size"] == B // 2


def test_bf16_halves_bytes() -> None:
    model, x = small_gpt()
    p16 = profile_analytic(model, x, "h100-sxm", loss_fn=gpt.loss_fn)
    p32 = profile_analytic(model, x, "h100-sxm", AnalyticOptions(dtype="fp32"), loss_fn=gpt.loss_fn)
    assert p16.dtype == "bfloat16" and p16.bytes_per_parameter == 2
    assert p16.units[3].parameter_bytes * 2 == p32.units[3].parameter_bytes
    assert p16.units[3].output_bytes * 2 == p32.units[3].output_bytes
    # 16-bit training defaults to mixed-precision Adam: fp32 master, m and v (12 bytes)
    assert p16.optimizer == "mixed-adam"
    assert p16.units[3].optimizer_bytes == 12 * p16.units[3].parameter_count
    plain = profile_analytic(
        model, x, "h100-sxm", AnalyticOptions(optimizer="adam"), loss_fn=gpt.loss_fn
    )
    assert plain.units[3].optimizer_bytes == 2 * p16.units[3].parameter_bytes  # moments in bf16
    assert p32.optimizer == "adam"
    assert p32.units[3].optimizer_bytes == 2 * p32.units[3].parameter_bytes
    assert p16.units[3].forward_flops == p32.units[3].forward_flops
    # bf16 tensor cores are 14.8x the H100's fp32 rate: compute-bound parts get much faster
    c16 = p16.counting.units[-1]["forward"]["compute_s"]
    c32 = (
        p32.counting.units[-1]["forward"]["compute_s"]
        + p32.counting.units[-1]["forward"]["memory_s"]
    )
    assert c16 < c32


def test_overhead_fit_sees_weight_reads_at_small_batch() -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
    small = profile_analytic(
        layer, torch.randn(8, 4096), "a100", AnalyticOptions(microbatch_sizes=(2,))
    )
    big = profile_analytic(
        layer, torch.randn(8192, 4096), "a100", AnalyticOptions(microbatch_sizes=(2048,))
    )
    # batch 8: reading 32 MiB of bf16 weights dominates, the time barely depends on b
    assert small.units[0].forward_overhead_s > 0.8 * small.units[0].forward_s
    # batch 8192: compute-bound, the fixed part is a small fraction
    assert big.units[0].forward_overhead_s < 0.1 * big.units[0].forward_s
    only = profile_analytic(
        layer, torch.randn(8, 4096), "a100", AnalyticOptions(microbatch_sizes=())
    )
    launches = only.counting.units[0]["forward"]["kernels"] * 8e-6
    assert only.units[0].forward_overhead_s == pytest.approx(launches)
    assert only.counting.smaller_sizes == []
    with pytest.raises(AnalyticProfileError, match="micro-batch sizes must be between 1"):
        profile_analytic(
            layer, torch.randn(8, 4096), "a100", AnalyticOptions(microbatch_sizes=(16,))
        )


def test_tied_weights_count_in_each_user_and_once_in_total() -> None:
    model, x = small_gpt(tie_weights=True)
    p = profile_analytic(model, x, "a100", AnalyticOptions(dtype="float32"), loss_fn=gpt.loss_fn)
    # the convention of the measured profiler: a stage holding either unit needs the weight
    assert p.units[0].parameter_count == V * D == p.units[-1].parameter_count
    assert p.units[0].shared_parameters == p.units[-1].shared_parameters == ["tok_emb.weight"]
    assert p.parameter_bytes_total == 4 * gpt.num_parameters(model)


def test_resnet_conv_flops_and_shapes() -> None:
    model = resnet.resnet(widths=(8, 16), blocks_per_stage=2, num_classes=10)
    x = resnet.example_inputs(4)
    p = profile_analytic(model, x, "l4", AnalyticOptions(dtype="float32"))
    assert p.unit_names == [str(i) for i in range(8)]
    hw, c = 32 * 32, 8
    conv3x3 = 2 * c * c * 9 * hw * 4  # 2 * Cout * Cin * k^2 * H_out * W_out * batch
    assert p.units[1].forward_flops == pytest.approx(2 * conv3x3, rel=0.01)
    # downsampling block: 8->16 channels at stride 2 (16x16 output) plus the 1x1 shortcut
    hw2 = 16 * 16
    expected = 2 * 16 * 8 * 9 * hw2 * 4 + 2 * 16 * 16 * 9 * hw2 * 4 + 2 * 16 * 8 * hw2 * 4
    assert p.units[3].forward_flops == pytest.approx(expected, rel=0.01)
    assert p.units[1].output_bytes == 4 * c * hw * 4
    assert p.units[3].output_bytes == 4 * 16 * hw2 * 4
    assert p.units[-1].output_bytes == 4 * 10 * 4
    # BatchNorm running mean/var (fp32) + num_batches_tracked (int64) of the two BNs
    assert p.units[1].buffer_bytes == 2 * (2 * c * 4 + 8)
    assert p.units[1].parameter_count == 2 * c * c * 9 + 2 * 2 * c


def _example(name: str) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, inputs, loss_fn)`` of a small model, seeded."""
    torch.manual_seed(0)
    if name == "tied-decoder":  # kwargs, attention mask through nn.MultiheadAttention, dict out
        return TiedDecoder(), decoder_inputs(), None
    if name == "skip-cnn":  # BatchNorm, residuals, a long skip
        return SkipCNN(), torch.randn(2, 3, 16, 16), None
    if name == "shape-branch":  # traced by torch.export (fx fails)
        return ShapeBranch(), torch.randn(4, 8), None
    if name == "gpt":
        model, x = small_gpt()
        return model, x, gpt.loss_fn
    if name == "resnet":
        return resnet.resnet(widths=(8, 16), blocks_per_stage=2), resnet.example_inputs(4), None
    assert name == "mlp", name
    return mlp.build_model(), mlp.example_inputs(16), None


@pytest.mark.parametrize(
    "example", ["gpt", "resnet", "mlp", "tied-decoder", "skip-cnn", "shape-branch"]
)
def test_saved_activation_bytes_match_a_real_cpu_run(example: str) -> None:
    model, x, loss_fn = _example(example)
    measured = whole_model_saved_bytes(model, x, loss_fn)
    analytic = profile_analytic(model, x, "cpu", AnalyticOptions(dtype="float32"), loss_fn=loss_fn)
    assert analytic.total_activation_bytes == pytest.approx(measured, rel=0.10)
    assert analytic.total_activation_bytes == sum(u.activation_bytes for u in analytic.units)


def test_gpt_6b_on_meta_is_fast_and_fits_8_a100() -> None:
    started = time.perf_counter()
    p = profile_analytic(gpt.gpt_6b, gpt.example_inputs_gpt_6b(8), "a100-80gb", loss_fn=gpt.loss_fn)
    elapsed = time.perf_counter() - started
    assert elapsed < 60
    assert sum(u.parameter_count for u in p.units) == pytest.approx(5.75e9, rel=0.01)
    blocks = [u for u in p.units if u.kind == "Block"]
    assert len(blocks) == 48
    # every block: 2 * 113 M weights * 16384 tokens + attention, the textbook count
    d, t, b = 3072, 2048, 8
    assert blocks[0].forward_flops == pytest.approx(
        2 * 12 * d * d * b * t + 4 * b * t * t * d, rel=0.01
    )
    # with flash attention a block saves ~ 34 * b * t * d bytes in bf16 (Korthikanti et al.)
    assert blocks[0].activation_bytes == pytest.approx(34 * b * t * d, rel=0.1)
    # weights + grads + Adam (with fp32 master) per GPU for an even 8-way split
    state = sum(u.parameter_count for u in p.units) * (2 + 2 + 12) / 8
    assert state < 80e9
    plan = plan_for(p, PlanRequest(gpus=8, memory_per_device=80e9, checkpoint="auto"))
    assert len(plan.stages) == 8
    assert all(s.memory_bytes <= 80e9 for s in plan.stages)


def test_efficiency_and_calibration_round_trip(gpt_profile: Profile) -> None:
    spec = spec_of(gpt_profile)
    truth = spec.with_efficiency(
        compute=0.35, memory=0.6, kernel_launch_overhead_s=3 * spec.kernel_launch_overhead_s
    )
    measured = reprice(gpt_profile, truth)
    measured = dataclasses.replace(measured, mode="measured")
    fitted = calibrate(gpt_profile, measured)
    assert fitted.compute_efficiency == pytest.approx(0.35, rel=1e-6)
    assert fitted.memory_efficiency == pytest.approx(0.6, rel=1e-6)
    assert fitted.kernel_launch_overhead_s == pytest.approx(
        truth.kernel_launch_overhead_s, rel=1e-6
    )
    again = reprice(gpt_profile, fitted)
    assert [u.forward_s for u in again.units] == pytest.approx(
        [u.forward_s for u in measured.units]
    )
    # a faster-than-nominal machine raises the peak instead of an efficiency above 1
    fast = reprice(
        gpt_profile,
        dataclasses.replace(
            spec, peak_flops_per_s={k: 4 * v for k, v in spec.peak_flops_per_s.items()}
        ),
    )
    fitted_fast = calibrate(gpt_profile, dataclasses.replace(fast, mode="measured"))
    assert fitted_fast.compute_efficiency <= 1
    assert fitted_fast.peak_for("float32") * fitted_fast.compute_efficiency == pytest.approx(
        4 * spec.peak_for("float32") * spec.compute_efficiency, rel=1e-6
    )
    # the efficiency argument of profile_analytic moves only the compute-bound part
    model, x = small_gpt()
    slow = profile_analytic(
        model, x, "a100", AnalyticOptions(dtype="float32", efficiency=0.35), loss_fn=gpt.loss_fn
    )
    assert slow.counting.units[-1]["forward"]["compute_s"] == pytest.approx(
        2 * gpt_profile.counting.units[-1]["forward"]["compute_s"]
    )


def test_calibration_round_trips_a_bf16_profile_priced_at_the_gpus_ceiling() -> None:
    """An H100 bf16 profile's matmuls are counted at the H100's published ceiling (0.803,
    autopipe.core.gemm), not the flat 0.7: re-pricing and calibrating read that same rate, so
    a machine whose matmuls run at 0.4 of the peak is fitted as 0.4."""
    model, x = small_gpt()
    p16 = profile_analytic(model, x, "h100-sxm", loss_fn=gpt.loss_fn)
    truth = spec_of(p16).with_efficiency(compute=0.4)
    measured = dataclasses.replace(reprice(p16, truth), mode="measured")
    fitted = calibrate(p16, measured)
    assert fitted.compute_efficiency == pytest.approx(0.4, rel=1e-6)


def test_calibration_rejects_mismatched_profiles(gpt_profile: Profile) -> None:
    other = dataclasses.replace(gpt_profile, batch_size=3, mode="measured")
    with pytest.raises(CalibrationError, match="batch sizes differ"):
        calibrate(gpt_profile, other)
    with pytest.raises(CalibrationError, match="expected an analytic profile"):
        calibrate(other, gpt_profile)


def test_profile_round_trips_through_json(gpt_profile: Profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    gpt_profile.save(path)
    loaded = Profile.load(path)
    assert loaded.unit_names == gpt_profile.unit_names
    assert loaded.units[3].forward_flops == gpt_profile.units[3].forward_flops
    assert spec_of(loaded).name == "A100-80GB"


def test_tracers_and_data_dependent_control_flow() -> None:
    p = profile_analytic(ShapeBranch(), torch.randn(4, 8), "a100", AnalyticOptions(dtype="float32"))
    assert p.tracer == "export" and p.unit_names == ["a", "b"]
    assert p.units[0].forward_flops == 2 * 4 * 8 * 8
    decoder = profile_analytic(
        TiedDecoder(), decoder_inputs(), "a100", AnalyticOptions(dtype="float32")
    )
    assert decoder.units[-1].shared_parameters == ["wte.weight"]
    with pytest.raises(AnalyticProfileError, match="data-dependent control flow"):
        profile_analytic(DataBranch(), torch.randn(4, 8), "a100")


def test_bad_arguments() -> None:
    model, x = small_gpt()
    with pytest.raises(DeviceSpecError, match="unknown device"):
        profile_analytic(model, x, "tpu")
    with pytest.raises(DeviceSpecError, match="V100-32GB has no bfloat16"):
        profile_analytic(model, x, "v100")
    with pytest.raises(AnalyticProfileError, match="unknown optimizer"):
        profile_analytic(model, x, "a100", AnalyticOptions(optimizer="lion"))
    with pytest.raises(AnalyticProfileError, match="expected an nn.Module"):
        profile_analytic(42, x, "a100")
    with pytest.raises(AnalyticProfileError, match="device='cuda' measures"):
        profile_analytic(model, x, "cuda")
    # the caller's model keeps its real weights
    assert not next(model.parameters()).is_meta


@pytest.mark.parametrize("example", ["gpt", "resnet", "tied-decoder"])
def test_memory_fields_equal_the_measured_profiler(example: str) -> None:
    model, x, loss_fn = _example(example)
    analytic = profile_analytic(model, x, "cpu", AnalyticOptions(dtype="float32"), loss_fn=loss_fn)
    measured = measured_profile(
        model,
        x,
        MeasureOptions(microbatch_sizes=(), warmup=0, repeat=1),
        loss_fn=loss_fn,
        progress=False,
    )
    assert analytic.unit_names == measured.unit_names
    assert analytic.cut_bytes == measured.cut_bytes
    assert analytic.input_bytes == measured.input_bytes
    assert analytic.parameter_bytes_total == measured.parameter_bytes_total
    fields = [
        "parameter_count", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "buffer_bytes",
        "activation_bytes", "output_bytes", "peak_bytes", "shared_parameters",
    ]  # fmt: skip
    for a, m in zip(analytic.units, measured.units, strict=True):
        assert {f: getattr(a, f) for f in fields} == {f: getattr(m, f) for f in fields}, a.name
