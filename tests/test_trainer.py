"""The trainer options of a PlanRequest (planner/trainer.py, the hooks in mesh_costs.py and
mesh.py): FP8 matmuls, selective re-computation, TP without sequence parallelism, TP comm
overlap, overlapped gradient reduction, FSDP2 under PP, a memory reserve. Torch-free."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from autopipe.planner import plan
from autopipe.planner.errors import RuleViolation
from autopipe.planner.mesh_costs import (
    Topology,
    device_profile,
    selective_regather_s,
    sharded_state_bytes_per_parameter,
    tp_overlap_exposed_s,
)
from autopipe.planner.trainer import fp8_saving_s, trainer_profile

from autopipe.core.catalog import get_device
from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest


def _profile(device: str = "H100-SXM-80GB", units: int = 8) -> Profile:
    us = [
        UnitProfile(
            name=f"layers.{i}",
            kind="Block",
            forward_s=1e-2,
            backward_s=2e-2,
            parameter_count=10**8,
            parameter_bytes=2 * 10**8,
            activation_bytes=10**9,
            output_bytes=10**7,
            linear_forward_flops=5e12,
            selective_activation_bytes=4 * 10**8,
            selective_recompute_s=3e-3,
            tp_parameter_count=10**8,
            tp_compute_fraction=1.0,
            tp_collective_bytes=2 * 10**7,
            tp_replicated_activation_bytes=2 * 10**8,
            tp_replicated_compute_fraction=0.1,
        )  # fmt: skip
        for i in range(units)
    ]
    return Profile(
        units=us, cut_bytes=[10**7] * (units - 1), batch_size=1, device=device,
        dtype="bfloat16", mode="analytic", bytes_per_parameter=2, tp_plan={"layers.*": "x"},
        tp_degrees=[2, 4, 8],
    )  # fmt: skip


def test_fp8_prices_the_linear_flops_at_the_fp8_peak() -> None:
    p = _profile()
    out = trainer_profile(p, PlanRequest(precision="fp8"))
    spec = get_device("H100-SXM-80GB")
    # each dtype at the H100's published matmul ceiling (autopipe.core.gemm): BF16 794.5 of
    # 989 TFLOP/s, FP8 1402.6 of 1979, both at the sustained clock (MSMF / MAMF 698.6 / 823.9)
    assert spec.name == "H100-SXM-80GB"
    sustained = 698.6 / 823.9
    saving = 5e12 / (989.4e12 * 794.5 / 989 * sustained) - 5e12 / (
        1979e12 * 1402.6 / 1979 * sustained
    )
    assert out.units[0].forward_s == pytest.approx(1e-2 - saving)
    assert out.units[0].backward_s == pytest.approx(2e-2 - 2 * saving)
    assert trainer_profile(p, PlanRequest()) is p


def test_fp8_prices_the_cast_bytes_at_the_memory_bandwidth() -> None:
    """A unit's FP8 cast bytes (torchao's Float8Linear casts, measured compiled:
    benchmarks/compiled_block_bytes.py) add to its time under precision="fp8" only, at the
    H100 SXM's 3.35 TB/s x 0.8 memory efficiency: 2.68e9 B in forward is 1 ms, 5.36e9 B in
    backward 2 ms, split over B and W as the backward's time is. Failed before (the fields did
    not exist; the casts were not priced)."""
    p = _profile()
    us = [
        dataclasses.replace(
            u,
            fp8_cast_forward_bytes=2_680_000_000,
            fp8_cast_backward_bytes=5_360_000_000,
            backward_input_s=1.2e-2,
            backward_weight_s=0.8e-2,
        )
        for u in p.units
    ]
    casts = dataclasses.replace(p, units=us)
    split = dataclasses.replace(
        p,
        units=[
            dataclasses.replace(u, fp8_cast_forward_bytes=0, fp8_cast_backward_bytes=0) for u in us
        ],
    )
    fp8 = PlanRequest(precision="fp8")
    without, with_casts = trainer_profile(split, fp8).units[0], trainer_profile(casts, fp8).units[0]
    assert with_casts.forward_s - without.forward_s == pytest.approx(1e-3)
    assert with_casts.backward_s - without.backward_s == pytest.approx(2e-3)
    assert with_casts.backward_input_s + with_casts.backward_weight_s == pytest.approx(
        with_casts.backward_s
    )
    assert with_casts.backward_input_s / with_casts.backward_weight_s == pytest.approx(1.5)
    # bf16: the casts' bytes are the profile's, not priced
    assert trainer_profile(casts, PlanRequest()) is casts
    bf16 = trainer_profile(casts, PlanRequest(selective_recompute=True)).units[0]
    assert bf16.forward_s == pytest.approx(1e-2)


def test_fp8_prices_the_selective_recomputations_matmuls_at_the_fp8_peak() -> None:
    """The weight matmuls a selective re-computation runs again (torchtitan's op policy: wk,
    wo and w3) run in FP8 under precision="fp8" like the forward's: the re-computation saves
    what ``linear_forward_flops`` of that size saves in forward, and nothing under bf16.
    Failed before (the re-computation kept its bf16 time under FP8)."""
    p = _profile()
    us = [
        dataclasses.replace(
            u,
            selective_recompute_s=4e-3,
            selective_recompute_linear_flops=1e12,
            selective_activation_bytes=1,
        )  # fmt: skip
        for u in p.units
    ]
    sel = dataclasses.replace(p, units=us)
    spec = get_device("H100-SXM-80GB")
    saving = fp8_saving_s(spec, p.dtype, 1e12)
    assert saving > 0
    fp8 = trainer_profile(sel, PlanRequest(precision="fp8", selective_recompute=True)).units[0]
    plain = trainer_profile(sel, PlanRequest(precision="fp8")).units[0]
    assert fp8.selective_recompute_s == pytest.approx(4e-3 - saving)
    assert fp8.backward_s == pytest.approx(plain.backward_s + 4e-3 - saving)
    bf16 = trainer_profile(sel, PlanRequest(selective_recompute=True)).units[0]
    assert bf16.selective_recompute_s == 4e-3
    assert bf16.backward_s == pytest.approx(p.units[0].backward_s + 4e-3)


def test_fp8_refused_on_a_profile_without_weight_matmul_flops() -> None:
    """Through the Python API too (the CLI says so before planning): a profile without any
    ``linear_forward_flops`` (written before the profiler counted them) would plan FP8 as
    bf16. Failed before (the bf16 profile came back unchanged)."""
    p = _profile()
    old = dataclasses.replace(
        p, units=[dataclasses.replace(u, linear_forward_flops=0.0) for u in p.units]
    )
    with pytest.raises(RuleViolation, match="linear_forward_flops"):
        trainer_profile(old, PlanRequest(precision="fp8"))
    assert trainer_profile(old, PlanRequest()) is old


def test_fp8_refused_where_the_gpu_has_no_fp8_peak() -> None:
    with pytest.raises(RuleViolation, match="FP8"):
        trainer_profile(_profile("A100-80GB"), PlanRequest(precision="fp8"))
    with pytest.raises(RuleViolation, match="precision"):
        trainer_profile(_profile(), PlanRequest(precision="int4"))


def test_selective_keeps_the_recipe_bytes_and_recomputes() -> None:
    out = trainer_profile(_profile(), PlanRequest(selective_recompute=True))
    u = out.units[0]
    assert u.activation_bytes == 4 * 10**8
    assert u.backward_s == pytest.approx(2e-2 + 3e-3)
    assert u.forward_s == pytest.approx(1e-2)


def test_fsdp_under_pp_holds_unsharded_parameters_and_gradients() -> None:
    assert sharded_state_bytes_per_parameter(16, 2, "parameters", 8) == 2.0
    # bf16 parameter (2) and its gradient accumulated in fp32 (4, FSDP2's reduce dtype)
    assert sharded_state_bytes_per_parameter(16, 2, "parameters", 8, False) == 2 + 4 + 16 / 8
    assert sharded_state_bytes_per_parameter(16, 4, "parameters", 8, False) == 4 + 4 + 16 / 8


def test_tp_overlap_exposes_one_chunk_and_what_outlasts_compute() -> None:
    assert tp_overlap_exposed_s(8.0, 100.0, 8) == pytest.approx(1.0)
    assert tp_overlap_exposed_s(8.0, 3.0, 8) == pytest.approx(1.0 + 4.0)
    top = Topology(8, 450e9, 50e9)
    over = dataclasses.replace(top, tp_comm_overlap=True)
    p = _profile()
    assert (
        device_profile(p, 8, over).units[0].forward_s < device_profile(p, 8, top).units[0].forward_s
    )


def test_async_tp_backward_exposes_its_collectives_as_torchtitan_runs_it() -> None:
    """tp_overlap_backward=False (torchtitan's async TP): the forward pipelines its
    collectives (one chunk exposed), the backward's all stay exposed, as its authors measured
    (forward-only speedups) and its June 2025 table shows. By hand: ring = 7/8 x 2e7 B /
    450e9 B/s; a pass's collectives C = 2 ring. (Was: half of the backward's hidden.)"""
    ring = 7 / 8 * 2e7 / 450e9
    comm = 2 * ring
    top = Topology(8, 450e9, 50e9, tp_comm_overlap=True)
    p = _profile()
    both = device_profile(p, 8, top).units[0]
    titan = device_profile(p, 8, dataclasses.replace(top, tp_overlap_backward=False)).units[0]
    vanilla = device_profile(p, 8, dataclasses.replace(top, tp_comm_overlap=False)).units[0]
    assert both.backward_s == pytest.approx(2e-2 / 8 + comm / 8)
    assert titan.backward_s == pytest.approx(2e-2 / 8 + comm) == vanilla.backward_s
    assert titan.forward_s == pytest.approx(both.forward_s)  # the forward fuses every one
    assert titan.forward_s < vanilla.forward_s
    assert PlanRequest(tp_comm_overlap=True).tp_overlap_backward  # Megatron's, the default


def test_selective_recompute_gathers_the_tp_inputs_again_as_torchtitan_runs_it() -> None:
    """torchtitan's op policy saves the reduce-scatters' outputs, not the all-gathers': with
    selective re-computation and T > 1 the backward runs one more ring all-gather of the
    unit's ``selective_recompute_gather_bytes`` (2e7 B: 7/8 x 2e7 / 450e9 s), vanilla and
    async TP alike; nothing without selective re-computation or at T = 1."""
    p = _profile()
    p.units[0].selective_recompute_gather_bytes = 2 * 10**7
    regather = 7 / 8 * 2e7 / 450e9
    top = Topology(8, 450e9, 50e9)
    sel = dataclasses.replace(top, selective_recompute=True)
    plain, again = device_profile(p, 8, top).units[0], device_profile(p, 8, sel).units[0]
    assert again.backward_s - plain.backward_s == pytest.approx(regather)
    assert again.forward_s == plain.forward_s
    assert device_profile(p, 8, sel).units[1].backward_s == plain.backward_s  # no bytes: none
    for over in (
        dataclasses.replace(sel, tp_comm_overlap=True, tp_overlap_backward=b) for b in (True, False)
    ):
        base = dataclasses.replace(over, selective_recompute=False)
        assert device_profile(p, 8, over).units[0].backward_s - device_profile(p, 8, base).units[
            0
        ].backward_s == pytest.approx(regather)
    assert selective_regather_s(p.units[0], 1, sel) == 0.0
    # the request's option reaches the mesh, and the plan's TP comm counts the re-gathers:
    # 8 units x 8 micro-batches of 4 samples (the profile's batch is 1), TP 8 x DP 2
    for u in p.units:
        u.selective_recompute_gather_bytes = 2 * 10**7

    def tp8(selective: bool) -> PlanRequest:
        return dataclasses.replace(
            _mesh(selective_recompute=selective), tensor_parallel=8, data_parallel=2
        )

    on, off = plan(p, tp8(True)), plan(p, tp8(False))
    assert on.mesh is not None and off.mesh is not None
    extra = on.mesh.candidates[0].tp_comm_s - off.mesh.candidates[0].tp_comm_s
    # on the catalog H100: NVLink at NCCL's 370 GB/s, NCCL's 8.4 us a collective and 3.4 us
    # per ring step
    assert extra == pytest.approx(8 * 8 * 4 * (7 / 8 * 2e7 / 370e9 + 8.4e-6 + 7 * 3.4e-6))


def test_tp_without_sequence_parallelism_keeps_replicated_activations() -> None:
    p = _profile()
    top = Topology(8, 450e9, 50e9)
    sp = device_profile(p, 8, top).units[0]
    plain = device_profile(p, 8, dataclasses.replace(top, sequence_parallel=False)).units[0]
    assert sp.activation_bytes == 10**9 // 8
    assert plain.activation_bytes == (10**9 - 2 * 10**8) // 8 + 2 * 10**8
    assert plain.forward_s > sp.forward_s


def test_tp_without_sequence_parallelism_keeps_the_hidden_state_whole_but_sends_a_share() -> None:
    """Plain TP (Megatron 2021, BLOOM): the hidden state between two TP blocks is the
    all-reduced output, whole on every TP rank, so a checkpointed block keeps its input
    whole (``cut_bytes``); the stage boundary still sends 1/T of it (Megatron's scatter /
    gather, DeepSpeed's partitioned pipe sends: ``send_cut_bytes``). With sequence
    parallelism both are 1/T and ``send_cut_bytes`` stays empty."""
    from autopipe.planner.costs import CostModel

    p = _profile()
    top = Topology(8, 450e9, 50e9)
    sp = device_profile(p, 8, top)
    plain = device_profile(p, 8, dataclasses.replace(top, sequence_parallel=False))
    assert sp.cut_bytes == [10**7 // 8] * 7 and sp.send_cut_bytes == []
    assert plain.cut_bytes == [10**7] * 7
    assert plain.send_cut_bytes == [10**7 // 8] * 7
    assert "send_cut_bytes" not in sp.to_dict() and "send_cut_bytes" in plain.to_dict()
    dev = Device("gpu", memory_bytes=10**15, link_bandwidth_bytes_per_s=1e9)
    cluster = Cluster([dev, dev])
    cm_sp = CostModel(sp, cluster, batch_size=8, microbatches=8, schedule="1f1b",
                      checkpoint="always", state_bytes_per_parameter=16, headroom=0.0)  # fmt: skip
    cm_plain = CostModel(plain, cluster, batch_size=8, microbatches=8, schedule="1f1b",
                         checkpoint="always", state_bytes_per_parameter=16, headroom=0.0)  # fmt: skip
    assert cm_plain.send_s(0, 4) == cm_sp.send_s(0, 4)  # the same 1/T sent
    # a checkpointed stage keeps each unit's input: whole without sequence parallelism
    keep_sp = cm_sp.segment(0, 0, 4).activation_bytes
    keep_plain = cm_plain.segment(0, 0, 4).activation_bytes
    assert keep_plain > keep_sp


def test_fp32_gradient_buffer_beside_the_bf16_gradient() -> None:
    """DeepSpeed's BF16_Optimizer: an fp32 gradient per parameter beside the bf16 one; with
    its ZeRO-1 equivalent over 8 replicas, mixed Adam's 16 bytes become 2 + 2 + 4 + 12 / 8."""
    assert sharded_state_bytes_per_parameter(16, 2, "optimizer", 8) == 2 + 2 + 12 / 8
    with_buffer = sharded_state_bytes_per_parameter(16, 2, "optimizer", 8, True, True)
    assert with_buffer == 2 + 2 + 4 + 12 / 8
    assert sharded_state_bytes_per_parameter(16, 2, "none", 1, True, True) == 20
    assert sharded_state_bytes_per_parameter(16, 2, "gradients", 8, True, True) == 2 + 18 / 8
    base = plan(_profile(), _mesh())
    buffered = plan(_profile(), _mesh(fp32_grad_buffer=True))
    assert buffered.mesh is not None and base.mesh is not None
    assert buffered.mesh.device_state_bytes_per_parameter == 2 + 2 + 4 + 12 / 8
    per_device = 4 * 10**8 * 4  # PP 2: 4 units of 10^8 parameters a stage, 4 bytes each more
    assert buffered.mesh.peak_bytes - base.mesh.peak_bytes == per_device


def _mesh(**options: object) -> PlanRequest:
    options.setdefault("shard", "optimizer")
    return PlanRequest(
        cluster=Cluster([Device.from_spec("h100", memory_bytes=10**15)] * 16),
        batch_size=64, microbatches=8, schedule="1f1b", tensor_parallel=1, data_parallel=8,
        gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9,
        baselines=False, **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_overlapped_gradient_reduction_exposes_less_and_reserve_adds_memory() -> None:
    p = _profile()
    plain = plan(p, _mesh())
    overlapped = plan(p, _mesh(grad_reduce_overlap=True))
    assert overlapped.allreduce_s < plain.allreduce_s
    reserved = plan(p, _mesh(memory_reserve_bytes=3 * 2**30))
    assert reserved.mesh.peak_bytes == plain.mesh.peak_bytes + 3 * 2**30


def _h100_ring_s(nbytes: float) -> float:
    """A ring collective pass of ``nbytes`` over 8 H100s in one node, by hand: NVLink at
    NCCL's 370 GB/s, the catalog's (NCCL's) latency per collective and per ring step."""
    spec = get_device("H100-SXM-80GB")
    return 7 / 8 * nbytes / 370e9 + spec.collective_base_latency_s + 7 * spec.collective_latency_s


def _h100_all_reduce_s(nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over 8 H100s in one node (NCCL's tree is for groups
    across nodes): two passes' bytes and steps, one collective's base latency."""
    spec = get_device("H100-SXM-80GB")
    return (
        2 * 7 / 8 * nbytes / 370e9 + spec.collective_base_latency_s + 14 * spec.collective_latency_s
    )


def test_fp32_gradient_reduction_moves_4_bytes_per_gradient_element() -> None:
    """Megatron's --accumulate-allreduce-grads-in-fp32 / FSDP2's reduce_dtype=float32: the
    gradients' collectives carry 4 bytes per element of bf16 parameters, the parameter gathers
    stay at 2. By hand for 16 H100s, PP 2 x D 8 in one node (NVLink at NCCL's 370 GB/s, NCCL's
    latencies): each rank reduces 4 units x 2e8 bytes; ZeRO-1 reduce-scatters the gradients and
    gathers the parameters after the drain, plain DP all-reduces the gradients (two passes)."""
    p, grads = _profile(), 4 * 2e8
    ring = _h100_ring_s

    bf16 = plan(p, _mesh())
    fp32 = plan(p, _mesh(grad_reduce_fp32=True))
    assert bf16.allreduce_s == pytest.approx(2 * ring(grads))
    assert fp32.allreduce_s == pytest.approx(ring(2 * grads) + ring(grads))
    plain = plan(p, _mesh(shard="none", grad_reduce_fp32=True))
    assert plain.allreduce_s == pytest.approx(_h100_all_reduce_s(2 * grads))
    # fp32 parameters reduce in their own dtype: nothing moves more
    top = Topology(8, 450e9, 50e9, grad_reduce_fp32=True)
    assert top.grad_bytes_factor(2) == 2.0 and top.grad_bytes_factor(4) == 1.0
    assert Topology(8, 450e9, 50e9).grad_bytes_factor(2) == 1.0
    # the mesh search's proven lower bound stays below every searched mesh's step with it
    free = dataclasses.replace(
        _mesh(shard="auto", grad_reduce_fp32=True), tensor_parallel="auto", data_parallel="auto"
    )
    search = plan(p, free)
    rows = [r for r in search.mesh.candidates if r.searched and r.step_s is not None]
    assert rows and all(r.lower_bound_s <= r.step_s * (1 + 1e-9) for r in rows)
    # the gradients' streamed reduce-scatter (ZeRO-3) grows, never shrinks
    fsdp = plan(p, _mesh(shard="parameters"))
    fsdp32 = plan(p, _mesh(shard="parameters", grad_reduce_fp32=True))
    assert fsdp32.iteration_time_s >= fsdp.iteration_time_s


def test_reshard_after_forward_false_gathers_once_per_step() -> None:
    p = _profile()
    per_mb = plan(p, _mesh(shard="parameters"))
    once = plan(p, _mesh(shard="parameters", reshard_after_forward=False))
    assert once.mesh.peak_bytes > per_mb.mesh.peak_bytes
    assert once.pipeline_iteration_s <= per_mb.pipeline_iteration_s


def test_the_cli_flags_reach_the_request(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from autopipe.cli import main
    from autopipe.core.plan import load_plan

    folder = Path(str(tmp_path))
    path, out = folder / "profile.json", folder / "plan.json"
    _profile().save(path)
    flags = ["plan", str(path), "--gpus", "16", "--data-parallel", "8", "--shard", "parameters",
             "--tensor-parallel", "1", "--batch-size", "16", "--microbatches", "2",
             "--schedule", "1f1b", "--gpus-per-node", "8", "--inter-node-bandwidth", "50GB",
             "--precision", "fp8",
             "--selective-recompute", "--no-sequence-parallel", "--tp-comm-overlap",
             "--overlap-grad-reduce", "--no-reshard-after-forward", "--memory-reserve", "2GiB",
             "--grad-reduce-fp32", "--fp32-grad-buffer", "--optimizer-kernel", "fused",
             "--grad-clip", "megatron", "--json", str(out), "-q"]  # fmt: skip
    assert main(flags) == 0, capsys.readouterr().err
    request = load_plan(out).request
    assert request.precision == "fp8" and request.selective_recompute
    assert not request.sequence_parallel and request.tp_comm_overlap
    assert request.grad_reduce_overlap and not request.reshard_after_forward
    assert request.grad_reduce_fp32 and request.fp32_grad_buffer
    assert request.memory_reserve_bytes == 2 * 2**30
    assert (request.optimizer_kernel, request.grad_clip) == ("fused", "megatron")
    assert load_plan(out).report.optimizer_s > 0
    with pytest.raises(SystemExit) as bad:
        main(["plan", str(path), "--gpus", "2", "--precision", "int8"])
    assert bad.value.code == 2


def test_a_hidden_collective_costs_its_share_of_overlapped_compute() -> None:
    """Overlap is not free: a gather hidden behind compute still costs
    ``overlap_compute_loss`` of its seconds; one outlasting the compute costs the excess."""
    top = Topology(8, 450e9, 50e9, overlap_compute_loss=0.1)
    assert top.hidden_cost_s(2.0, 10.0) == pytest.approx(0.2)
    assert top.hidden_cost_s(12.0, 10.0) == pytest.approx(2.0 + 1.0)
    assert Topology(8, 450e9, 50e9).hidden_cost_s(2.0, 10.0) == 0.0
    assert tp_overlap_exposed_s(8.0, 100.0, 8, 0.1) == pytest.approx(1.0 + 0.7)


def test_emit_keys_for_the_trainer_options() -> None:
    """torchtitan 0.2.2's keys and Megatron's flags for the request's options."""
    from autopipe.planner.emit import _megatron_trainer_args
    from autopipe.planner.emit_torchtitan import _trainer_keys

    p = plan(
        _profile(),
        _mesh(
            shard="parameters", precision="fp8", selective_recompute=True,
            reshard_after_forward=False, tp_comm_overlap=True,
        ),
    )  # fmt: skip
    keys = _trainer_keys(p)
    assert keys["converters"] == ["quantize.linear.float8"]
    assert keys["ac_mode"] == "selective"
    assert keys["parallelism"] == {"fsdp_reshard_after_forward": "never"}  # T = 1: no async TP
    z1 = plan(_profile(), _mesh(grad_reduce_overlap=True, selective_recompute=True))
    assert _megatron_trainer_args(z1, False) == [
        "--recompute-granularity", "selective", "--overlap-grad-reduce", "--overlap-param-gather",
    ]  # fmt: skip
    assert _megatron_trainer_args(z1, True) == ["--overlap-grad-reduce", "--overlap-param-gather"]
    fp32 = plan(_profile(), _mesh(grad_reduce_fp32=True))
    assert _megatron_trainer_args(fp32, True) == ["--accumulate-allreduce-grads-in-fp32"]


def test_nvlink_collectives_run_at_nccls_share_of_the_line_rate() -> None:
    """The catalog's NVLink figure is the line rate (H100: 450 GB/s per direction; A100: 300);
    NCCL's protocol overhead leaves 370 GB/s of bus bandwidth on Hopper (NVIDIA/nccl-tests#212)
    and 240 on the A100 (NCCL's own 20 GB/s per NVLink 3 link of 25, src/graph/topo.h;
    NVIDIA/nccl#1054), so a mesh's links inside a node are priced at those; a link the user
    gave keeps its figure. Before, the A100 was priced at its 300 GB/s line rate."""
    from autopipe.planner.mesh import _topology
    from autopipe.planner.mesh_costs import NCCL_NVLINK_EFFICIENCY

    h100 = Device.from_spec("h100")
    top = _topology(_mesh(), 16, h100)
    assert top.intra_bandwidth_bytes_per_s == pytest.approx(370e9)
    one_node = _topology(
        dataclasses.replace(_mesh(), inter_node_bandwidth_bytes_per_s=None), 8, h100
    )
    assert one_node.inter_bandwidth_bytes_per_s == pytest.approx(370e9)
    a100 = Device.from_spec("a100")
    assert _topology(_mesh(), 16, a100).intra_bandwidth_bytes_per_s == pytest.approx(240e9)
    custom = dataclasses.replace(h100, link_bandwidth_bytes_per_s=200e9)
    assert _topology(_mesh(), 16, custom).intra_bandwidth_bytes_per_s == 200e9
    for fraction, source in NCCL_NVLINK_EFFICIENCY.values():
        assert 0 < fraction <= 1 and "nccl" in source


def test_network_transfers_run_at_nccls_share_of_the_adapters_line_rate() -> None:
    """NCCL's maintainer counts 24 GB/s as the peak of a 200 Gb/s adapter (25 GB/s line rate;
    NVIDIA/nccl-tests#119): the catalog's inter-node line rates (HDR 25 GB/s, NDR 50 GB/s per
    GPU) are priced at 24 / 25 of it; a figure the user gave that is not the line rate is taken
    as measured. Before, the line rate itself."""
    from autopipe.planner.mesh import _topology

    h100 = Device.from_spec("h100")
    at_line_rate = _mesh()
    assert at_line_rate.inter_node_bandwidth_bytes_per_s == 50e9
    assert _topology(at_line_rate, 16, h100).inter_bandwidth_bytes_per_s == pytest.approx(48e9)
    measured = dataclasses.replace(_mesh(), inter_node_bandwidth_bytes_per_s=45e9)
    assert _topology(measured, 16, h100).inter_bandwidth_bytes_per_s == 45e9
    a100 = Device.from_spec("a100")
    hdr = dataclasses.replace(_mesh(), inter_node_bandwidth_bytes_per_s=25e9)
    assert _topology(hdr, 16, a100).inter_bandwidth_bytes_per_s == pytest.approx(24e9)


def test_fsdp2_copies_its_gathers_out_and_its_gradients_in_on_the_compute_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FSDP2's ``foreach_all_gather_copy_out`` copies each gather's flat buffer into the
    parameters on the compute stream (read + write of the unit's per-TP parameters), and
    ``foreach_reduce`` chunk-cats the gradients into the reduce-scatter input there (read in
    the parameters' dtype, written in the reduce dtype). By hand at 2e12 B/s: 1e9 B gathered
    -> 1 ms; 1e9 B of bf16 gradients reduced in fp32 (factor 2) -> 1.5 ms. Priced at the
    catalog's sustained bandwidth (H100 SXM: 3.35 TB/s x 0.8); 0 where it is unknown."""
    from autopipe.planner.mesh import _topology
    from autopipe.planner.mesh_costs import gather_copy_out_s, reduce_copy_in_s

    top = Topology(8, 450e9, 50e9, memory_bytes_per_s=2e12)
    assert gather_copy_out_s(1e9, top) == pytest.approx(1e-3)
    assert reduce_copy_in_s(1e9, 2.0, top) == pytest.approx(1.5e-3)
    blind = Topology(8, 450e9, 50e9)
    assert gather_copy_out_s(1e9, blind) == reduce_copy_in_s(1e9, 2.0, blind) == 0.0
    # each parameters-sharded unit pays one copy-out per pass: 2 x 2e8 B / 2e12 B/s
    p = _profile()
    fsdp = {"shard": "parameters", "dp": 8}
    with_copy = device_profile(p, 1, top, **fsdp).units[3]  # type: ignore[arg-type]
    without = device_profile(p, 1, blind, **fsdp).units[3]  # type: ignore[arg-type]
    assert with_copy.forward_s - without.forward_s == pytest.approx(2e-4)
    assert with_copy.backward_s - without.backward_s == pytest.approx(2e-4)
    spec = get_device("H100-SXM-80GB")
    mesh_top = _topology(_mesh(), 16, Device.from_spec("h100"))
    assert mesh_top.memory_bytes_per_s == pytest.approx(
        spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    )
    # the plan's exposed DP communication (ZeRO-2: FSDP2 without resharding) includes the
    # gradients' copy-in: PP 2 x DP 8, a rank's 4 units of 2e8 B, bf16 reduced in fp32
    request = _mesh(shard="gradients", grad_reduce_fp32=True)
    on = plan(p, request)
    monkeypatch.setattr("autopipe.planner.mesh.reduce_copy_in_s", lambda *a: 0.0)
    off = plan(p, request)
    assert on.mesh is not None and off.mesh is not None and on.mesh_shape == (2, 8, 1)
    extra = on.mesh.candidates[0].dp_comm_s - off.mesh.candidates[0].dp_comm_s
    assert extra == pytest.approx(4 * 2e8 * 3 / mesh_top.memory_bytes_per_s)


def test_the_optimizer_step_is_priced_after_the_gradient_reduction() -> None:
    """A mesh plan's step ends with the optimizer step over the busiest rank's share of the
    state, at the catalog's sustained bandwidth: PP 2 x DP 8, a rank's 4 units of 1e8
    parameters. FSDP2 (``parameters``) as torchtitan runs it: 1/8 of them, foreach AdamW on
    the fp32 shards (80 B) after clip_grad_norm_ (12 B); ZeRO-1 as Megatron runs it: 1/8,
    FusedAdam (28 B), its norm pass (4 B), the bf16 copy of the updated weights (6 B)."""
    from autopipe.planner.mesh import _topology

    bw = _topology(_mesh(), 16, Device.from_spec("h100")).memory_bytes_per_s
    p = _profile()
    fsdp = plan(p, _mesh(shard="parameters", grad_clip="torch", grad_reduce_fp32=True))
    zero1 = plan(p, _mesh(optimizer_kernel="fused", grad_clip="megatron", grad_reduce_fp32=True))
    for out, per_element in ((fsdp, 92), (zero1, 38)):
        assert out.mesh is not None and out.mesh_shape == (2, 8, 1)
        units = max(sum(len(s.units) for s in out.stages if s.rank == r) for r in range(2))
        assert units == 4
        expected = units * 10**8 / 8 * per_element / bw
        assert out.report.optimizer_s == pytest.approx(expected)
        assert out.mesh.candidates[0].optimizer_s == pytest.approx(expected)
        assert out.iteration_time_s == pytest.approx(
            out.pipeline_iteration_s + out.allreduce_s + expected
        )
    # without the fp32 gradient buffer, Megatron casts the bf16 gradients first (+6 B)
    cast = plan(p, _mesh(optimizer_kernel="fused", grad_clip="megatron"))
    assert cast.report.optimizer_s == pytest.approx(4 * 10**8 / 8 * 44 / bw)
    # 1e9 fp32 shards under FSDP2, foreach AdamW (80 B) at 2e12 B/s: 40 ms; no bandwidth: 0
    from autopipe.planner.mesh_costs import optimizer_step_s

    top = Topology(8, 450e9, 50e9, memory_bytes_per_s=2e12, optimizer="mixed-adam")
    assert optimizer_step_s(1e9, "parameters", 2, top) == pytest.approx(0.04)
    blind = dataclasses.replace(top, memory_bytes_per_s=0.0)
    assert optimizer_step_s(1e9, "parameters", 2, blind) == 0.0


def test_torchs_fused_matmul_reduce_scatter_sums_its_partials_on_the_compute_stream() -> None:
    """torchtitan's async TP (``tp_overlap_backward=False``) reduce-scatters in forward with
    torch's fused matmul-reduce-scatter, which sends the partial sums into a buffer of the
    whole output's size and adds them up with ``torch.sum``: per forward, the unit's row-wise
    outputs read once and an eighth written. By hand: 2e7 B x (1 + 1/8) / 2e12 B/s. Not on
    the Megatron path (its overlap runs in Transformer Engine), nor without async TP."""
    from autopipe.planner.mesh_costs import fused_reduce_scatter_sum_s

    p = _profile()
    p.units[0].tp_rowwise_output_bytes = 2 * 10**7
    top = Topology(8, 450e9, 50e9, tp_comm_overlap=True, memory_bytes_per_s=2e12)
    titan = dataclasses.replace(top, tp_overlap_backward=False)
    blind = dataclasses.replace(titan, memory_bytes_per_s=0.0)
    sum_s = 2e7 * (1 + 1 / 8) / 2e12
    assert fused_reduce_scatter_sum_s(p.units[0], 8, titan) == pytest.approx(sum_s)
    assert fused_reduce_scatter_sum_s(p.units[0], 1, titan) == 0.0
    assert fused_reduce_scatter_sum_s(p.units[1], 8, titan) == 0.0  # no row-wise outputs
    with_sum = device_profile(p, 8, titan).units[0]
    assert with_sum.forward_s - device_profile(p, 8, blind).units[0].forward_s == pytest.approx(
        sum_s
    )
    assert with_sum.backward_s == pytest.approx(device_profile(p, 8, blind).units[0].backward_s)
    megatron = device_profile(p, 8, top).units[0].forward_s
    assert megatron == pytest.approx(
        device_profile(p, 8, dataclasses.replace(top, memory_bytes_per_s=0.0)).units[0].forward_s
    )


def test_sequence_parallelism_on_dim_1_copies_every_tp_buffer_once_more() -> None:
    """torch's functional all-gather and reduce-scatter on a non-leading dimension
    (``tp_sequence_dim`` 1, torchtitan's ``[b, s, h]`` with ``Shard(1)``) chunk + cat each
    buffer: a pass's collectives (all-gather and reduce-scatter of C = 2e7 B each) copy
    2 x 2C bytes more, at 2e12 B/s 4e-5 s. The sequence first (Megatron's layout): none.
    Under torchtitan's async TP the fused reduce-scatter's sum writes the scattered layout
    itself, so the forward keeps the all-gather's half."""
    from autopipe.planner.mesh_costs import sequence_relayout_s

    p = _profile()
    top = Topology(8, 450e9, 50e9, memory_bytes_per_s=2e12)
    blind = dataclasses.replace(top, memory_bytes_per_s=0.0)
    seq_first = device_profile(p, 8, top).units[0]
    assert seq_first.forward_s == pytest.approx(device_profile(p, 8, blind).units[0].forward_s)
    p.units[0].tp_sequence_dim = 1
    copy = 2 * 2 * 2e7 / 2e12
    assert sequence_relayout_s(2 * 2e7, p.units[0], 8, top) == pytest.approx(copy)
    assert sequence_relayout_s(2 * 2e7, p.units[0], 1, top) == 0.0
    batch_first = device_profile(p, 8, top).units[0]
    assert batch_first.forward_s - seq_first.forward_s == pytest.approx(copy)
    assert batch_first.backward_s - seq_first.backward_s == pytest.approx(copy)
    titan = dataclasses.replace(top, tp_comm_overlap=True, tp_overlap_backward=False)
    fused = device_profile(p, 8, titan).units[0]
    p.units[0].tp_sequence_dim = 0
    fused_seq_first = device_profile(p, 8, titan).units[0]
    assert fused.forward_s - fused_seq_first.forward_s == pytest.approx(copy / 2)
    assert fused.backward_s - fused_seq_first.backward_s == pytest.approx(copy)


def test_gradients_are_summed_into_fp32_every_micro_batch_where_the_trainer_does_it() -> None:
    """DeepSpeed's BF16_Optimizer (``fp32_grad_buffer``) runs ``update_hp_grads`` after every
    micro-batch's backward, ``hp_grad.add_(lp_grad.to(fp32))``: 2 + 4 + 4 + 4 + 4 = 18 bytes
    per bf16 parameter; FSDP2 under PP reducing in fp32 adds each micro-batch's bf16 gradient
    into its fp32 accumulator (``+=``): 2 + 4 + 4 = 10. By hand at 2e12 B/s, a unit of 1e8
    parameters: 0.9 ms and 0.5 ms more backward per micro-batch, fixed (an overhead: it does
    not shrink with the micro-batch). Megatron (fp32 reduction, accumulation fused into the
    weight-gradient GEMM), bf16 reduction and fp32 parameters: nothing."""
    from autopipe.planner.mesh_costs import grad_accumulation_bytes_per_parameter

    p = _profile()
    buffered = Topology(8, 450e9, 50e9, memory_bytes_per_s=2e12, fp32_grad_buffer=True)
    fsdp_pp = Topology(
        8, 450e9, 50e9, memory_bytes_per_s=2e12, reshard_after_forward=False,
        grad_reduce_fp32=True,
    )  # fmt: skip
    assert grad_accumulation_bytes_per_parameter(buffered, "optimizer", 2) == 18
    assert grad_accumulation_bytes_per_parameter(fsdp_pp, "parameters", 2) == 10
    assert grad_accumulation_bytes_per_parameter(fsdp_pp, "optimizer", 2) == 0
    assert grad_accumulation_bytes_per_parameter(buffered, "optimizer", 4) == 0
    u, ds = p.units[3], device_profile(p, 1, buffered).units[3]
    assert ds.backward_s - u.backward_s == pytest.approx(9e-4)
    assert ds.backward_overhead_s - u.backward_overhead_s == pytest.approx(9e-4)
    assert ds.forward_s == u.forward_s
    fsdp = device_profile(p, 1, fsdp_pp, shard="parameters", dp=8).units[3]
    assert fsdp.backward_s - u.backward_s == pytest.approx(5e-4)
    megatron = Topology(8, 450e9, 50e9, memory_bytes_per_s=2e12, grad_reduce_fp32=True)
    assert device_profile(p, 1, megatron) is p
    # in a plan: each stage's backward per micro-batch grows by its 4 units' accumulation, at
    # the catalog's sustained bandwidth (H100 SXM: 3.35 TB/s x 0.8)
    spec = get_device("H100-SXM-80GB")
    bw = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    base = plan(p, _mesh(grad_reduce_fp32=True))
    summed = plan(p, _mesh(grad_reduce_fp32=True, fp32_grad_buffer=True))
    extra = summed.stages[0].report.backward_s - base.stages[0].report.backward_s
    assert len(summed.stages[0].units) == 4
    assert extra == pytest.approx(4 * 1e8 * 18 / bw)


def test_bf16_optimizer_all_reduces_its_fp32_gradients_then_gathers_the_parameters() -> None:
    """DeepSpeed's BF16_Optimizer keeps its fp32 gradients whole on every replica: the pipeline
    engine all-reduces them (``_bf16_reduce_grads``: ``buffered_allreduce_fallback``), then the
    step all-gathers the updated bf16 partitions. By hand for 16 H100s, PP 2 x D 8 in one node
    (NVLink at NCCL's 370 GB/s, NCCL's latencies): a rank's 4 units x 2e8 bytes, an all-reduce
    at 4 bytes per element and a gather at 2 (ZeRO-1 without the buffer: a reduce-scatter and
    the gather)."""
    p, grads = _profile(), 4 * 2e8
    ring = _h100_ring_s

    bf16_opt = plan(p, _mesh(grad_reduce_fp32=True, fp32_grad_buffer=True))
    assert bf16_opt.allreduce_s == pytest.approx(_h100_all_reduce_s(2 * grads) + ring(grads))
    zero1 = plan(p, _mesh(grad_reduce_fp32=True))
    assert zero1.allreduce_s == pytest.approx(ring(2 * grads) + ring(grads))
    # the mesh search's lower bound stays below every searched mesh's step with it
    free = dataclasses.replace(
        _mesh(shard="auto", grad_reduce_fp32=True, fp32_grad_buffer=True),
        tensor_parallel="auto", data_parallel="auto",
    )  # fmt: skip
    rows = [r for r in plan(p, free).mesh.candidates if r.searched and r.step_s is not None]
    assert rows and all(r.lower_bound_s <= r.step_s * (1 + 1e-9) for r in rows)


def test_fsdp2_under_pp_reduce_scatters_after_the_last_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.distributed.pipelining keeps FSDP2's gradient sync off through every micro-batch's
    backward, the last one's too, then runs every parameter group's post-backward
    (``perform_reduce_grad``): the reduce-scatter of a rank's gradients starts when its
    backward is over, all of it exposed. With the once-per-step gathers and the copy-in
    priced as 0: a rank's 4 units x 2e8 bytes in fp32, one ring pass (PP 2 x D 8 in one
    node, NVLink at 370 GB/s); a trainer that streams it with the last backward
    (``grad_reduce_overlap``) hides all but what outlasts the last unit."""
    p = _profile()
    spec = get_device("H100-SXM-80GB")
    ring = 7 / 8 * 2 * 4 * 2e8 / 370e9 + spec.collective_base_latency_s
    ring += 7 * spec.collective_latency_s
    monkeypatch.setattr("autopipe.planner.mesh.reduce_copy_in_s", lambda *a: 0.0)
    fsdp_pp = {"shard": "parameters", "reshard_after_forward": False, "grad_reduce_fp32": True}
    after = plan(p, _mesh(**fsdp_pp))
    streamed = plan(p, _mesh(grad_reduce_overlap=True, **fsdp_pp))
    gathers = streamed.mesh.candidates[0].dp_comm_s  # gathers + what outlasts the backward
    assert after.mesh_shape == (2, 8, 1)
    assert gathers < ring
    assert after.mesh.candidates[0].dp_comm_s > ring
    monkeypatch.setattr("autopipe.planner.mesh._streamed_exposed_s", lambda *a, **k: 0.0)
    after = plan(p, _mesh(**fsdp_pp))
    assert after.mesh.candidates[0].dp_comm_s == pytest.approx(ring)


def test_fp8_prices_each_checkpointing_modes_casts_as_measured_for_it() -> None:
    """Under precision="fp8" a unit's casts under selective and full activation checkpointing
    are its ``fp8_cast_selective_bytes`` / ``fp8_cast_full_bytes`` (forward and backward
    together, measured under that mode), not the two no-AC fields plus a forward re-run's:
    selective adds the difference to ``selective_recompute_s``, full to
    ``full_recompute_extra_s`` (here 1.072e9 B fewer than a forward's 2.68e9 re-run: -0.4 ms
    at the H100 SXM's 3.35 TB/s x 0.8), which the cost model adds to a checkpointed stage's
    re-run. bf16 leaves both alone. Failed before (no such fields: the selective casts kept
    the two fields' bytes, full AC's re-run re-priced the forward's casts)."""
    p = _profile()
    f, b = 2_680_000_000, 5_360_000_000
    us = [
        dataclasses.replace(
            u,
            fp8_cast_forward_bytes=f,
            fp8_cast_backward_bytes=b,
            fp8_cast_selective_bytes=f + b - 268_000_000,
            fp8_cast_full_bytes=2 * f + b - 1_072_000_000,
        )
        for u in p.units
    ]
    casts = dataclasses.replace(p, units=us)
    fp8 = trainer_profile(casts, PlanRequest(precision="fp8")).units[0]
    bare = trainer_profile(
        dataclasses.replace(
            casts,
            units=[
                dataclasses.replace(u, fp8_cast_selective_bytes=0, fp8_cast_full_bytes=0)
                for u in us
            ],
        ),
        PlanRequest(precision="fp8"),
    ).units[0]
    assert fp8.forward_s == bare.forward_s and fp8.backward_s == bare.backward_s
    assert fp8.selective_recompute_s - bare.selective_recompute_s == pytest.approx(-0.1e-3)
    assert bare.full_recompute_extra_s == 0.0
    assert fp8.full_recompute_extra_s == pytest.approx(-0.4e-3)
    assert trainer_profile(casts, PlanRequest()).units[0].full_recompute_extra_s == 0.0
    # a checkpointed stage re-runs forward + extra: the cost model's recompute, its matrix
    # and the probe's per-segment times agree
    from autopipe.planner.chain import bottleneck
    from autopipe.planner.costs import CostModel
    from autopipe.planner.partition import dp_partition
    from autopipe.planner.probe import probe_partition

    out = trainer_profile(casts, PlanRequest(precision="fp8"))
    cluster = Cluster([Device(name="d", memory_bytes=None)] * 2)
    cm = CostModel(
        out, cluster, batch_size=4, microbatches=4, schedule="1f1b", checkpoint="always",
        state_bytes_per_parameter=16, headroom=0.0,
    )  # fmt: skip
    seg = cm.segment(0, 0, 4)
    assert seg.checkpoint
    assert seg.recompute_s == pytest.approx(seg.forward_s + 4 * -0.4e-3)
    assert cm.cost_matrix(0)[0, 4] == seg.time_s
    assert cm.segment_times(0, np.array([0]), np.array([4]))[0] == seg.time_s
    probed, best = probe_partition(cm), dp_partition(cm)
    assert probed is not None and best is not None
    assert probed.bottleneck_s == best.bottleneck_s == bottleneck(cm, best.bounds)


def test_fp8_prices_the_weights_casts_before_each_float8_all_gather() -> None:
    """Under precision fp8 with ``parameters`` sharding, each rank casts its shard of a
    unit's FP8 weights before the all-gather (torchtitan's float8 FSDP recipe, torchao's
    eager ``fsdp_pre_all_gather``: 21 bytes per shard element, measured) on the gather's
    copy-in stream: the first unit's gather, hidden behind nothing, grows by its shard's
    21e9 / (T 2 x D 4) B at 1 TB/s = 2.625 ms in forward and in backward (for the last
    unit); the per-step amax (4 B per element) adds 4e9 / 8 B = 0.5 ms per unit to the
    optimizer step. bf16 (``fp8_all_gather`` off) prices neither. Failed before (no such
    fields; the weights' casts were not priced)."""
    from autopipe.planner.mesh_costs import fp8_gather_cast_s, fp8_weight_amax_s

    p = _profile(units=3)
    us = [
        dataclasses.replace(u, fp8_gather_cast_bytes=21 * 10**9, fp8_weight_amax_bytes=4 * 10**9)
        for u in p.units
    ]
    casts = dataclasses.replace(p, units=us)
    kw = dict(memory_bytes_per_s=1e12)
    fp8 = Topology(8, 1e11, 1e10, fp8_all_gather=True, **kw)
    bf16 = Topology(8, 1e11, 1e10, **kw)
    assert fp8_gather_cast_s(us[0], 2, 4, fp8) == pytest.approx(2.625e-3)
    assert fp8_gather_cast_s(us[0], 2, 4, bf16) == 0.0
    assert fp8_weight_amax_s(us, 2, 4, fp8) == pytest.approx(3 * 0.5e-3)
    on = device_profile(casts, 2, fp8, shard="parameters", dp=4)
    off = device_profile(casts, 2, bf16, shard="parameters", dp=4)
    plain = device_profile(p, 2, fp8, shard="parameters", dp=4)
    assert on.units[0].forward_s - off.units[0].forward_s == pytest.approx(2.625e-3)
    assert on.units[-1].backward_s - off.units[-1].backward_s == pytest.approx(2.625e-3)
    assert off.units[0].forward_s == plain.units[0].forward_s
