"""Counting aten ops on meta tensors (autopipe.profiler.opcount): FLOPs as
torch.utils.flop_counter counts them, bytes moved, kernels, the roofline and cut bytes."""

from __future__ import annotations

import pytest
import torch
from autopipe.profiler.opcount import OpCounter, grouped_mm_flops, storage_key
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopipe.core.catalog import DeviceSpec

F32 = 4


def spec(peak_flops_per_s: float = 1e12, bandwidth_bytes_per_s: float = 1e11) -> DeviceSpec:
    return DeviceSpec(
        name="test device",
        peak_flops_per_s={"float32": peak_flops_per_s},
        memory_bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        memory_bytes=1 << 30,
        link_bandwidth_bytes_per_s=1e10,
        kernel_launch_overhead_s=1e-6,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
    )


def torch_flops(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs by torch's own FlopCounterMode, on real tensors."""
    with FlopCounterMode(display=False) as forward:
        out = model(x)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    return forward.get_total_flops(), forward.get_total_flops() + backward.get_total_flops()


def test_linear_flops_equal_torch_flop_counter_and_bytes_are_exact() -> None:
    torch.manual_seed(0)
    real = nn.Linear(64, 32)
    want_forward, want_total = torch_flops(real, torch.randn(8, 64, requires_grad=True))
    assert want_forward == 2 * 8 * 64 * 32

    lin = nn.Linear(64, 32, device="meta")
    x = torch.empty(8, 64, device="meta", requires_grad=True)
    params = {storage_key(lin.weight), storage_key(lin.bias)}
    counter = OpCounter(spec(), 1, params)
    with counter:
        counter.mark_inputs([x])
        out = lin(x)
        counter.phase = "backward"
        out.sum().backward()
    fwd, bwd = counter.units[0].forward, counter.units[0].backward
    assert fwd.flops == want_forward
    assert fwd.flops + bwd.flops == want_total
    # One kernel (addmm; the weight's transpose is a view and launches nothing).
    assert fwd.kernels == 1 and fwd.ops == {"addmm": 1}
    # Bytes: read bias, input, weight; write the output.
    moved = (32 + 8 * 64 + 64 * 32 + 8 * 32) * F32
    assert fwd.bytes_moved == moved and fwd.working_set_bytes == moved
    # Every forward FLOP has a parameter operand: the analytic weight-gradient cost.
    assert fwd.parameter_flops == fwd.flops
    # Roofline at 1 TFLOP/s and 100 GB/s: 32768 FLOPs take 32.8 ns, 17.5 kB take 175 ns.
    assert fwd.memory_s == pytest.approx(moved / 1e11) and fwd.compute_s == 0.0
    assert fwd.seconds(1e-6) == pytest.approx(moved / 1e11 + 1e-6)


def test_compute_bound_ops_are_priced_by_flops() -> None:
    """At 1 GFLOP/s the same matmul is compute-bound: its time is flops / peak."""
    lin = nn.Linear(64, 32, bias=False, device="meta")
    x = torch.empty(8, 64, device="meta")
    counter = OpCounter(spec(peak_flops_per_s=1e9), 1, set())
    with counter:
        lin(x)
    fwd = counter.units[0].forward
    assert fwd.ops == {"mm": 1} and fwd.flops == 2 * 8 * 64 * 32
    assert fwd.compute_s == pytest.approx(fwd.flops / 1e9) and fwd.memory_s == 0.0
    assert fwd.parameter_flops == 0  # no parameter storage was named


def test_views_and_allocations_launch_nothing_elementwise_counts_no_flops() -> None:
    x = torch.empty(4, 6, device="meta")
    counter = OpCounter(spec(), 1, set())
    with counter:
        v = x.view(6, 4).t()
        torch.empty(100, device="meta")
        y = v + 1.0
    fwd = counter.units[0].forward
    assert fwd.ops == {"add": 1} and fwd.kernels == 1 and fwd.flops == 0
    assert fwd.bytes_moved == 2 * 24 * F32 and y.shape == (4, 6)


def test_cut_bytes_count_a_skip_on_every_cut_it_crosses() -> None:
    """Unit 0 makes ``a``; unit 1 makes ``b`` from it; unit 2 reads ``a`` and ``b``."""
    x = torch.empty(16, 8, device="meta")
    counter = OpCounter(spec(), 3, set())
    with counter:
        counter.mark_inputs([x])
        a = x * 2.0
        counter.unit = 1
        b = a + 1.0
        counter.unit = 2
        c = a + b
        counter.mark_outputs([c])
    size = 16 * 8 * F32
    assert counter.cut_bytes() == [size, 2 * size]


def test_grouped_mm_flops_count_every_routed_slot_once() -> None:
    tokens, k, n, experts = 12, 8, 16, 4
    routed = torch.empty(tokens, k, device="meta")
    weights = torch.empty(experts, k, n, device="meta")
    out = torch.empty(tokens, n, device="meta")
    assert grouped_mm_flops(routed, weights, out_val=out) == 2 * tokens * k * n
    dense = torch.empty(k, n, device="meta")
    assert grouped_mm_flops(routed, dense) == 2 * tokens * k * n
