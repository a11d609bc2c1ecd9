"""Context parallelism (C) and expert parallelism (E) in the mesh planner (issue 35,
torch-free parts): the cost and memory terms against hand-computed numbers, the links the
groups cross, the search against brute force over every (T, C, D, E, shard), the plan's and the
report's CP and EP, and the CLI's refusals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from autopipe.planner import PlanningError, RuleViolation, plan
from autopipe.planner.context_expert import (
    context_expert_choices,
    context_expert_profile,
)
from autopipe.planner.mesh import mesh_candidates
from autopipe.planner.mesh_costs import Topology
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_errors import _err_line
from test_planner_mesh import tiny_profile

from autopipe.cli import main
from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan, load_plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

TOPOLOGY = Topology(
    gpus_per_node=4, intra_bandwidth_bytes_per_s=1e11, inter_bandwidth_bytes_per_s=1e9
)
SEQ = 2048


def long_profile(n_blocks: int = 4, *, seed: int = 0, moe: bool = False) -> Profile:
    """tiny_profile's blocks as attention blocks (8 heads, 2 KV heads of 16) over 2048 tokens,
    and with ``moe`` an MoE layer each (8 experts, top-2, 80% of the parameters routed
    experts, hidden 128)."""
    p = tiny_profile(n_blocks, seed=seed)
    units = []
    for u in p.units:
        if u.name.startswith("layers."):
            u = dataclasses.replace(
                u, attention_layers=1, attention_heads=8, attention_kv_heads=2,
                attention_head_dim=16, attention_value_head_dim=16,
                forward_flops=1e12, backward_flops=2e12,
            )  # fmt: skip
            if moe:
                u = dataclasses.replace(
                    u, moe_layers=1, moe_experts=8, moe_top_k=2,
                    moe_expert_parameter_count=80_000, moe_hidden_size=128,
                )  # fmt: skip
        units.append(u)
    return dataclasses.replace(p, units=units, sequence_length=SEQ)


# ----- cost and memory terms -------------------------------------------------------------


def test_context_parallel_unit_by_hand() -> None:
    p = long_profile()
    c = 4
    out = context_expert_profile(p, c, 1, 1, TOPOLOGY)
    u, v = p.units[1], out.units[1]
    b, size = p.batch_size, 2
    attn = 2.0 * b * 8 * SEQ * SEQ * (16 + 16)  # as counted: scores and weighted values
    f_att = attn / u.forward_flops
    kv = b * (SEQ / c) * 2 * (16 + 16)  # K and V elements of one rank's chunk
    # torch's ALL_GATHER rotation: the other 3 chunks gathered once per pass (CP group of 4,
    # T = 1: inside the node), behind the local block only (1/C of the rank's attention)
    gather = (c - 1) * kv * size / 1e11
    grad_step = kv * 4 / 1e11  # the fp32 K/V gradients, one ring step
    fwd_size = u.forward_s - u.forward_overhead_s
    bwd_size = u.backward_s - u.backward_overhead_s
    block_f, block_b = fwd_size * f_att / c / c, bwd_size * f_att / c / c
    # backward: the gather again, C - 1 gradient steps each behind a block, the last exposed
    ring_b = max(0.0, gather - block_b) + (c - 1) * max(0.0, grad_step - block_b) + grad_step
    # device "gpu" is no catalog device: its memory bandwidth is unknown, the merges unpriced
    expect_f = u.forward_overhead_s + fwd_size / c + max(0.0, gather - block_f)
    expect_b = u.backward_overhead_s + bwd_size / c + ring_b
    assert v.forward_s == pytest.approx(expect_f, rel=1e-12)
    assert v.backward_s == pytest.approx(expect_b, rel=1e-12)
    assert v.activation_bytes == u.activation_bytes // c
    assert v.tp_collective_bytes == u.tp_collective_bytes // c
    assert out.cut_bytes == [x // c for x in p.cut_bytes]
    assert v.parameter_bytes == u.parameter_bytes  # CP replicates the parameters


def test_ring_merges_at_the_memory_bandwidth_and_the_all_gather_method() -> None:
    """On a catalog GPU the ring's fp32 merges are priced at its memory bandwidth, per the
    byte counts of ``RING_MERGE_BYTES`` (torch's ``_SDPAMerger`` and backward accumulators);
    the ``all_gather`` method (Llama 3's) has no merges and its gather exposed."""
    from autopipe.planner.context_expert import RING_MERGE_BYTES

    from autopipe.core.catalog import get_device

    spec = get_device("H100-SXM-80GB")
    p = dataclasses.replace(long_profile(), device=spec.name)
    fast = Topology(4, 1e18, 1e18)  # the exchanges free: the merges alone
    c = 4
    u = p.units[1]
    ring = context_expert_profile(p, c, 1, 1, fast).units[1]
    bare = context_expert_profile(long_profile(), c, 1, 1, fast).units[1]
    tokens = p.batch_size * SEQ / c
    e_q, e_kv = tokens * 8 * 16, tokens * 2 * (16 + 16)
    bw = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    assert RING_MERGE_BYTES["forward_step"] == (38.0, 4.0)
    merge_f = (12 * e_q + (c - 1) * (38 * e_q + 4 * e_kv)) / bw
    merge_b = (20 * e_q + 28 * e_kv + (c - 1) * (10 * e_q + 25 * e_kv)) / bw
    assert ring.forward_s - bare.forward_s == pytest.approx(merge_f, rel=1e-9)
    assert ring.backward_s - bare.backward_s == pytest.approx(merge_b, rel=1e-9)
    slow = Topology(4, 1e9, 1e9)
    gathered = context_expert_profile(p, c, 1, 1, slow, method="all_gather").units[1]
    gather = (c - 1) * e_kv * 2 / 1e9  # exposed in full, in both passes
    fwd_size = u.forward_s - u.forward_overhead_s
    assert gathered.forward_s == pytest.approx(
        u.forward_overhead_s + fwd_size / c + gather, rel=1e-12
    )


def test_compiled_ring_waits_on_every_exchange_and_fuses_its_merges() -> None:
    """``ring_compiled`` (torch's ring traced into a ``torch.compile`` graph, as torchtitan
    compiles each block): functional collectives are waited as soon as issued under tracing
    (``_maybe_wrap_tensor``), so the K/V all-gather of each pass and all C fp32 K/V gradient
    steps are exposed even where the eager ring hides them behind the blocks; inductor fuses
    the merges (``RING_MERGE_BYTES_COMPILED``: 10 bytes per query element a forward step)."""
    from autopipe.planner.context_expert import RING_MERGE_BYTES_COMPILED

    from autopipe.core.catalog import get_device

    spec = get_device("H100-SXM-80GB")
    p = dataclasses.replace(long_profile(), device=spec.name)
    c, bw = 4, 1e11
    u = p.units[1]
    topo = Topology(4, bw, bw)
    compiled = context_expert_profile(p, c, 1, 1, topo, method="ring_compiled").units[1]
    eager = context_expert_profile(p, c, 1, 1, topo).units[1]
    tokens = p.batch_size * SEQ / c
    e_q, e_kv = tokens * 8 * 16, tokens * 2 * (16 + 16)
    mem = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    gather = (c - 1) * (e_kv * 2 / bw + topo.intra_latency_s)
    grad_step = e_kv * 4 / bw + topo.intra_latency_s
    assert RING_MERGE_BYTES_COMPILED["forward_step"] == (10.0, 0.0)
    merge_f = (4 * e_kv + (c - 1) * 10 * e_q) / mem
    merge_b = (6 * e_q + 10 * e_kv + (c - 1) * (10 * e_q + 10 * e_kv)) / mem
    fwd_size = u.forward_s - u.forward_overhead_s
    bwd_size = u.backward_s - u.backward_overhead_s
    assert compiled.forward_s == pytest.approx(
        u.forward_overhead_s + fwd_size / c + gather + merge_f, rel=1e-12
    )
    assert compiled.backward_s == pytest.approx(
        u.backward_overhead_s + bwd_size / c + gather + c * grad_step + merge_b, rel=1e-12
    )
    # the eager ring hides what the attention blocks cover; compiled, nothing is hidden
    free = Topology(4, 1e18, 1e18)
    eager_free = context_expert_profile(p, c, 1, 1, free).units[1]
    compiled_free = context_expert_profile(p, c, 1, 1, free, method="ring_compiled").units[1]
    assert compiled_free.forward_s < eager_free.forward_s  # fused merges: fewer bytes
    assert compiled.backward_s - compiled_free.backward_s > eager.backward_s - eager_free.backward_s


def test_ring_exchange_hides_behind_attention_until_it_outgrows_it() -> None:
    p = long_profile()
    slow = Topology(4, 1e6, 1e6)  # so slow that the ring outlasts the attention
    hidden = context_expert_profile(p, 2, 1, 1, Topology(4, 1e15, 1e15)).units[1]
    exposed = context_expert_profile(p, 2, 1, 1, slow).units[1]
    u = p.units[1]
    assert hidden.forward_s == pytest.approx(
        u.forward_overhead_s + (u.forward_s - u.forward_overhead_s) / 2, rel=1e-12
    )
    assert exposed.forward_s > hidden.forward_s


def test_expert_parallel_unit_by_hand() -> None:
    p = long_profile(moe=True)
    e, imbalance = 4, 1.25
    out = context_expert_profile(p, 1, e, 1, TOPOLOGY, imbalance)
    u, v = p.units[1], out.units[1]
    b, size = p.batch_size, 2
    assert v.parameter_bytes == math.ceil(u.parameter_bytes - 80_000 * size * (1 - 1 / e))
    experts = 2.0 * b * SEQ * 2 * 80_000 / 8
    f_exp = experts / u.forward_flops
    sent = b * SEQ * 2 * 128 * size * (e - 1) / e
    a2a = 2 * imbalance * sent / 1e11  # dispatch + combine, EP group of 4 inside the node
    fwd_size = u.forward_s - u.forward_overhead_s
    expect = u.forward_overhead_s + fwd_size * (1 + f_exp * (imbalance - 1)) + a2a
    assert v.forward_s == pytest.approx(expect, rel=1e-12)
    assert v.activation_bytes == u.activation_bytes


def test_tensor_parallelism_splits_the_routed_experts_too() -> None:
    """The runtime splits every expert's FFN over T (Megatron-style): one device holds
    ``1 / T`` of the routed experts left on it after EP, beside the split dense modules, and
    each MoE layer adds one TP region (an all-gather and a reduce-scatter of its tokens per
    pass) to the unit's collectives."""
    from autopipe.planner.mesh_costs import unit_device_parameter_bytes

    p = long_profile(moe=True)
    u = dataclasses.replace(p.units[1], tp_parameter_count=5_000)
    size, t = 2, 2
    whole = u.parameter_bytes
    split = (5_000 + 80_000) * size
    assert unit_device_parameter_bytes(u, t, size) == pytest.approx(whole - split + split / t)
    assert unit_device_parameter_bytes(u, 1, size) == whole
    for e in (1, 4):
        units = [u if i == 1 else w for i, w in enumerate(p.units)]
        v = context_expert_profile(dataclasses.replace(p, units=units), 1, e, t, TOPOLOGY).units[1]
        assert v.moe_expert_parameter_count == 80_000 // e
        assert v.tp_collective_bytes == u.tp_collective_bytes + u.output_bytes
        on_rank = v.parameter_bytes
        split = (5_000 + 80_000 // e) * size
        assert unit_device_parameter_bytes(v, t, size) == pytest.approx(on_rank - split / t)


def test_groups_cross_nodes_as_the_runtime_lays_them_out() -> None:
    # CP: C ranks T apart; EP: E ranks of dp x cp, T apart (each expert split over TP)
    t = TOPOLOGY
    assert not t.crosses_nodes(2, 2) and t.crosses_nodes(2, 4)  # CP of 2 and 4, T = 2
    assert not t.crosses_nodes(1, 4) and t.crosses_nodes(1, 8)  # EP of 4 and 8, T = 1
    assert t.crosses_nodes(2, 4)  # 4 consecutive ranks would stay inside
    assert t.collective_bandwidth_bytes_per_s(2, 2) == 1e11 and t.step_link(2, 2) == (1e11, 0.0)
    assert t.all_to_all_s(3e11, 1, 4) == pytest.approx(3.0)  # inside: all over NVLink


def test_cp_and_ep_groups_across_nodes_use_the_adapters_as_nccl_does() -> None:
    """Across nodes a CP group's K/V all-gather is a ring collective, run over every adapter
    its ranks have in a node (as a DP group's); the K/V gradients' ring steps are sends, each
    node-edge rank over its own adapter; an EP all-to-all sends its node's share over NVLink
    and the rest over each rank's own adapter at once. C = E = 16, T = 1, nodes of 4: 4 ranks
    a node. Before: every exchange at one adapter's rate."""
    t = Topology(4, 1e11, 1e9, 1e-6, 5e-6)
    assert t.collective_bandwidth_bytes_per_s(1, 16) == 4e9
    assert t.step_link(1, 16) == (1e9, 5e-6)
    # 15 units sent: 3 to this node's peers over NVLink, 12 to the others over its adapter
    assert t.all_to_all_s(15e9, 1, 16) == pytest.approx(max(3e9 / 1e11, 12e9 / 1e9) + 5e-6)
    assert t.all_to_all_s(15e9, 4, 16) == pytest.approx(15.0 + 5e-6)  # T fills the node

    p = long_profile()
    c, u = 16, p.units[1]
    v = context_expert_profile(p, c, 1, 1, t, method="all_gather").units[1]
    e_kv = p.batch_size * (SEQ / c) * 2 * (16 + 16)
    # exposed, over the 4 adapters; 12 NVLink hops and 3 network hops (4 nodes)
    gather = (c - 1) * e_kv * 2 / 4e9 + 12 * 1e-6 + 3 * 5e-6
    fwd_size = u.forward_s - u.forward_overhead_s
    assert v.forward_s == pytest.approx(u.forward_overhead_s + fwd_size / c + gather, rel=1e-12)

    moe = long_profile(moe=True)
    e, imbalance = 16, 1.25
    w, x = moe.units[1], context_expert_profile(moe, 1, e, 1, t, imbalance).units[1]
    sent = imbalance * moe.batch_size * SEQ * 2 * 128 * 2 * (e - 1) / e
    a2a = 2 * (max(sent * 3 / 15 / 1e11, sent * 12 / 15 / 1e9) + 5e-6)
    experts = 2.0 * moe.batch_size * SEQ * 2 * 80_000 / 8
    f_exp = experts / w.forward_flops
    size_f = w.forward_s - w.forward_overhead_s
    expect = w.forward_overhead_s + size_f * (1 + f_exp * (imbalance - 1)) + a2a
    assert x.forward_s == pytest.approx(expect, rel=1e-12)


def test_every_expert_parallel_candidate_is_one_autopipe_run_lays_out() -> None:
    """E divides dp x cp (the runtime's rule, runtime/distributed/mesh.py): a candidate
    with E dividing only dp x cp x tp (torchtitan 0.3's EP spanning TP) was planned, then
    refused by autopipe run."""
    from autopipe.planner.mesh import mesh_candidates

    moe = long_profile(moe=True)
    out = mesh_candidates(moe, 8, batch_size=8, tensor_parallel="auto",
                          context_parallel="auto", expert_parallel="auto")  # fmt: skip
    assert any(c.ep > 1 and c.tp > 1 for c in out)
    assert all((c.dp * c.cp) % c.ep == 0 for c in out)


def test_degrees_the_model_allows() -> None:
    dense = long_profile()
    assert context_expert_choices(dense, 8, "auto", "auto") == ([1, 2, 4, 8], [1])
    moe = long_profile(moe=True)
    assert context_expert_choices(moe, 8, 1, "auto") == ([1], [1, 2, 4, 8])
    with pytest.raises(RuleViolation, match="must divide half the sequence"):
        context_expert_choices(dense, 12, 3, 1)
    with pytest.raises(RuleViolation, match="needs a mixture-of-experts model"):
        context_expert_choices(dense, 8, 1, 2)
    with pytest.raises(RuleViolation, match="routed experts"):
        context_expert_choices(moe, 12, 1, 3)
    plain = tiny_profile()
    with pytest.raises(RuleViolation, match="recorded sequence length"):
        context_expert_choices(plain, 8, 2, 1)


# ----- the search --------------------------------------------------------------------------


def _cluster(n: int, memory: int | None) -> Cluster:
    return Cluster([Device("gpu", memory, 1.0, 1e11, 0.0) for _ in range(n)])


def _step(p: Profile, n: int, memory: int | None, **fixed: object) -> float:
    try:
        out = plan(
            p,
            PlanRequest(
                cluster=_cluster(n, memory), batch_size=16, gpus_per_node=4,
                inter_node_bandwidth_bytes_per_s=1e9, checkpoint="auto", **fixed,
            ),
        )  # fmt: skip
    except PlanningError:
        return math.inf
    return out.iteration_time_s


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    memory=st.sampled_from([None, 1_500_000, 4_000_000]),
    moe=st.booleans(),
)
def test_auto_search_equals_brute_force_over_every_mesh(
    seed: int, memory: int | None, moe: bool
) -> None:
    n = 8
    p = long_profile(n_blocks=4, seed=seed, moe=moe)
    auto = _step(
        p, n, memory, tensor_parallel="auto", data_parallel="auto", shard="auto",
        context_parallel="auto", expert_parallel="auto", schedule="1f1b",
    )  # fmt: skip
    grid = mesh_candidates(
        p, n, 16, gpus_per_node=4, context_parallel="auto", expert_parallel="auto"
    )
    assert any(c.cp > 1 for c in grid) and (any(c.ep > 1 for c in grid) == moe)
    every = [
        _step(
            p, n, memory, tensor_parallel=c.tp, data_parallel=c.dp, shard=c.shard,
            context_parallel=c.cp, expert_parallel=c.ep, schedule="1f1b",
        )
        for c in grid
        if c.pp <= len(p.units)
    ]  # fmt: skip
    best = min(every)
    if math.isinf(best):
        assert math.isinf(auto)
    else:
        assert auto == pytest.approx(best, rel=1e-12)


def test_context_parallel_fits_what_the_sequence_alone_would_not() -> None:
    """Activations divided by C: one long sequence (D cannot split it) on 4 devices fits in
    3.15 MB (needs 3.32 MB without CP, 3.02 MB with) only as a CP mesh."""
    p = long_profile(n_blocks=4)
    kw = dict(cluster=_cluster(4, 3_150_000), batch_size=1, gpus_per_node=8, checkpoint="never")
    with pytest.raises(PlanningError):
        plan(p, PlanRequest(data_parallel="auto", shard="auto", **kw))
    out = plan(p, PlanRequest(context_parallel="auto", data_parallel="auto", shard="auto", **kw))
    assert out.context_parallel > 1
    assert out.world_size == 4
    assert out.mesh is not None and any(r.cp > 1 for r in out.mesh.candidates)


# ----- CLI ---------------------------------------------------------------------------------


def _saved(tmp_path: Path, profile: Profile) -> str:
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


@pytest.mark.parametrize(
    ("profile", "flags", "words"),
    [
        ("dense", ["--context-parallel", "3"], "must divide half the sequence"),
        ("dense", ["--expert-parallel", "2"], "needs a mixture-of-experts model"),
        ("moe", ["--expert-parallel", "16"], "routed experts"),
    ],
)
def test_cli_refuses_bad_cp_and_ep_in_one_line(
    tmp_path: Path, profile: str, flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, long_profile(moe=profile == "moe"))
    assert main(["plan", saved, "--gpus", "12", "--batch-size", "16", "-q", *flags]) == 2
    assert words in _err_line(capsys)


def test_cli_refuses_a_degree_that_is_no_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, long_profile(moe=True))
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal, as for --tensor-parallel
        main(["plan", saved, "--gpus", "8", "-q", "--context-parallel", "0"])
    assert exc.value.code == 2
    assert "--context-parallel: expected a positive integer" in capsys.readouterr().err


def test_cli_plans_cp_and_ep_and_shows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    saved = _saved(tmp_path, long_profile(moe=True))
    argv = ["plan", saved, "--gpus", "8", "--context-parallel", "auto", "--expert-parallel",
            "auto", "--batch-size", "16", "--allreduce-bandwidth", "100GB/s", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("pp x dp x tp"))
    assert header.split()[5:8] == ["cp", "ep", "shard"]
    written = load_plan(out)
    assert written.request is not None and written.request.context_parallel == "auto"
    assert written.world_size == 8
    assert written.context_parallel >= 1 and written.expert_parallel >= 1


def test_cli_context_parallel_method_reaches_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--context-parallel-method all_gather`` is recorded in the plan's request and priced
    (its attention too small here to hide the ring's gather, the ring pays more: its K/V
    gradients travel in fp32, the all-gather method's reduce-scatter in the parameters'
    dtype); a method outside the two is refused naming the field."""
    saved = _saved(tmp_path, long_profile())
    steps = {}
    for method in ("ring", "ring_compiled", "all_gather"):
        out = tmp_path / f"{method}.json"
        argv = ["plan", saved, "--gpus", "8", "--context-parallel", "4", "--tensor-parallel",
                "1", "--batch-size", "16", "--inter-node-bandwidth", "1GB/s", "-q",
                "--allreduce-bandwidth", "100GB/s",
                "--gpus-per-node", "2", "--context-parallel-method", method, "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        written = load_plan(out)
        assert written.request is not None
        assert written.request.context_parallel_method == method
        steps[method] = written.iteration_time_s
    assert steps["all_gather"] < steps["ring"] < steps["ring_compiled"]
    with pytest.raises(RuleViolation, match="context_parallel_method"):
        PlanRequest(context_parallel_method="p2p")  # type: ignore[arg-type]


def test_auto_weighs_only_chunks_of_one_attention_tile_or_more() -> None:
    """``auto`` C: each of the 2C chunks holds at least 128 tokens; a fixed smaller C is
    still planned as asked. For DeepSeek-V3's 4096 tokens on 2048 GPUs: C <= 16."""
    p = dataclasses.replace(long_profile(), sequence_length=4096)
    cps, _ = context_expert_choices(p, 2048, "auto", 1)
    assert cps == [1, 2, 4, 8, 16]
    assert context_expert_choices(p, 2048, 64, 1)[0] == [64]


def test_the_depth_check_counts_the_devices_context_parallelism_takes() -> None:
    """C ranks split one sample's sequence, so they take devices as T does: a published
    TP x CP x PP x DP mesh (Llama 3 405B: TP8 x CP16 x PP16 x DP8) must not be refused for
    making more stages than the model has units. The check used to ignore C (that mesh was
    refused: '16384 GPUs make at least 256 pipeline stages')."""
    from autopipe.planner.mesh import refuse_too_deep

    p = long_profile()  # 6 units, attention over 2048 tokens
    n, batch = 6 * 2 * 16, 2  # PP 6 x D 2 x C 16 (T 1)
    with pytest.raises(RuleViolation, match="pipeline stages"):
        refuse_too_deep(p, n, batch, tensor_parallel=1, data_parallel=2)
    refuse_too_deep(p, n, batch, tensor_parallel=1, data_parallel=2, context_parallel=16)
    refuse_too_deep(p, n, batch, tensor_parallel=1, data_parallel=2, context_parallel="auto")
    with pytest.raises(RuleViolation, match=r"C=16: .* at most 192 GPUs"):
        refuse_too_deep(p, 2 * n, batch, tensor_parallel=1, data_parallel=2, context_parallel=16)


# ----- the expert shards' state and gradient sums, as the runtime holds them (#35) --------


def _ep2_d4(shard: str) -> tuple[Profile, Plan]:
    """long_profile's MoE model planned on 8 devices as PP2 x D4 x EP2 with ``shard``."""
    p = long_profile(moe=True)
    out = plan(
        p,
        PlanRequest(
            cluster=_cluster(8, None), batch_size=16, gpus_per_node=8, data_parallel=4,
            tensor_parallel=1, expert_parallel=2, shard=shard, optimizer="adam",
            microbatches=2,
        ),
    )  # fmt: skip
    assert (out.num_stages, out.data_parallel, out.expert_parallel) == (2, 4, 2)
    return p, out


def _stage_bytes(p: Profile, names: list[str], e: int) -> tuple[float, float]:
    """(dense, this rank's expert) parameter bytes of a stage's units: each MoE unit's 80,000
    routed-expert parameters (2 bytes each) split over the E ranks of the EP group."""
    units = {u.name: u for u in p.units}
    experts = sum(80_000 * 2 for x in names if units[x].moe_layers)
    return sum(units[x].parameter_bytes for x in names) - experts, experts / e


@pytest.mark.parametrize("shard", ["optimizer", "parameters", "gradients"])
def test_expert_state_priced_as_the_runtime_holds_it(shard: str) -> None:
    """ZeRO-1 (ExpertZeroOptimizer): a rank's experts keep their parameters and gradients
    and shard their optimizer state over the D / E = 2 ranks holding the same experts (1 / D
    of the stage's experts' state, not 1 / (E D)); FSDP2 (ignored_params) leaves the expert
    shards whole. The dense parameters shard over all D = 4 as before."""
    p, out = _ep2_d4(shard)
    d, e, size = 4, 2, 2
    state = out.state_bytes_per_parameter  # Adam: 2 + 2 + 12 per 2-byte parameter
    opt = state - 2 * size  # optimizer state per parameter
    for stage in out.stages:
        dense, expert = _stage_bytes(p, stage.units, e)
        if shard == "optimizer":
            params = dense + expert
            total = (
                dense * (2 * size + opt / d) / size + expert * (2 * size + opt / (d // e)) / size
            )
        elif shard == "gradients":
            params = dense + expert
            total = dense * (size + (size + opt) / d) / size + expert * state / size
        else:
            params = dense / d + expert
            total = dense * state / size / d + expert * state / size
        assert stage.parameter_bytes == pytest.approx(params, abs=4), stage.units
        assert stage.parameter_bytes + stage.optimizer_bytes == pytest.approx(total, abs=8), (
            stage.units
        )


def test_expert_gradients_are_summed_only_over_the_ranks_holding_them() -> None:
    """shard none, no overlap: each pipeline rank's all-reduce is the dense gradients over
    D = 4 and its expert shards over the D / E = 2 ranks holding the same experts (intra-node
    link, 1e11 B/s, no latency); with E = D none for the experts."""
    for e in (2, 4):
        p = long_profile(moe=True)
        out = plan(
            p,
            PlanRequest(
                cluster=_cluster(8, None), batch_size=16, gpus_per_node=8, data_parallel=4,
                tensor_parallel=1, expert_parallel=e, shard="none", microbatches=2,
                grad_reduce_overlap=False,
            ),
        )  # fmt: skip
        worst = 0.0
        for stage in out.stages:
            dense, expert = _stage_bytes(p, stage.units, e)
            ring = 2 * (3 / 4 * dense / 1e11)
            if e == 2:
                ring += 2 * (1 / 2 * expert / 1e11)
            worst = max(worst, ring)
        assert out.allreduce_s == pytest.approx(worst, rel=1e-9), e


def test_the_search_prices_every_mesh_with_its_own_groups_links() -> None:
    """The mesh search caches one CP/EP profile per link class; T = 1 and T = 2 with C = 8 on
    nodes of 4 both cross nodes but have 4 and 2 ranks a node, so 4 and 2 adapters: before,
    the cache keyed on crossing alone and served the first T's profile to the other."""
    from autopipe.planner import mesh as mesh_module
    from autopipe.planner.mesh import _MeshSearch
    from autopipe.planner.search import training_state

    p = long_profile()
    req = PlanRequest(
        cluster=Cluster([Device("gpu", 10**12, 1e12)] * 16), batch_size=16, gpus_per_node=4,
        inter_node_bandwidth_bytes_per_s=1e9, tensor_parallel="auto", data_parallel="auto",
        context_parallel="auto", expert_parallel="auto",
    )  # fmt: skip
    _, state_bpp = training_state(p, req.optimizer, req.bytes_per_parameter)
    template = req.cluster.devices[0]  # type: ignore[union-attr]
    topology = mesh_module._topology(req, 16, template)
    search = _MeshSearch(p, req, template, topology, 16, state_bpp)
    cands = mesh_candidates(p, 16, 16, gpus_per_node=4, context_parallel="auto")
    eights = [c for c in cands if c.cp == 8 and c.tp in (1, 2)]
    assert {c.tp for c in eights} == {1, 2}
    for c in sorted(cands, key=lambda c: -c.tp):
        fresh = context_expert_profile(p, c.cp, c.ep, c.tp, topology)
        got = search.context_of(c)
        assert [u.forward_s for u in got.units] == [u.forward_s for u in fresh.units], c
