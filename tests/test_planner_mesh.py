"""Planning the device mesh PP x D x T with sharded training state (torch-free planner parts).

The cost and memory terms against hand-computed numbers, the search against brute force over
the factorizations, the topology rules, old plans, and the CLI's refusals.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from autopipe.planner import PlanningError, RuleViolation, plan
from autopipe.planner.mesh import mesh_candidates
from autopipe.planner.mesh_costs import (
    Topology,
    device_profile,
    gather_buffer_bytes,
    ring_collective_s,
    sharded_state_bytes_per_parameter,
    transient_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_errors import _err_line

from autopipe.cli import main
from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan, StagePlan, load_plan
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest

GPT_MODEL = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")

TOPOLOGY = Topology(
    gpus_per_node=8, intra_bandwidth_bytes_per_s=1e11, inter_bandwidth_bytes_per_s=1e10
)


def tiny_profile(n_blocks: int = 4, *, seed: int = 0, heads: list[int] | None = None) -> Profile:
    """An embedding, ``n_blocks`` transformer-like blocks and a head, bf16 (2-byte) parameters,
    TP fields filled as the profiler fills them for a Llama (blocks split 0.99 of their
    weights, two TP regions of 1 MB each at the profile's batch 16)."""
    import random

    r = random.Random(seed)
    units = [
        UnitProfile(name="embed", forward_s=1e-4, backward_s=2e-4, parameter_count=1000,
                    parameter_bytes=2000, activation_bytes=0, output_bytes=1_000_000)
    ]  # fmt: skip
    for i in range(n_blocks):
        f = r.uniform(2e-3, 4e-3)
        units.append(
            UnitProfile(
                name=f"layers.{i}", forward_s=f, backward_s=2 * f, forward_overhead_s=1e-5,
                backward_overhead_s=2e-5, parameter_count=100_000, parameter_bytes=200_000,
                activation_bytes=r.randint(4_000_000, 8_000_000), output_bytes=1_000_000,
                tp_parameter_count=99_000, tp_compute_fraction=0.99, tp_collective_bytes=2_000_000,
            )
        )  # fmt: skip
    units.append(
        UnitProfile(name="head", forward_s=5e-4, backward_s=1e-3, parameter_count=50_000,
                    parameter_bytes=100_000, activation_bytes=2_000_000,
                    tp_parameter_count=50_000, tp_compute_fraction=1.0,
                    tp_collective_bytes=1_000_000)
    )  # fmt: skip
    return Profile(
        units=units,
        cut_bytes=[1_000_000] * (len(units) - 1),
        batch_size=16,
        device="gpu",
        dtype="bfloat16",
        bytes_per_parameter=2,
        tp_plan={"layers.*.q": "colwise", "layers.*.o": "rowwise", "head": "colwise"},
        tp_degrees=heads if heads is not None else [2, 4, 8],
    )


# ----- memory terms --------------------------------------------------------------------


def test_sharded_state_by_hand() -> None:
    # mixed-precision Adam, bf16 parameters: 2 (weight) + 2 (gradient) + 12 (fp32 state)
    assert sharded_state_bytes_per_parameter(16, 2, "none", 4) == 16
    assert sharded_state_bytes_per_parameter(16, 2, "optimizer", 4) == 2 + 2 + 12 / 4
    assert sharded_state_bytes_per_parameter(16, 2, "gradients", 4) == 2 + 14 / 4
    assert sharded_state_bytes_per_parameter(16, 2, "parameters", 4) == 16 / 4
    assert sharded_state_bytes_per_parameter(16, 2, "parameters", 1) == 16
    with pytest.raises(ValueError, match="shard"):
        sharded_state_bytes_per_parameter(16, 2, "everything", 4)


def test_device_profile_tp_terms_by_hand() -> None:
    p = tiny_profile()
    d = device_profile(p, 4, TOPOLOGY)
    block, dev = p.units[1], d.units[1]
    # parameters: 99,000 split four ways, 1,000 replicated, 2 bytes each
    assert dev.parameter_bytes == (1_000 + 99_000 / 4) * 2
    assert dev.parameter_count == block.parameter_count  # the model's own count, kept
    # compute: 0.99 of the size-dependent part runs 4x faster; the overhead does not shrink
    share = 1 - 0.99 + 0.99 / 4
    comm = 2 * (3 / 4) * 2_000_000 / 1e11  # all-gather + reduce-scatter over the T group
    assert dev.forward_s == pytest.approx(1e-5 + (block.forward_s - 1e-5) * share + comm)
    assert dev.backward_s == pytest.approx(2e-5 + (block.backward_s - 2e-5) * share + comm)
    # sequence parallelism shards the block's activations and the cuts between split units
    assert dev.activation_bytes == block.activation_bytes // 4
    assert d.cut_bytes[1] == 1_000_000 // 4  # layers.0 -> layers.1
    assert d.cut_bytes[0] == 1_000_000  # embed (not split) -> layers.0
    assert d.units[0] == p.units[0]  # the embedding has no TP share: unchanged
    assert device_profile(p, 1, TOPOLOGY) is p


def test_gather_buffers_and_prefetch_overlap_by_hand() -> None:
    p = tiny_profile()
    # the largest unit's per-device parameters, twice
    assert gather_buffer_bytes(p, 2, "parameters", 4) == 2 * (1_000 + 99_000 / 2) * 2
    assert gather_buffer_bytes(p, 2, "gradients", 4) == 0
    assert gather_buffer_bytes(p, 2, "parameters", 1) == 0
    slow = Topology(8, 1e11, 1e5)  # a gather of 200 kB over 16 ranks: 0.23 s, never hidden
    d = device_profile(p, 1, slow, shard="parameters", dp=16)  # 16 x 1 > 8: crosses nodes
    g = ring_collective_s(200_000, 16, 8 * 1e5)  # over the 8 adapters of its ranks in a node
    prev = p.units[1].forward_s  # layers.1's gather hides behind layers.0's forward
    assert d.units[2].forward_s == pytest.approx(p.units[2].forward_s + g - prev)
    assert d.units[2].forward_overhead_s == pytest.approx(p.units[2].forward_overhead_s + g - prev)
    # priced for micro-batches of 4 of the profile's 16: the previous unit hides less
    small = device_profile(p, 1, slow, shard="parameters", dp=16, microbatch_size=4)
    prev4 = 1e-5 + (p.units[1].forward_s - 1e-5) * 4 / 16
    assert small.units[2].forward_s == pytest.approx(p.units[2].forward_s + g - prev4)


def test_ring_collective_by_hand() -> None:
    assert ring_collective_s(1e9, 1, 1e9) == 0
    assert ring_collective_s(1e9, 4, 1e9) == pytest.approx(0.75)
    assert ring_collective_s(1e9, 4, 1e9, 1e-3) == pytest.approx(0.75 + 3e-3)


# ----- topology ------------------------------------------------------------------------


def test_links_follow_torchtitans_layout() -> None:
    t = Topology(8, 100.0, 10.0)
    assert not t.crosses_nodes(4, 2) and t.crosses_nodes(4, 4)
    assert t.collective_bandwidth_bytes_per_s(2, 4) == 100.0
    assert t.collective_bandwidth_bytes_per_s(8, 2) == 10.0
    # T D = 4: stages 0 and 1 share node 0, stage 1 -> 2 crosses into node 1
    assert t.pp_link(2, 2, 0) == (100.0, 0.0) and t.pp_link(2, 2, 1) == (10.0, 0.0)
    assert t.pp_link(8, 1, 0) == (10.0, 0.0)  # one stage per node


def test_a_dp_group_across_nodes_uses_every_adapter_its_ranks_have_there() -> None:
    """NCCL spreads a ring collective's channels over the network adapters of the group's
    ranks in each node (one per GPU on DGX-like nodes): D x T = 64 ranks over nodes of 8 reduce
    at 8 adapters' rate with T = 1, 4 with T = 2, 1 when T fills the node; NVLink caps it (the
    ring also crosses every rank's NVLink)."""
    t = Topology(8, 300.0, 25.0, 1e-6, 5e-6)
    bandwidth = t.collective_bandwidth_bytes_per_s
    assert bandwidth(1, 64) == 200.0  # 8 members per node
    assert bandwidth(2, 32) == 100.0
    assert bandwidth(4, 16) == 50.0
    assert bandwidth(8, 8) == 25.0  # one member per node: its own adapter
    assert bandwidth(1, 8) == 300.0  # inside one node
    assert Topology(8, 150.0, 25.0).collective_bandwidth_bytes_per_s(1, 64) == 150.0
    assert [t.members_per_node(tp, 64 // tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert [t.nodes_spanned(tp, 64 // tp) for tp in (1, 2, 4, 8)] == [8, 8, 8, 8]
    assert t.nodes_spanned(1, 8) == 1 and t.nodes_spanned(8, 1) == 1


def test_collective_latency_is_nccls_model_of_its_ring_and_tree() -> None:
    """NCCL's tuning model (src/graph/tuning.cc, Simple protocol): a ring all-gather of G ranks
    over N nodes pays its base latency, G - N NVLink hops and N - 1 network hops; before, every
    one of its G - 1 steps paid the network's hop. An all-reduce takes the faster of the ring
    (twice the steps, 1.4 times across nodes) and the tree (2 ((G/N - 1) NVLink + log2 N
    network hops), the buffer at 0.46 of the bus bandwidth)."""
    t = Topology(8, 300e9, 50e9, 3.4e-6, 14e-6, base_latency_s=8.4e-6)
    # 128 ranks, T = 1, over 16 nodes: 112 NVLink hops, 15 network hops
    assert t.ring_latency_s(1, 128) == pytest.approx(8.4e-6 + 112 * 3.4e-6 + 15 * 14e-6)
    assert t.ring_latency_s(1, 8) == pytest.approx(8.4e-6 + 7 * 3.4e-6)  # inside a node
    assert t.ring_latency_s(8, 16) == pytest.approx(8.4e-6 + 15 * 14e-6)  # one rank a node
    ring = t.ring_latency_s(1, 128, all_reduce=True)
    assert ring == pytest.approx(1.4 * (8.4e-6 + 2 * (112 * 3.4e-6 + 15 * 14e-6)))
    tree = 8.4e-6 + 2 * (7 * 3.4e-6 + 4 * 14e-6)
    # a small buffer: the tree's latency wins; a large one: the ring's bandwidth
    small, large = 1e6, 1e10
    assert t.all_reduce_s(small, 1, 128) == pytest.approx(small / (0.46 * 300e9) + tree)
    assert t.all_reduce_s(large, 1, 128) == pytest.approx(2 * 127 / 128 * large / 300e9 + ring)
    gather = 127 / 128 * large / 300e9 + t.ring_latency_s(1, 128)
    assert t.ring_s(large, 1, 128) == pytest.approx(gather)
    # inside a node NCCL's ring alone, and one rank nothing
    assert t.all_reduce_s(small, 1, 8) == pytest.approx(
        2 * 7 / 8 * small / 300e9 + 8.4e-6 + 14 * 3.4e-6
    )
    assert t.all_reduce_s(small, 1, 1) == 0.0 and t.ring_s(small, 1, 1) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    node=st.sampled_from([1, 2, 4, 8, 16]),
    nodes=st.integers(1, 8),
    degrees=st.lists(st.sampled_from([2, 3, 4, 6, 8, 16, 32]), unique=True),
)
def test_tp_groups_never_span_nodes(node: int, nodes: int, degrees: list[int]) -> None:
    p = tiny_profile(heads=sorted(degrees))
    n = node * nodes
    for c in mesh_candidates(p, n, 64, gpus_per_node=node):
        assert node % c.tp == 0  # T adjacent ranks inside one node
        assert c.pp * c.dp * c.tp == n and 64 % c.dp == 0
        assert c.tp == 1 or c.tp in degrees


# ----- the search ----------------------------------------------------------------------


def _cluster(n: int, memory: int | None) -> Cluster:
    return Cluster([Device("gpu", memory, 1.0, 1e11, 0.0) for _ in range(n)])


def _step(p: Profile, n: int, memory: int | None, **fixed: object) -> float:
    try:
        out = plan(
            p,
            PlanRequest(
                cluster=_cluster(n, memory),
                batch_size=32,
                gpus_per_node=4,
                inter_node_bandwidth_bytes_per_s=1e9,
                checkpoint="auto",
                **fixed,
            ),
        )
    except PlanningError:
        return math.inf
    return out.iteration_time_s


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([4, 8]),
    memory=st.sampled_from([None, 3_000_000, 6_000_000, 12_000_000]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
)
def test_auto_search_equals_brute_force_over_factorizations(
    seed: int, n: int, memory: int | None, schedule: str
) -> None:
    p = tiny_profile(n_blocks=5, seed=seed)
    auto = _step(p, n, memory, tensor_parallel="auto", data_parallel="auto", shard="auto",
                 schedule=schedule)  # fmt: skip
    every = [
        _step(p, n, memory, tensor_parallel=c.tp, data_parallel=c.dp, shard=c.shard,
              schedule=schedule)
        for c in mesh_candidates(p, n, 32, gpus_per_node=4)
        if c.pp <= len(p.units)
    ]  # fmt: skip
    best = min(every)
    if math.isinf(best):
        assert math.isinf(auto)
    else:
        assert auto == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize(("seed", "memory"), [(0, None), (1, 6_000_000)])
def test_auto_schedule_search_equals_brute_force_over_factorizations(
    seed: int, memory: int | None
) -> None:
    """Under ``schedule="auto"`` too (each mesh on the mesh runtime searching no zero-bubble
    schedule, :func:`autopipe.core.mesh_rules.mesh_schedules`): the auto mesh's step is the
    best of every mesh planned alone, 4 GPUs."""
    p = tiny_profile(n_blocks=5, seed=seed)
    auto = _step(p, 4, memory, tensor_parallel="auto", data_parallel="auto", shard="auto",
                 schedule="auto")  # fmt: skip
    every = [
        _step(p, 4, memory, tensor_parallel=c.tp, data_parallel=c.dp, shard=c.shard,
              schedule="auto")
        for c in mesh_candidates(p, 4, 32, gpus_per_node=4)
        if c.pp <= len(p.units)
    ]  # fmt: skip
    assert math.isfinite(auto) and auto == pytest.approx(min(every), rel=1e-12)


def test_mesh_plan_records_the_mesh_and_fits() -> None:
    p = tiny_profile(n_blocks=6)
    out = plan(
        p,
        PlanRequest(
            cluster=_cluster(8, 4_000_000),
            batch_size=32,
            tensor_parallel="auto",
            data_parallel="auto",
            shard="auto",
            gpus_per_node=8,
            checkpoint="auto",
        ),
    )
    assert out.world_size == 8 and out.mesh_shape == (
        out.num_stages,
        out.data_parallel,
        out.tensor_parallel,
    )
    assert out.tp_plan == (p.tp_plan if out.tensor_parallel > 1 else {})
    mesh = out.mesh
    assert mesh.peak_bytes <= 4_000_000 / 1.1
    rows = mesh.candidates
    assert rows[0].reason == "chosen" and rows[0].step_s == pytest.approx(out.iteration_time_s)
    steps = [r.step_s for r in rows if r.step_s is not None]
    assert steps == sorted(steps)
    assert all(r.reason for r in rows)
    assert out.throughput == pytest.approx(32 / out.iteration_time_s)
    again = Plan.from_dict(json.loads(json.dumps(out.to_dict())))
    assert (again.tensor_parallel, again.data_parallel, again.shard) == (
        out.tensor_parallel, out.data_parallel, out.shard,
    )  # fmt: skip


def test_transient_peak_by_hand() -> None:
    """The largest unit's transient above its saved activations (``peak_bytes -
    activation_bytes``, e.g. the loss's fp32 logits and their gradient), scaled to the
    micro-batch; a unit whose peak is below its saved bytes (or unrecorded) adds nothing."""
    p = tiny_profile(n_blocks=2)
    assert transient_bytes(p, 8) == 0
    p.units[-1].peak_bytes = 2_000_000 + 12_000_000  # head: saved 2 MB, +12 MB at the loss
    p.units[1].peak_bytes = 1  # below its saved bytes
    assert transient_bytes(p, 16) == 12_000_000
    assert transient_bytes(p, 4) == 3_000_000  # a quarter of the profile batch


def test_mesh_peak_counts_the_transient_and_refuses_what_it_overflows() -> None:
    """The transient is part of the mesh plan's peak, and a mesh that fits without it but
    not with it is refused (naming the transient peak), not reported as fitting."""
    p = tiny_profile(n_blocks=4)
    fixed = dict(batch_size=16, microbatches=1, tensor_parallel=1, data_parallel=2,
                 shard="none", gpus_per_node=8, checkpoint="never", headroom=0.0)  # fmt: skip
    base = plan(p, PlanRequest(cluster=_cluster(2, None), **fixed))  # type: ignore[arg-type]
    p.units[-1].peak_bytes = p.units[-1].activation_bytes + 5_000_000
    out = plan(p, PlanRequest(cluster=_cluster(2, None), **fixed))  # type: ignore[arg-type]
    assert base.mesh is not None and out.mesh is not None
    # 8 samples per replica, half the profile's batch of 16
    assert out.mesh.peak_bytes == base.mesh.peak_bytes + 2_500_000
    tight = base.mesh.peak_bytes + 1_000_000  # fits the saved bytes, not the transient
    with pytest.raises(PlanningError, match="transient"):
        plan(p, PlanRequest(cluster=_cluster(2, tight), **fixed))  # type: ignore[arg-type]


def test_sharding_makes_a_refused_job_fit() -> None:
    """The issue's case in small: no 8-stage pipeline fits; a mesh of the 8 devices does."""
    p = tiny_profile(n_blocks=6)
    memory = 2_500_000
    with pytest.raises(PlanningError):
        plan(p, PlanRequest(cluster=_cluster(8, memory), batch_size=32, checkpoint="auto"))
    out = plan(
        p,
        PlanRequest(
            cluster=_cluster(8, memory),
            batch_size=32,
            tensor_parallel="auto",
            data_parallel="auto",
            shard="auto",
            gpus_per_node=8,
            checkpoint="auto",
        ),
    )
    assert out.mesh.peak_bytes <= memory / 1.1
    assert out.tensor_parallel > 1 or out.shard != "none"


def test_bad_mesh_requests_are_rule_violations() -> None:
    p = tiny_profile(heads=[2, 4])
    kw = dict(gpus=8, batch_size=32, gpus_per_node=8)
    with pytest.raises(RuleViolation, match="does not divide the model's split"):
        plan(p, PlanRequest(tensor_parallel=8, **kw))
    with pytest.raises(RuleViolation, match="never spans nodes"):
        plan(
            p,
            PlanRequest(
                tensor_parallel=4,
                gpus=8,
                batch_size=32,
                gpus_per_node=2,
                inter_node_bandwidth_bytes_per_s=1e9,
            ),
        )
    with pytest.raises(RuleViolation, match="span nodes"):
        plan(p, PlanRequest(tensor_parallel=2, gpus=16, batch_size=32, gpus_per_node=8))
    plain = dataclasses.replace(p, tp_plan={}, tp_degrees=[], tp_note="no plan here")
    with pytest.raises(RuleViolation, match="no plan here"):
        plan(plain, PlanRequest(tensor_parallel=2, **kw))
    with pytest.raises(RuleViolation, match="global batch"):
        plan(p, PlanRequest(data_parallel=3, gpus=6, batch_size=32))


def test_old_plan_files_load_as_one_tp_rank_unsharded(tmp_path: Path) -> None:
    stage = StagePlan(index=0, device="cpu", units=["u0"])
    data = Plan(
        num_stages=1, microbatches=1, microbatch_size=4, batch_size=4, stages=[stage]
    ).to_dict()
    for key in ("tensor_parallel", "shard", "tp_plan"):
        del data[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_plan(path)
    assert (old.tensor_parallel, old.shard, old.tp_plan, old.mesh_shape) == (
        1,
        "none",
        {},
        (1, 1, 1),
    )


# ----- the CLI -------------------------------------------------------------------------


def _saved(tmp_path: Path, profile: Profile) -> str:
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tensor-parallel", "3"], "does not divide --gpus"),
        (["--tensor-parallel", "8", "--gpus-per-node", "4"], "never spans nodes"),
        (["--tensor-parallel", "16", "--device", "h100"], "never spans nodes"),
        (["--tensor-parallel", "8"], "does not divide the model's split"),
        (["--tensor-parallel", "2", "--gpus-per-node", "4"], "inter-node bandwidth"),
    ],
)
def test_cli_refuses_bad_mesh_flags_in_one_line(
    tmp_path: Path, flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, tiny_profile(heads=[2, 4]))
    assert main(["plan", saved, "--gpus", "8", "-q", *flags]) == 2
    assert words in _err_line(capsys)


def test_cli_refuses_tensor_parallel_without_a_tp_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autopipe.profiler.tensor_parallel import NO_PLAN_NOTE

    p = dataclasses.replace(tiny_profile(), tp_plan={}, tp_degrees=[], tp_note=NO_PLAN_NOTE)
    assert main(["plan", _saved(tmp_path, p), "--gpus", "4", "--tensor-parallel", "2", "-q"]) == 2
    assert "no tensor-parallel plan" in _err_line(capsys)


def test_cli_plans_the_mesh_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    saved = _saved(tmp_path, tiny_profile(n_blocks=6))
    argv = ["plan", saved, "--gpus", "8", "--tensor-parallel", "auto", "--memory", "4MB",
            "--batch-size", "32", "--allreduce-bandwidth", "100GB/s", "--json",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "mesh           pp " in text and "meshes, fastest first:" in text and "chosen" in text
    written = load_plan(out)
    assert written.world_size == 8
    assert written.request is not None and written.request.tensor_parallel == "auto"


def test_existing_data_parallel_flag_still_plans_k_by_d(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, tiny_profile(n_blocks=6))
    out = tmp_path / "plan.json"
    argv = ["plan", saved, "--gpus", "8", "--data-parallel", "2", "--allreduce-bandwidth",
            "10GB", "-q", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    written = load_plan(out)
    assert (written.num_stages, written.data_parallel, written.tensor_parallel) == (4, 2, 1)
    # one route for data parallelism: the mesh search with T = 1 and unsharded state
    assert written.mesh is not None and written.shard == "none"


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    microbatches=st.sampled_from(["auto", 4, 8]),
)
def test_every_meshs_bound_is_below_its_step(
    seed: int, schedule: str, microbatches: object
) -> None:
    """The proven bounds that order and prune the meshes (fill and drain included for GPipe
    and 1F1B) never exceed a searched mesh's step."""
    p = tiny_profile(n_blocks=7, seed=seed)
    every = [
        c
        for c in mesh_candidates(p, 8, 32, gpus_per_node=8)
        if c.pp <= len(p.units) and (c.tp, c.dp) != (1, 1)  # (8, 1, 1) is a plain pipeline
    ]
    for c in every:
        try:
            out = plan(
                p,
                PlanRequest(
                    cluster=_cluster(8, None),
                    batch_size=32,
                    tensor_parallel=c.tp,
                    data_parallel=c.dp,
                    shard=c.shard,
                    schedule=schedule,
                    microbatches=microbatches,
                ),
            )
        except (PlanningError, RuleViolation):
            continue
        row = out.mesh.candidates[0]
        assert row.lower_bound_s <= row.step_s * (1 + 1e-12)


def test_catalog_platforms_carry_their_inter_node_links() -> None:
    from autopipe.core.catalog import device_spec_from_dict, get_device

    h100 = get_device("h100")
    assert (h100.gpus_per_node, h100.inter_node_bandwidth_bytes_per_s) == (8, 50e9)  # NDR 400 Gb/s
    assert "dgxh100" in h100.inter_node_source and "NDR" in h100.inter_node_link_name
    assert get_device("a100").inter_node_bandwidth_bytes_per_s == 25e9  # HDR 200 Gb/s
    assert get_device("l4").inter_node_bandwidth_bytes_per_s == 0  # no one platform: unknown
    mine = device_spec_from_dict({"base": "h100", "name": "mine", "gpus_per_node": 4})
    assert (mine.gpus_per_node, mine.inter_node_bandwidth_bytes_per_s) == (4, 50e9)


def test_cli_takes_nodes_and_links_from_the_catalog(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = dataclasses.replace(tiny_profile(n_blocks=6), device="H100-SXM-80GB", mode="analytic")
    out = tmp_path / "plan.json"
    argv = ["plan", _saved(tmp_path, p), "--gpus", "16", "--shard", "auto", "--batch-size",
            "32", "-q", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    mesh = load_plan(out).mesh
    # NDR's 50 GB/s per GPU at NCCL's 48 (NCCL_NETWORK_EFFICIENCY); NVLink 4's 450 GB/s line
    # rate per direction at NCCL's 370 (NCCL_NVLINK_EFFICIENCY)
    assert mesh.gpus_per_node == 8
    assert mesh.inter_node_bandwidth_bytes_per_s == pytest.approx(48e9)
    assert mesh.intra_node_bandwidth_bytes_per_s == pytest.approx(370e9)
    l4 = dataclasses.replace(p, device="L4-24GB")
    assert main(["plan", _saved(tmp_path, l4), "--gpus", "16", "--shard", "auto", "-q"]) == 2
    assert "--inter-node-bandwidth" in _err_line(capsys)


def test_a_fully_sharded_plan_is_a_valid_plan_file(tmp_path: Path) -> None:
    """With ``parameters`` over D = 8 a device keeps 1/8 of its parameters: 2 of 16 bytes per
    parameter, so the stage's parameter bytes are 1/8 and the rest is gradient + state."""
    p = tiny_profile(n_blocks=6)
    out = plan(
        p,
        PlanRequest(gpus=8, batch_size=32, tensor_parallel=1, data_parallel=8, shard="parameters"),
    )
    assert out.mesh_shape == (1, 8, 1)
    stage = out.stages[0]
    whole = sum(u.parameter_bytes for u in p.units)
    assert stage.parameter_bytes == round(whole / 8)
    # 16 / 8 = 2 bytes per 2-byte parameter: the whole state is the parameters' size
    assert stage.parameter_bytes + stage.optimizer_bytes == pytest.approx(whole, rel=1e-6)
    out.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").shard == "parameters"


def test_cli_bandwidth_flags_tell_bits_from_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``--inter-node-bandwidth 400Gb`` planned with 400 GB/s (8x), and ``50GB/s``
    was refused although spec files take ``/s``."""
    p = dataclasses.replace(tiny_profile(n_blocks=6), device="H100-SXM-80GB", mode="analytic")
    saved = _saved(tmp_path, p)
    out = tmp_path / "plan.json"
    for rate in ("400Gb", "400Gbit/s", "50GB/s", "50GB"):
        argv = ["plan", saved, "--gpus", "16", "--shard", "auto", "--batch-size", "32",
                "--inter-node-bandwidth", rate, "--allreduce-bandwidth", "3.6Tb/s", "-q",
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0, rate
        mesh = load_plan(out).mesh
        # 400 Gb/s is the catalog's adapter line rate: priced at NCCL's share, 48 GB/s
        assert mesh.inter_node_bandwidth_bytes_per_s == pytest.approx(48e9), rate
        # 3.6 Tb/s is the H100's NVLink line rate: priced at NCCL's share of it, 370 GB/s
        assert mesh.intra_node_bandwidth_bytes_per_s == pytest.approx(370e9), rate
    argv = ["plan", saved, "--gpus", "16", "--shard", "auto", "--inter-node-bandwidth", "400gb"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ambiguous or unknown bandwidth unit 'gb'" in err


def test_a_mesh_on_measured_devices_needs_the_link_inside_a_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a measured profile's mesh priced its TP collectives and DP reductions at 0 s
    silently, while ``--data-parallel`` alone was refused for the missing bandwidth."""
    saved = _saved(tmp_path, tiny_profile(n_blocks=6))  # measured on "gpu": no link figure
    for flags in (
        ["--tensor-parallel", "2"],
        ["--shard", "auto"],
        [
            "--data-parallel",
            "2",
            "--tensor-parallel",
            "1",
            "--shard",
            "none",
            "--gpus-per-node",
            "8",
        ],
    ):
        assert main(["plan", saved, "--gpus", "8", "-q", *flags]) == 2, flags
        err = _err_line(capsys)
        assert "--allreduce-bandwidth" in err and "TP collectives and DP reductions" in err
    # The same request from a model file is refused before profiling, the same way.
    assert main(["plan", GPT_MODEL, "--gpus", "4", "--tensor-parallel", "2", "-q"]) == 2
    assert "--allreduce-bandwidth" in _err_line(capsys)
    out = tmp_path / "plan.json"
    argv = ["plan", saved, "--gpus", "8", "--tensor-parallel", "2", "--allreduce-bandwidth",
            "10GB/s", "--batch-size", "32", "-q", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    written = load_plan(out)
    assert written.mesh.intra_node_bandwidth_bytes_per_s == 10e9
    # T = D = 1 runs no collective: nothing to price, nothing asked.
    argv = ["plan", saved, "--gpus", "8", "--tensor-parallel", "1", "--data-parallel", "1", "-q"]
    assert main(argv) == 0


def test_no_mesh_fits_names_only_what_the_request_has_not_tried() -> None:
    """Before, the hint said ``--checkpoint auto`` and ``--shard parameters`` when the
    request was already auto on both."""
    p = tiny_profile(n_blocks=6)
    kw = {"gpus": 4, "batch_size": 16, "memory_per_device": 100_000, "tensor_parallel": 1}
    with pytest.raises(PlanningError) as info:
        plan(p, PlanRequest(shard="auto", checkpoint="auto", schedule="auto", **kw))
    text = str(info.value)
    assert "try more GPUs" in text and "\n" not in text
    assert "--checkpoint" not in text and "--shard" not in text and "--schedule" not in text
    with pytest.raises(PlanningError) as info:
        plan(
            p, PlanRequest(shard="none", checkpoint="never", microbatches=4, data_parallel=2, **kw)
        )
    text = str(info.value)
    for hint in ("--shard parameters", "--checkpoint auto", "--schedule 1f1b or auto",
                 "--microbatches auto"):  # fmt: skip
        assert hint in text


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_mesh_plan_prices_the_framework_defaults_on_its_mesh(schedule: str) -> None:
    """A mesh plan carries each framework default's split priced on the same mesh (pp x dp x
    tp, shard, M, device profile), its exposed DP communication added; none beats the plan
    at the plan's own schedule (autopipe's cut is optimal for it), and explain prints them."""
    from autopipe.core.vocabulary import FRAMEWORK_DEFAULTS
    from autopipe.explain import explain

    p = tiny_profile(n_blocks=6)
    out = plan(
        p,
        PlanRequest(
            cluster=_cluster(8, None), batch_size=32, tensor_parallel=2, data_parallel=2,
            shard="parameters", schedule=schedule,  # type: ignore[arg-type]
        ),
    )  # fmt: skip
    assert out.mesh_shape == (2, 2, 2)
    assert set(out.baselines) == set(FRAMEWORK_DEFAULTS)
    priced = [b for b in out.baselines.values() if b["iteration_time_s"] is not None]
    assert priced
    for b in priced:
        assert b["dp_comm_s"] > 0  # D = 2 reduces each cut's gradients
        assert b["iteration_time_s"] == pytest.approx(
            b["pipeline_iteration_s"] + b["dp_comm_s"] + b["optimizer_s"]
        )
        assert sum(b["balance"]) == len(p.units)
        if b["schedule"] == out.schedule and b["virtual_stages"] == out.virtual_stages:
            assert b["pipeline_iteration_s"] >= out.pipeline_iteration_s * (1 - 1e-9)
    text = explain(out)
    assert "same mesh pp 2 x dp 2 x tp 2" in text
    assert "torchtitan" in text and "DeepSpeed" in text


def test_a_framework_row_faster_by_its_dp_communication_gets_a_note() -> None:
    """A framework row at the plan's own schedule that is faster per step can only be so by
    exposing less DP communication: the note says that, not "another schedule"."""
    from autopipe.core.plantext import advice_notes

    out = plan(
        tiny_profile(n_blocks=6),
        PlanRequest(
            cluster=_cluster(8, None), batch_size=32, tensor_parallel=2, data_parallel=2,
            shard="parameters", schedule="1f1b",
        ),
    )  # fmt: skip
    assert not [n for n in advice_notes(out) if "faster than this plan" in n]
    row = out.baselines["torchtitan-even"]
    row["dp_comm_s"] = 0.0
    row["iteration_time_s"] = row["pipeline_iteration_s"] = out.iteration_time_s * 0.9
    notes = [n for n in advice_notes(out) if "faster than this plan" in n]
    assert len(notes) == 1 and "DP communication" in notes[0]
    assert "another schedule" not in notes[0] and "--schedule auto" not in notes[0]


def test_cli_explain_prints_a_mesh_plans_framework_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autopipe plan`` with mesh flags, then ``autopipe explain`` on the saved plan: the
    framework rows (priced on the mesh) are in both outputs."""
    out = tmp_path / "plan.json"
    saved = _saved(tmp_path, tiny_profile(n_blocks=6))
    argv = ["plan", saved, "--gpus", "8", "--tensor-parallel", "2", "--data-parallel", "2",
            "--batch-size", "32", "--schedule", "1f1b", "--allreduce-bandwidth", "100GB/s",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "framework defaults on the same mesh" in capsys.readouterr().out
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(same mesh pp 2 x dp 2 x tp 2, DP communication included)" in text
    assert "torchtitan 0.2.2 (even split) [1f1b, V=1]" in text


RUNS_ON_A_MESH = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")
"""The schedules ``autopipe run`` runs on the mesh runtime: none that splits the backward."""


@pytest.mark.parametrize(
    "mesh",
    [{"tensor_parallel": 2}, {"data_parallel": 2, "shard": "parameters"}],
    ids=["tp2", "zero3"],
)
def test_an_auto_schedule_on_a_mesh_never_splits_the_backward(mesh: dict[str, object]) -> None:
    """``schedule="auto"`` on a mesh ``autopipe run`` runs on its mesh runtime (T > 1,
    sharded state) picks none of the zero-bubble schedules its ``check_mesh_plan`` refuses
    (it picked interleaved-zb for seeds 0 and 2, with a note that run refuses it: #36 audit,
    the README's 70B mesh under auto); a plain pp x dp mesh (the K x D path, which runs
    them) still picks one."""
    from autopipe.core.mesh_rules import mesh_schedules, uses_mesh

    for seed in (0, 2):
        p = tiny_profile(n_blocks=6, seed=seed)
        base = PlanRequest(gpus=4, batch_size=16, schedule="auto", baselines=False)
        out = plan(p, dataclasses.replace(base, **mesh))  # type: ignore[arg-type]
        assert uses_mesh(out) and out.schedule in RUNS_ON_A_MESH == mesh_schedules(out)
        assert out.schedule in ("looped-bfs", "interleaved-1f1b")  # the next fastest
        plain = plan(p, dataclasses.replace(base, data_parallel=2))
        assert not uses_mesh(plain) and plain.schedule == "interleaved-zb"


def test_a_named_zero_bubble_schedule_on_a_mesh_is_refused_naming_those_that_run() -> None:
    """A zero-bubble schedule named for a mesh ``autopipe run`` would refuse it on is bad
    input, refused in one line naming the schedules that run there, as a parameter tied
    across FSDP-sharded chunks is (the planner plans what run runs); with the mesh left to
    the search, only the meshes that run it (T = 1, no sharding) are searched, the others'
    rows saying why."""
    p = tiny_profile(n_blocks=6)
    with pytest.raises(RuleViolation) as exc:
        plan(p, PlanRequest(gpus=4, tensor_parallel=2, batch_size=16, schedule="zbv"))
    assert str(exc.value) == (
        "mesh-schedule: zbv splits the weight pass, which autopipe run does not combine "
        "with TP, sharded state, context or expert parallelism; use --schedule auto or one "
        "it runs on this mesh: gpipe, 1f1b, interleaved-1f1b, looped-bfs"
    )
    out = plan(p, PlanRequest(gpus=4, batch_size=16, schedule="zbv", baselines=False,
                              tensor_parallel="auto", data_parallel="auto", shard="auto"))  # fmt: skip
    assert out.schedule == "zbv" and (out.tensor_parallel, out.shard) == (1, "none")
    assert out.mesh is not None
    refused = [r for r in out.mesh.candidates if r.reason.startswith("mesh-schedule: zbv")]
    assert {(r.tp > 1 or r.shard != "none") for r in refused} == {True}
    # 15 meshes of 4 GPUs (T 1, 2, 4 x D x shard): 12 use the mesh runtime
    assert len(refused) == 12 and not any(r.searched for r in refused)
    others = [r for r in out.mesh.candidates if r not in refused]
    assert [(r.tp, r.shard) for r in others] == [(1, "none")] * 3


def test_cli_plans_no_zero_bubble_schedule_on_a_tp_mesh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autopipe plan --schedule auto`` on a TP mesh writes a schedule ``autopipe run``
    runs there; ``--schedule interleaved-zb`` on it exits 2 with the rule's one line."""
    saved = _saved(tmp_path, tiny_profile(n_blocks=6))
    out = tmp_path / "plan.json"
    argv = ["plan", saved, "--gpus", "4", "--tensor-parallel", "2", "--data-parallel", "1",
            "--batch-size", "16", "--allreduce-bandwidth", "100GB/s"]  # fmt: skip
    assert main([*argv, "--schedule", "auto", "--json", str(out)]) == 0
    capsys.readouterr()
    assert load_plan(out).schedule == "looped-bfs"  # interleaved-zb before the rule
    assert main([*argv, "--schedule", "interleaved-zb"]) == 2
    line = _err_line(capsys)
    assert "mesh-schedule: interleaved-zb splits the weight pass" in line
    assert line.endswith("on this mesh: gpipe, 1f1b, interleaved-1f1b, looped-bfs")
