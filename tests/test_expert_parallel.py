"""Expert parallelism and expert TP in `autopipe run` (runtime/distributed/expert_parallel.py).

The launch test plans and trains Mixtral, Qwen3-MoE and DeepSeek-V3 tiny configs
(tests/mesh_zoo_models.py) with EP 2, with TP 2 splitting each expert's FFN, and with both,
on 4 gloo processes, all cases in one torchrun launch of the mesh zoo's runner
(tests/mesh_zoo_run.py ``EXPERT_MESHES``), compares every parameter after 3 SGD and 3 AdamW
steps with one process trained on the same global batch (the update over lr, rtol 1e-4 /
atol 1e-5, in float64) and checks each rank's local expert shapes. The other tests run in
this process: the rewrite of an inlined experts region into one call, the dispatch on a
one-rank group against the model's own experts, the TP slices' sum against the experts'
own output, and the one-line refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_zoo_models  # noqa: E402
from test_mesh_zoo import run_cases  # noqa: E402

from autopipe.core.plan import Plan, load_plan  # noqa: E402

CASES = [
    "mixtral:pp2ep2",
    "qwen3_moe:pp2ep2",
    "deepseek_v3:pp2ep2",
    "qwen3_moe:pp2ep2fsdp",
    "mixtral:pp2ep2remat",
    "mixtral:d4ep2",
    "deepseek_v3:pp2ep2zero1",
    "mixtral:d4ep2zero1",
]
"""EP 2 x PP 2 (each rank holds half of each MoE layer's experts) for the three families,
with FSDP2 on the other parameters, with every stage re-materialized, and D 4 x EP 2 (two EP
groups per stage), and DeepSeek-V3's published kind of mesh (PP x EP x ZeRO-1 DP) as
PP 2 x EP 2 = D 2 and D 4 x EP 2 with ZeRO-1 (:class:`ExpertZeroOptimizer`)."""
EXPERT_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 1}
"""MoE layers of each tiny config (DeepSeek-V3's first layer is dense)."""
TP_CASES = {
    "mixtral:pp2tp2": ([[0], [0], [1], [1]], 4),
    "qwen3_moe:tp2fsdp2": ([[0, 1]] * 4, 2),
    "deepseek_v3:pp2v2tp2": ([[1], [1], [], []], 4),
    "mixtral:d2ep2tp2": ([[0, 1]] * 4, 2),
    "deepseek_v3:d2ep2tp2": ([[1]] * 4, 2),
    "qwen3_moe:d2ep2tp2fsdp": ([[0, 1]] * 4, 2),
    "mixtral:d2ep2tp2zero1": ([[0, 1]] * 4, 2),
}
"""Expert TP (each TP rank a slice of every expert's FFN; the mesh zoo runs every MoE family
on every TP mesh, three of them in this file's launch too) and EP 2 x TP 2 (each rank half
the experts, each sliced) -> (the MoE layers each rank holds, the experts it holds of each:
4, or 2 under EP or under FSDP2, which shards dim 0 over D = 2), and EP 2 x TP 2 with ZeRO-1
(the TP-split dense parameters' optimizer state sharded over D on their local tensors,
``LocalZeroOptimizer``). PP 2 cuts Mixtral after
layer 0; DeepSeek-V3's interleaved chunks put its one MoE layer (layer 1) on ranks 0, 1."""
SLICES = {"mixtral": 64, "qwen3_moe": 32, "deepseek_v3": 32}
"""Each family's expert intermediate size I: ``gate_up_proj`` is ``[E, 2 I, H]``."""


@pytest.mark.slow
def test_expert_parallel_training_equals_one_process(tmp_path: Path) -> None:
    """EP, expert TP and EP x TP training (one launch) equals one process; expert TP holds
    each expert's weights split: ``gate_up_proj`` ``[E, 2 I / T, H]`` and ``down_proj``
    ``[E, H, I / T]`` on every rank (E halved by EP, or by FSDP2 on the TP-only meshes)."""
    results, wall_s = run_cases(tmp_path, CASES + list(TP_CASES))
    lines = [
        f"{case}: {r['outcome']} {r.get('reason') or ''} "
        + " ".join(f"{o} max rel {r[o]['max_relative']:.2g}" for o in ("sgd", "adamw") if o in r)
        for case, r in results.items()
    ]
    print(
        f"\nexpert parallelism and expert TP: {len(results)} cases in {wall_s:.0f} s\n"
        + "\n".join(lines)
    )
    for case, (layers, experts) in TP_CASES.items():
        r = results[case]
        assert r["outcome"] == "equal", (case, r.get("reason"), r.get("trace"))
        family = case.split(":")[0]
        half = SLICES[family] // 2
        for rank, held in enumerate(layers):
            want = {}
            for i in held:
                path = f"model.layers.{i}.mlp.experts"
                want[f"{path}.gate_up_proj"] = [experts, 2 * half, 32]
                want[f"{path}.down_proj"] = [experts, 32, half]
            got = {
                name.split(".body.")[1]: shape for name, shape in r["expert_shapes"][rank].items()
            }
            assert got == want, (case, rank)
        # autopipe's checkpoint holds every rank's experts as the model names and lays them
        # out, equal to the trained ones gathered whole
        assert r["checkpoint_experts"] == [2 * len(held) for held in layers], case
        assert r["checkpoint_wrong"] == [[]] * 4, case
        for optimizer in ("sgd", "adamw"):
            assert r[optimizer]["max_relative"] < 1e-4, (case, optimizer)
            if case.endswith("zero1"):
                assert r[optimizer]["optimizer_class"] == ["ExpertZeroOptimizer"], case
    for case in CASES:
        r = results[case]
        assert r["outcome"] == "equal", (case, r.get("reason"), r.get("trace"))
        family, mesh = case.split(":")
        assert r["plan"]["expert_parallel"] == 2
        # Every rank spread the MoE layers its stage holds: PP 2 cuts each family after
        # layer 0 (DeepSeek-V3's dense one), D 4 keeps the whole model on every rank.
        layers = EXPERT_LAYERS[family]
        if mesh.startswith("pp2"):
            first = layers - 1  # DeepSeek-V3: none in stage 0
            assert r["expert_parallel_modules"] == [first, first, 1, 1], case
        else:
            assert r["expert_parallel_modules"] == [layers] * 4, case
        for optimizer in ("sgd", "adamw"):
            assert r[optimizer]["max_relative"] < 1e-4, (case, optimizer)
            if mesh.endswith("zero1"):  # the dense and expert states sharded apart
                # (DeepSeek-V3's stage 0, its dense layer only, keeps the plain ZeRO-1)
                kinds = set(r[optimizer]["optimizer_class"])
                assert "ExpertZeroOptimizer" in kinds, case
                assert kinds <= {"ExpertZeroOptimizer", "ZeroRedundancyOptimizer"}, case
                assert r["plan"]["shard"] == "optimizer"


def _plan(**fields: Any) -> Plan:
    """A 2-stage x 2-replica plan for 4 processes (1F1B, 2 micro-batches)."""
    from distributed_cases import make_plan

    plan = make_plan([["a"], ["b"]], 2, 8, schedule="1f1b")
    return dataclasses.replace(plan, data_parallel=2, **fields)


def test_the_plan_refusals_are_one_line() -> None:
    from autopipe.runtime.distributed.mesh import expert_plan_problem, mesh_size_problem

    plan = _plan(expert_parallel=2)
    assert expert_plan_problem(plan) is None
    assert expert_plan_problem(_plan(expert_parallel=2, shard="optimizer")) is None  # ZeRO-1 runs
    # EP x TP runs: each rank's experts are split over the TP ranks too
    assert expert_plan_problem(_plan(expert_parallel=2, tensor_parallel=2)) is None
    assert mesh_size_problem(plan, 4) is None
    # EP x TP x CP runs too: EP carved out of dp x cp, each expert split over TP (the CP
    # launch's mixtral:cp2tp2ep2)
    both = _plan(expert_parallel=2, tensor_parallel=2, context_parallel=2)
    assert expert_plan_problem(both) is None
    assert mesh_size_problem(both, 16) is None  # K 2 x D 2 x C 2 x T 2
    for bad, phrase in [
        (_plan(expert_parallel=4), "must divide the 2 data-parallel replicas"),
        (
            _plan(expert_parallel=8, tensor_parallel=2, context_parallel=2),
            "must divide the 2 x 2 dp x cp ranks",
        ),
    ]:
        why = expert_plan_problem(bad)
        assert why is not None and phrase in why and "\n" not in why
    # with context parallelism the EP group is carved out of dp x cp (D 2 x C 2 holds E 4)
    assert mesh_size_problem(_plan(context_parallel=2, expert_parallel=4), 8) is None


class _ListExperts(nn.Module):
    """Experts as a list of MLPs (transformers 4's layout): not a fused experts module."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 2
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_unrecognised_or_indivisible_experts_are_refused_in_one_line() -> None:
    from autopipe.runtime.distributed.expert_parallel import ExpertParallelError, expert_modules

    with pytest.raises(ExpertParallelError, match="not a fused experts module") as exc:
        expert_modules(nn.Sequential(_ListExperts()), 2)
    assert "\n" not in str(exc.value)
    with pytest.raises(ExpertParallelError, match="no experts module"):
        expert_modules(nn.Sequential(nn.Linear(4, 4)), 2)
    model = mesh_zoo_models.build("qwen3_moe")
    assert expert_modules(model, 2) == {
        "model.layers.0.mlp.experts": 4,
        "model.layers.1.mlp.experts": 4,
    }
    with pytest.raises(ExpertParallelError, match="4 experts, which expert parallelism 3"):
        expert_modules(model, 3)


def test_an_inlined_experts_region_becomes_one_call_computing_the_same() -> None:
    """torch.export inlines the experts' forward; the rewrite calls the module with (hidden,
    indices, weights) told apart by dtype and shape, and the model's output is unchanged."""
    from autopipe.profiler.trace import trace_model
    from autopipe.runtime.distributed.expert_parallel import call_expert_modules, expert_modules

    model = mesh_zoo_models.build("qwen3_moe", "float64")
    inputs = mesh_zoo_models.example_inputs("qwen3_moe", 4)
    graph, tracer = trace_model(model, inputs)
    assert tracer == "export"
    want = graph(**inputs).logits
    paths = expert_modules(model, 2)
    renamed = call_expert_modules(graph, paths)
    assert len(renamed) == 2
    for path in paths:
        graph.set_submodule(path, model.get_submodule(path))
    calls = [n.target for n in graph.graph.nodes if n.op == "call_module"]
    assert calls == list(paths)
    assert not any(
        n.op == "get_attr" and ".experts." in str(n.target) for n in graph.graph.nodes
    )  # the experts' weights are read by the call only
    assert torch.equal(graph(**inputs).logits, want)


def test_dispatch_on_one_rank_equals_the_experts_own_forward() -> None:
    """Sorting by expert, the exchange, the experts' own forward at weight 1, the inverse
    order and the routing weights: output and every gradient as the model's module."""
    from datetime import timedelta

    import torch.distributed as dist
    from autopipe.runtime.distributed.expert_parallel import ExpertParallel
    from torch.distributed.device_mesh import init_device_mesh

    model = mesh_zoo_models.build("qwen3_moe", "float64")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 32, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.randint(0, 4, (12, 2), generator=g)
    weights = torch.rand(12, 2, dtype=torch.float64, generator=g, requires_grad=True)

    want = experts(hidden, index, weights)
    (want * torch.arange(32)).sum().backward()
    wanted = [hidden.grad.clone(), weights.grad.clone()]
    wanted += [p.grad.clone() for p in experts.parameters()]
    hidden.grad = weights.grad = None

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        spread = ExpertParallel(experts, dict(experts.named_parameters()), mesh, 4)
        got = spread(hidden, index, weights)
        (got * torch.arange(32)).sum().backward()
        grads = [hidden.grad, weights.grad] + [p.grad.full_tensor() for p in spread.parameters()]
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(grads) == len(wanted) == 4
    for a, b in zip(grads, wanted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


TINY_MOE_FILE = '''"""A tiny Qwen3-MoE (2 layers, 4 experts, 2 per token) for the expert-parallel CLI test."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def build_model():
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=32, use_cache=False, experts_implementation="batched_mm",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def example_inputs(batch_size=8):
    ids = torch.randint(0, 128, (batch_size, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}
'''


@pytest.mark.slow
def test_cli_plans_expert_parallelism_and_torchrun_trains_it(tmp_path: Path) -> None:
    """``autopipe plan --expert-parallel 2`` on a model file, then ``autopipe run`` under
    torchrun (4 gloo processes) trains the plan (the planner's choice of sharding kept)."""
    import json
    import os
    import subprocess

    from distributed_cases import free_port

    root = Path(__file__).resolve().parents[1]
    model, plan, log = tmp_path / "tiny_moe.py", tmp_path / "plan.json", tmp_path / "steps.json"
    model.write_text(TINY_MOE_FILE)
    env = {**os.environ, "AUTOPIPE_CACHE_DIR": str(tmp_path / "cache")}
    planned = subprocess.run(
        [
            sys.executable, "-m", "autopipe", "plan", str(model), "--gpus", "4",
            "--data-parallel", "2", "--tensor-parallel", "1", "--expert-parallel", "2",
            "--schedule", "1f1b", "--microbatches", "2", "--allreduce-bandwidth", "10GB/s",
            "--json", str(plan),
        ],
        capture_output=True, text=True, cwd=root, timeout=600, env=env,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    written = load_plan(plan)
    assert (written.num_stages, written.data_parallel, written.expert_parallel) == (2, 2, 2)
    ran = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--master-port", str(free_port()),
            "-m", "autopipe", "run", str(model), "--plan", str(plan),
            "--steps", "3", "--timeout", "120", "--json", str(log),
        ],
        capture_output=True, text=True, cwd=root, timeout=900, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "2 stages x 2 replicas, experts over EP 2" in ran.stdout
    steps = json.loads(log.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[-1]["loss"] < steps[0]["loss"]  # it trains


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_tp_slices_of_every_expert_sum_to_the_experts_output(family: str) -> None:
    """Megatron-style expert TP (T = 2): rank r's slices (gate_up as ``[gate_r; up_r]``,
    down's columns r) run through the model's own experts forward give partial outputs
    whose sum is the whole module's, for every family's fused layout; a plain ``Shard`` of
    the fused dim (rank 0 all of gate, rank 1 all of up) does not."""
    from autopipe.runtime.distributed.expert_parallel import _local_slice, expert_tp_placements
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    model = mesh_zoo_models.build(family, "float64")
    path = next(n for n, m in model.named_modules() if type(m).__name__.endswith("Experts"))
    experts = model.get_submodule(path)
    placements = expert_tp_placements(experts, 2)
    assert placements == {"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 32, dtype=torch.float64, generator=g)
    index = torch.randint(0, experts.num_experts, (10, 2), generator=g)
    weights = torch.rand(10, 2, dtype=torch.float64, generator=g)
    want = experts(hidden, index, weights)
    whole = dict(experts.named_parameters())

    def summed(placed: dict[str, Any]) -> torch.Tensor:
        inner = copy.copy(experts)
        parts = []
        for rank in range(2):
            local = {n: _local_slice(p.detach(), placed[n], 2, rank) for n, p in whole.items()}
            assert local["gate_up_proj"].shape[1] == whole["gate_up_proj"].shape[1] // 2
            assert local["down_proj"].shape[2] == whole["down_proj"].shape[2] // 2
            parts.append(torch.func.functional_call(inner, local, (hidden, index, weights)))
        return parts[0] + parts[1]

    torch.testing.assert_close(summed(placements), want, rtol=1e-12, atol=1e-12)
    plain = {**placements, "gate_up_proj": Shard(1)}
    assert not torch.allclose(summed(plain), want)


def test_experts_tp_leaves_whole_what_a_sum_of_slices_does_not_compute() -> None:
    """Biases, a norm after each expert, a gate of its own, an indivisible intermediate
    size and a module without Hugging Face's layout attributes each stay whole, with the
    reason in one line."""
    from autopipe.runtime.distributed.expert_parallel import (
        expert_tp_placements,
        tp_expert_modules,
    )

    model = mesh_zoo_models.build("mixtral")
    split, whole = tp_expert_modules(model, 2)
    assert sorted(split) == [f"model.layers.{i}.mlp.experts" for i in range(2)] and not whole
    experts = model.get_submodule("model.layers.0.mlp.experts")
    for change, phrase in [
        ({"has_bias": True}, "biases"),
        ({"has_post_expert_norm": True}, "normalizes each expert"),
        ({"_apply_gate": lambda x: x}, "gates with a function of its own"),
        ({"intermediate_dim": 63}, "not divisible by TP 2"),
    ]:
        odd = copy.copy(experts)
        if "_apply_gate" in change:
            odd.__class__ = type("OddExperts", (type(experts),), change)
        else:
            odd.__dict__.update(change)
        why = expert_tp_placements(odd, 2)
        assert isinstance(why, str) and phrase in why and "\n" not in why, why
    assert "known weight layout" in str(expert_tp_placements(_ListExperts(), 2))
