"""Context parallelism (runtime/distributed/context_parallel.py), the parts that run on the
CPU: torch 2.13's ring attention needs the CUDA SDPA kernels (the CPU's
``aten._scaled_dot_product_flash_attention_for_cpu`` has no DTensor sharding strategy, checked
below), so the ring itself runs only on GPUs (benchmarks/gpu_check.py); on the CPU the step
runs with k and v gathered by DTensor (``gathered_attention``). Here: the ``(pp, dp, cp, tp)``
mesh and its groups, torch's load-balanced split of ids, positions and shifted labels, the
attention rewrite of a traced Hugging Face Llama, the loss of the split sequence, and the
one-line refusals, with a fake process group standing in for the ranks (no collective runs:
torch shards the buffers locally); then one torchrun launch training the CP meshes
(:data:`CASES`) against one process."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from autopipe.runtime.distributed.context_parallel import (
    CPU_ATTENTION_KERNEL,
    AttentionMaskError,
    build_context_mesh,
    causal_attention,
    context_batch,
    context_rank_of,
    gradient_mesh,
    length_problem,
    local_sequence_inputs,
    positions_problem,
    route_attention,
    sequence_buffers,
    sharded_step,
    shifted_token_loss,
)

sys.path.insert(0, str(Path(__file__).parent))
import mesh_zoo_models as zoo  # noqa: E402


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _plan(k: int = 2, d: int = 2, c: int = 2, t: int = 1, shard: str = "none") -> Any:
    return SimpleNamespace(
        num_stages=k,
        data_parallel=d,
        context_parallel=c,
        tensor_parallel=t,
        shard=shard,
        world_size=k * d * c * t,
        expert_parallel=1,
    )


def test_mesh_is_pp_dp_cp_tp_and_gradients_sum_over_dp_x_cp() -> None:
    plan = _plan(k=2, d=2, c=2)  # 8 ranks: rank = (pp * 2 + dp) * 2 + cp
    for rank in (0, 5, 6):
        with fake_world(rank, 8):
            mesh = build_context_mesh(plan, "cpu")
            flat = gradient_mesh(mesh)
            assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
            pp, dp, cp, tp = context_rank_of(rank, (2, 2, 2, 1))
            assert [mesh[n].get_local_rank() for n in ("pp", "dp", "cp", "tp")] == [pp, dp, cp, tp]

            groups = {n: mesh[n].get_group() for n in ("pp", "dp", "cp")}
            groups["dp_cp"] = flat.get_group()
            ranks = {n: sorted(dist.get_process_group_ranks(g)) for n, g in groups.items()}

            base = pp * 4
            assert ranks["cp"] == [base + dp * 2, base + dp * 2 + 1]
            assert ranks["dp"] == [base + cp, base + 2 + cp]
            assert ranks["dp_cp"] == [base, base + 1, base + 2, base + 3]
            assert ranks["pp"] == [rank % 4, rank % 4 + 4]
    assert context_rank_of(5, (2, 2, 2, 1)) == (1, 0, 1, 0)


def test_expert_mesh_with_tp_and_cp_carves_ep_out_of_dp_x_cp_beside_tp() -> None:
    """EP x TP x CP: the 2-D ``(ep, tp)`` mesh of each rank is E consecutive ranks of its
    dp x cp group (the TP position fixed) by its TP group; the ranks holding the same experts
    (same EP position, other EP groups) sum their gradients. 8 ranks: D 2 x C 2 x T 2, rank
    = dp * 4 + cp * 2 + tp; and EP x TP without CP on D 4 x T 2 (rank = dp * 2 + tp), whose
    EP groups are the same ranks."""
    from autopipe.runtime.distributed.mesh import expert_mesh
    from torch.distributed.device_mesh import init_device_mesh

    for rank in (0, 3, 6):
        group, position, tp = rank // 4, rank // 2 % 2, rank % 2  # EP group, EP rank
        for with_cp in (True, False):
            with fake_world(rank, 8):
                if with_cp:
                    mesh = build_context_mesh(_plan(k=1, d=2, c=2, t=2), "cpu")
                    flat = gradient_mesh(mesh)
                else:
                    mesh = init_device_mesh("cpu", (1, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
                    flat = mesh["dp"]
                ep, replicas = expert_mesh(mesh, flat, 2, with_tp=True)  # E 2
                first = 4 * group
                assert ep.mesh.tolist() == [[first, first + 1], [first + 2, first + 3]]
                assert ep.mesh_dim_names == ("ep", "tp") and ep.get_local_rank(0) == position
                ep_ranks = dist.get_process_group_ranks(ep.get_group(0))
                assert sorted(ep_ranks) == [first + tp, first + 2 + tp]
                tp_ranks = dist.get_process_group_ranks(ep["tp"].get_group())
                assert sorted(tp_ranks) == [rank - tp, rank - tp + 1]
                holders = dist.get_process_group_ranks(replicas.get_group())
                assert sorted(holders) == [position * 2 + tp, 4 + position * 2 + tp]
                whole, none = expert_mesh(mesh, flat, 4, with_tp=True)  # E 4: all of dp x cp
                assert none is None and whole.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
                assert whole.get_local_rank(0) == rank // 2


def test_load_balanced_split_keeps_ids_positions_and_shifted_labels_together() -> None:
    # C = 2, s = 8: torch's head-tail balancer gives rank r chunks r and 2C - 1 - r of 2.
    ids = torch.arange(100, 116).reshape(2, 8)
    given = {"input_ids": ids, "labels": ids.clone()}
    assert set(context_batch(given, positions=True, shift=True)) == {"input_ids", "position_ids"}
    batch = context_batch(given, positions=True, shift=True, target=True)
    assert set(batch) == {"input_ids", "position_ids", "shift_labels"}
    assert batch["shift_labels"][0].tolist() == [101, 102, 103, 104, 105, 106, 107, -100]
    for rank, positions in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        with fake_world(rank, 2):
            mesh = build_context_mesh(_plan(k=1, d=1, c=2), "cpu")
            own = {k: v.clone() for k, v in batch.items()}
            buffers = sequence_buffers([own], 8)
            assert len(buffers) == 3
            with sharded_step(mesh["cp"], buffers, "cuda"):
                got = {k: v.clone() for k, v in own.items()}
        assert got["position_ids"].tolist() == [positions, positions]
        where = torch.tensor(positions)
        assert torch.equal(got["input_ids"], ids[:, where])
        after = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        assert torch.equal(got["shift_labels"], after[:, where])
    assert torch.equal(batch["input_ids"], ids)  # the caller's batch untouched


def test_cpu_sdpa_is_what_torchs_ring_attention_cannot_shard() -> None:
    # Why the CPU runs gathered attention instead of the ring: torch fails on this kernel.
    with fake_world(0, 2):
        mesh = build_context_mesh(_plan(k=1, d=1, c=2), "cpu")
        q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
        with pytest.raises(NotImplementedError, match=CPU_ATTENTION_KERNEL.replace("aten.", "")):
            with sharded_step(mesh["cp"], [q, k, v], "cuda", seq_dims=[2] * 3):  # the ring path
                causal_attention(q, k, v)


def test_sequence_length_must_split_into_head_and_tail_chunks() -> None:
    assert length_problem(8, 2) is None
    why = length_problem(6, 2)
    assert why is not None and "multiple of 4" in why and "\n" not in why


def _llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = zoo.build("llama")
    model.config._attn_implementation = "sdpa"
    return model, zoo.example_inputs("llama", 2)


def test_route_attention_turns_the_traced_causal_mask_into_is_causal() -> None:
    from autopipe.profiler.units import trace_units

    model, inputs = _llama()
    batch = local_sequence_inputs(context_batch(inputs, positions=True, shift=False), 2)
    assert batch["input_ids"].shape == (2, zoo.SEQ // 2) and "position_ids" in batch
    graph = trace_units(model, batch)
    assert graph.binder is not None
    flat = graph.binder.flat(batch)
    before = torch.fx.Interpreter(graph.graph_module).run(*flat)
    renamed = route_attention(graph.graph_module, flat)
    assert len(renamed) == 2  # one attention per layer
    nodes = list(graph.graph_module.graph.nodes)
    assert sum(n.target is causal_attention for n in nodes) == 2
    assert not any("scaled_dot_product" in str(n.target) for n in nodes)
    after = torch.fx.Interpreter(graph.graph_module).run(*flat)
    want = model(**batch).logits
    leaves = [t for t in torch.utils._pytree.tree_leaves(after) if isinstance(t, torch.Tensor)]
    assert torch.allclose(leaves[0], want, rtol=1e-5, atol=1e-6)
    first = [t for t in torch.utils._pytree.tree_leaves(before) if isinstance(t, torch.Tensor)]
    assert torch.allclose(first[0], want, rtol=1e-5, atol=1e-6)


def test_route_attention_refuses_a_padding_mask() -> None:
    from autopipe.profiler.units import trace_units

    model, inputs = _llama()
    batch = local_sequence_inputs(context_batch(inputs, positions=True, shift=False), 2)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    graph = trace_units(model, batch)
    assert graph.binder is not None
    with pytest.raises(AttentionMaskError, match="reads the input attention_mask"):
        route_attention(graph.graph_module, graph.binder.flat(batch))
    packed = {"position_ids": torch.tensor([[0, 1, 0, 1]])}
    why = positions_problem(packed)
    assert why is not None and "packed" in why and "\n" not in why
    assert positions_problem(context_batch(inputs, positions=True, shift=False)) is None


def test_the_split_sequences_loss_is_the_models_own() -> None:
    # Each CP rank's (sum, count) over its load-balanced share; summed over the ranks and
    # divided, the model's own causal-LM loss of the whole sequence.
    model, inputs = _llama()
    labels = inputs["input_ids"].clone()
    labels[0, 3] = -100  # an ignored label counts nowhere
    want = model(input_ids=inputs["input_ids"], labels=labels).loss
    logits = model(input_ids=inputs["input_ids"]).logits
    batch = context_batch({**inputs, "labels": labels}, positions=True, shift=True, target=True)
    total, count = torch.zeros(()), 0.0
    for positions in ([0, 1, 6, 7], [2, 3, 4, 5]):
        where = torch.tensor(positions)
        share = {"shift_labels": batch["shift_labels"][:, where]}
        s, n = shifted_token_loss(SimpleNamespace(logits=logits[:, where]), share)
        total, count = total + s, count + n
    assert count == 2 * (zoo.SEQ - 1) - 1
    assert torch.allclose(total / count, want, rtol=1e-5, atol=1e-6)


def test_a_cp_plan_is_refused_in_one_line_only_for_its_world_size() -> None:
    from autopipe.runtime.distributed.mesh import mesh_size_problem

    plan = _plan(k=2, d=1, c=2)
    assert mesh_size_problem(plan, 4) is None
    why = mesh_size_problem(plan, 2)
    assert why is not None and "cp 2" in why and "= 4 processes" in why and "\n" not in why
    ep = _plan(k=2, d=1, c=2)
    ep.expert_parallel = 2  # carved out of dp x cp: runs (the launch test's pp2cp2ep2)
    assert mesh_size_problem(ep, 4) is None


CASES = [
    "llama:pp2cp2",
    "llama:cp2d2",
    "llama:cp2d2zero1",
    "llama:cp2fsdp2",
    "llama:cp2tp2",
    "llama_ids:pp2cp2",
    "mixtral:pp2cp2ep2",
    "mixtral:cp2tp2ep2",
    "mixtral:cp2d2ep2zero1",
]
"""CP2 x PP2, CP2 x D2 (plain and ZeRO-1: the optimizer state sharded over the 4 ranks of
dp x cp, which hold the same parameters), CP2 x FSDP2 (parameters sharded over dp x cp) and
CP2 x TP2 (heads
split by TP, the CP rank's sequence share by sequence parallelism) of the zoo's Hugging Face
Llama with labels (its own loss), and CP2 x PP2 without (the default objective), in one
torchrun launch; SGD and AdamW. CP and EP together on a Hugging Face Mixtral (EP carved out
of the dp x cp ranks): PP 2 x CP 2 x EP 2, CP 2 x TP 2 x EP 2 (the fewest ranks running
all three: each TP rank's CP pair an EP group, every expert's FFN split over the TP pair), and
CP 2 x D 2 x EP 2 with ZeRO-1."""


def test_cp2_meshes_train_like_one_process(tmp_path: Path) -> None:
    import json
    import os
    import subprocess

    from distributed_cases import free_port

    run = Path(__file__).parent / "context_parallel_run.py"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(free_port()), str(run), str(tmp_path), *CASES,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "AUTOPIPE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=900, env=env
    )
    results = {}
    for case in CASES:
        path = tmp_path / f"{case.replace(':', '-')}.json"
        assert path.exists(), (done.stdout + done.stderr)[-3000:]
        results[case] = json.loads(path.read_text())
    print(
        "\ncontext parallelism: "
        + "; ".join(
            f"{case} {o} max rel {r[o]['max_relative']:.2g}"
            for case, r in results.items()
            for o in ("sgd", "adamw")
            if o in r
        )
    )
    for case, result in results.items():
        assert result["outcome"] == "equal", (case, result.get("reason"), result.get("trace"))
        assert result["plan"]["context_parallel"] == 2, case
        for optimizer in ("sgd", "adamw"):
            assert result[optimizer]["wrong"] == [] and result[optimizer]["parameters"] > 0
            assert result[optimizer]["max_relative"] < 1e-4, (case, optimizer)
    pp2cp2 = results["llama:pp2cp2"]["plan"]
    assert len(pp2cp2["stages"]) == 2  # two pipeline stages, each split over 2 CP ranks
    assert results["llama:cp2tp2"]["plan"]["mesh"] == [1, 1, 2]  # (pp, dp, tp) = 1, 1, 2
    # Each rank spread its stage's MoE layers over its CP pair (Mixtral: 2, one per stage)
    assert results["mixtral:pp2cp2ep2"]["expert_parallel_modules"] == [1, 1, 1, 1]
    assert results["mixtral:cp2d2ep2zero1"]["expert_parallel_modules"] == [2, 2, 2, 2]
    # EP x TP x CP: each rank holds 2 of the 4 experts of both MoE layers, each expert's
    # FFN halved by TP (Mixtral's I = 64: gate_up [2, 2 I / 2, H], down [2, H, I / 2]), and
    # the checkpoint holds them whole as the model names and lays them out
    three = results["mixtral:cp2tp2ep2"]
    assert three["plan"]["mesh"] == [1, 1, 2] and three["plan"]["expert_parallel"] == 2
    assert three["expert_parallel_modules"] == [2, 2, 2, 2]
    want = {
        f"chunks.0.body.model.layers.{i}.mlp.experts.{name}": shape
        for i in (0, 1)
        for name, shape in (("gate_up_proj", [2, 64, 32]), ("down_proj", [2, 32, 32]))
    }
    assert three["expert_shapes"] == [want] * 4
    assert three["checkpoint_experts"] == [4] * 4 and three["checkpoint_wrong"] == [[]] * 4
    assert "ExpertZeroOptimizer" in results["mixtral:cp2d2ep2zero1"]["adamw"]["optimizer_class"]
    zero1 = results["llama:cp2d2zero1"]
    assert zero1["plan"]["shard"] == "optimizer"
    assert zero1["adamw"]["optimizer_class"] == ["ZeroRedundancyOptimizer"]
